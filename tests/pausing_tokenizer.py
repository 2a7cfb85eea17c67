"""
A byte tokenizer that pauses in the middle of a pair, so that a test can kill the process writing
it (tests/data/processing/test_ray_executor.py), and a pretokenize driver that runs a job of it on a
Ray cluster in its own process, for a test to kill:
    python tests/pausing_tokenizer.py INPUT_DIR OUTPUT_DIR PAUSE_DIR RAY_ADDRESS
"""

import functools
import os
import sys
import time

from byte_tokenizers import ByteArrayTokenizer


class PausingTokenizer(ByteArrayTokenizer):
    """ByteArrayTokenizer that, given a batch whose first text starts with "PAUSE" while the file
    <directory>/pause exists, writes its process id to <directory>/pid and waits until that file is
    removed; a batch whose first text starts with "RAISE" raises RuntimeError."""

    def __init__(self, directory: str):
        self.directory = directory

    def encode_to_arrays(self, texts, prepend=None, num_threads=1):
        if texts and texts[0].startswith("RAISE"):
            raise RuntimeError("a tokenizer bug, raised on purpose")
        pause = os.path.join(self.directory, "pause")
        if texts and texts[0].startswith("PAUSE") and os.path.exists(pause):
            with open(os.path.join(self.directory, "pid.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(self.directory, "pid.tmp"), os.path.join(self.directory, "pid"))
            while os.path.exists(pause):
                time.sleep(0.02)
        return super().encode_to_arrays(texts, prepend, num_threads)


def pausing_job(inputs: str, output: str, pause_dir: str, **changes):
    """A pretokenize job of inputs with the pausing tokenizer."""
    from nanochat.data.processing.units import PretokenizeJob

    # the tokenizer's "file", whose hash pretokenize.json records: this module
    return PretokenizeJob([inputs], output, functools.partial(PausingTokenizer, pause_dir),
                          os.path.abspath(__file__), **changes)


def run_job(job, executor: str, address: str | None = None) -> int:
    """run_pretokenize of the job on one rank, with executor."""
    from nanochat.data.processing.pretokenize_run import PretokenizeRun, run_pretokenize

    return run_pretokenize(PretokenizeRun(job, num_workers=1, rank=0, world_size=1,
                                          lock_timeout=0.0, executor=executor,
                                          ray_address=address))


if __name__ == "__main__":
    import pausing_tokenizer  # the tokenizer by its module's name, which the workers import

    inputs, output, pause_dir, address = sys.argv[1:]
    sys.exit(pausing_tokenizer.run_job(pausing_tokenizer.pausing_job(inputs, output, pause_dir),
                                       "ray", address))
