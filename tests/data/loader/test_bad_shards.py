"""
Reading a bad parquet shard (0 bytes, truncated, not parquet, a corrupt page) is a ValueError that
names the file (and the row group, when the footer reads but a row group does not) and the fix,
from every reader: the plain iterator, the tokenizing loaders and pretokenize.
Run: python -m pytest tests/data/loader/test_bad_shards.py -q
"""

import os

import pyarrow.parquet as pq
import pytest

from conftest import ByteTokenizer, write_shards
from nanochat.dataloader import (tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.dataset import parquets_iter_batched
from nanochat.data.processing.tokenize_pair import pretokenize_file
from nanochat.tokenizer import RustBPETokenizer


def _corrupt_page(data: bytes, path: str) -> bytes:
    """The file with the header of row group 1's first page overwritten: the footer still reads."""
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    first = chunk.dictionary_page_offset or chunk.data_page_offset
    return data[:first] + b"\xff" * 16 + data[first + 16:]


BAD = {
    "empty": (lambda data, path: b"", "is not a readable parquet file"),
    "truncated": (lambda data, path: data[:len(data) // 2], "is not a readable parquet file"),
    "html": (lambda data, path: b"<html><body>Rate limited</body></html>",
             "is not a readable parquet file"),
    "corrupt page": (_corrupt_page, "row group 1 could not be read"),
}


@pytest.fixture(params=sorted(BAD))
def bad_shard(request, tmp_path):
    """A data dir of 3 shards (2 row groups each) whose first train shard is broken one way."""
    files = [[f"shard {s} document {d} " * 8 for d in range(8)] for s in range(3)]
    paths = write_shards(tmp_path, files, row_group_size=4)
    damage, message = BAD[request.param]
    with open(paths[0], "rb") as f:
        broken = damage(f.read(), paths[0])
    with open(paths[0], "wb") as f:
        f.write(broken)
    return str(tmp_path), paths[0], message


def _check(error, path: str, message: str) -> None:
    text = str(error.value)
    assert path in text and message in text
    assert f"python -m nanochat.dataset --verify --data-dir {os.path.dirname(path)}" in text


def test_iterator_names_file_row_group_and_fix(bad_shard):
    data_dir, path, message = bad_shard
    with pytest.raises(ValueError) as error:
        list(parquets_iter_batched("train", data_dir=data_dir))
    _check(error, path, message)


@pytest.mark.parametrize("make", [tokenizing_distributed_data_loader_with_state_bos_bestfit,
                                  tokenizing_distributed_data_loader_with_state])
def test_loaders_name_file_row_group_and_fix(bad_shard, make):
    data_dir, path, message = bad_shard
    loader = make(ByteTokenizer(), 2, 16, "train", device="cpu", data_dir=data_dir, rank=0,
                  world_size=1)
    try:
        with pytest.raises(ValueError) as error:
            # the bad shard comes first: its error must surface, not a batch from shard 1
            for _ in range(100):
                next(loader)
    finally:
        loader.close()
    _check(error, path, message)


def test_pretokenize_names_file_row_group_and_fix(bad_shard, tmp_path):
    data_dir, path, message = bad_shard
    tokenizer = RustBPETokenizer.train_from_iterator(iter(["shard document " * 50]), 270)
    with pytest.raises(ValueError) as error:
        pretokenize_file(tokenizer, path, str(tmp_path / "out" / "shard_00000"))
    _check(error, path, message)
    out = tmp_path / "out"
    assert not out.exists() or not [n for n in os.listdir(out) if n.endswith((".bin", ".idx"))]
