"""
python -m nanochat.pretokenize's command line with a tokenizer that is slow by construction:
every encode call sleeps SLOW_PRETOKENIZE_SECONDS (default 0.1) first, so that a test can kill a
run in the middle. The tokens are those of the real tokenizer. Used by test_pretokenize.py:
    python tests/slow_pretokenize.py --input ... --output ... [pretokenize's arguments]
Spawned workers import this script as their main module too, so they run the slow tokenizer as well.
"""

import os
import time

from nanochat import pretokenize
from nanochat.tokenizer import RustBPETokenizer

_encode_to_arrays = RustBPETokenizer.encode_to_arrays


def _slow_encode_to_arrays(self, *args, **kwargs):
    time.sleep(float(os.environ.get("SLOW_PRETOKENIZE_SECONDS", "0.1")))
    return _encode_to_arrays(self, *args, **kwargs)


RustBPETokenizer.encode_to_arrays = _slow_encode_to_arrays

if __name__ == "__main__":
    pretokenize.command()  # as `python -m nanochat.pretokenize` runs it
