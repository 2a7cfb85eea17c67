"""
The tokenizer's files: their names, their format, and how they are written.
The tokenizer's files: their names in a tokenizer directory, the name and version of our JSON
format, the command that trains one, and the write that leaves a file whole or not at all.

Cost: none to import; a write is one temporary file and a rename.

May import: the standard library; nothing of ours.
"""

import os

TOKENIZER_FILENAME = "tokenizer.json"
TOKEN_BYTES_FILENAME = "token_bytes.npy"
PICKLE_FILENAME = "tokenizer.pkl"  # nanochat's own format, read with pickle_reader.py
FORMAT_NAME = "nanochat-tokenizer"
FORMAT_VERSION = 1
TRAIN_HINT = "python -m scripts.tok_train"


def write_atomic(path: str, write) -> None:
    """Call write(f) on a temporary file next to path, then rename it to path; on failure remove
    it."""
    tmp_path = f"{path}.tmp{os.getpid()}"  # the pid: two processes saving at once never collide
    try:
        with open(tmp_path, "wb") as f:
            write(f)
        os.replace(tmp_path, path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
