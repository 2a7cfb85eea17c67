"""
nanochat/data/tokenizing/tokenizer_files.py: the tokenizer directory's file names, the JSON
format's name and version, the training command's hint, and write_atomic, which leaves a file
whole or not at all (an error or Ctrl-C in the middle leaves the old file and no temporary one).
Run: python -m pytest tests/data/tokenizing/test_tokenizer_files.py -q
"""

import os

import pytest

from nanochat.data.tokenizing import tokenizer_files
from nanochat.data.tokenizing.tokenizer_files import write_atomic


def test_the_names_of_the_files_and_the_format():
    assert (tokenizer_files.TOKENIZER_FILENAME, tokenizer_files.TOKEN_BYTES_FILENAME,
            tokenizer_files.PICKLE_FILENAME) == ("tokenizer.json", "token_bytes.npy",
                                                 "tokenizer.pkl")
    assert (tokenizer_files.FORMAT_NAME, tokenizer_files.FORMAT_VERSION) == (
        "nanochat-tokenizer", 1)
    assert tokenizer_files.TRAIN_HINT == "python -m scripts.tok_train"


def test_write_atomic_writes_through_a_temporary_file_then_renames_it(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    seen = []

    def write(f):
        seen.append(sorted(os.listdir(tmp_path)))  # while writing: only the temporary file
        f.write(b'{"format": ')
        f.write(b'"nanochat-tokenizer"}')

    write_atomic(path, write)
    assert seen == [[f"tokenizer.json.tmp{os.getpid()}"]]
    assert (tmp_path / "tokenizer.json").read_bytes() == b'{"format": "nanochat-tokenizer"}'
    assert os.listdir(tmp_path) == ["tokenizer.json"]


@pytest.mark.parametrize("error", [ValueError("cannot encode"), KeyboardInterrupt()])
def test_a_write_stopped_midway_leaves_the_old_file_and_no_temporary_one(tmp_path, error):
    path = tmp_path / "token_bytes.npy"
    path.write_bytes(b"old")

    def write(f):
        f.write(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        write_atomic(str(path), write)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["token_bytes.npy"]


def test_a_rename_that_fails_removes_the_temporary_file(tmp_path):
    (tmp_path / "tokenizer.pkl").mkdir()  # a directory in the way: the rename fails
    with pytest.raises(IsADirectoryError):
        write_atomic(str(tmp_path / "tokenizer.pkl"), lambda f: f.write(b"data"))
    assert os.listdir(tmp_path) == ["tokenizer.pkl"]
