"""
Tests for nanochat/data/base/parquet.py: opening a shard and reading a row group's `text` column,
with errors that name the file, the row group and the fix (`python -m nanochat.dataset --verify`).
Hermetic: tiny shards in tmp_path. Run:
    python -m pytest tests/data/base/test_parquet.py -q
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_shard
from nanochat.data.base.parquet import (open_parquet, read_row_group_column, read_row_group_texts,
                                        verify_hint)


def test_a_row_group_reads_as_its_texts(tmp_path):
    path = str(tmp_path / "shard_00000.parquet")
    write_shard(path, ["a", "bb", "ccc", "dddd", "e"], row_group_size=2)
    pf = open_parquet(path)
    assert pf.num_row_groups == 3
    assert [read_row_group_texts(pf, i, path) for i in range(3)] == [["a", "bb"], ["ccc", "dddd"],
                                                                     ["e"]]
    column = read_row_group_column(pf, 1, path)
    assert isinstance(column, pa.ChunkedArray) and column.to_pylist() == ["ccc", "dddd"]


def test_large_string_text_is_text(tmp_path):
    path = str(tmp_path / "large.parquet")
    pq.write_table(pa.table({"text": pa.array(["x", "y"], type=pa.large_string())}), path)
    assert read_row_group_texts(open_parquet(path), 0, path) == ["x", "y"]


@pytest.mark.parametrize("payload", [b"", b"PAR1 not really parquet", b"plain text\n"])
def test_a_file_that_is_not_parquet_names_itself_and_the_fix(tmp_path, payload):
    path = tmp_path / "data" / "shard_00000.parquet"
    path.parent.mkdir()
    path.write_bytes(payload)
    with pytest.raises(ValueError, match="is not a readable parquet file") as info:
        open_parquet(str(path))
    assert str(path) in str(info.value)
    assert f"python -m nanochat.dataset --verify --data-dir {path.parent}" in str(info.value)


def test_a_shard_gone_since_it_was_listed_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist .it was there when the shards"):
        open_parquet(str(tmp_path / "gone.parquet"))


@pytest.mark.parametrize("table, message", [
    (pa.table({"body": ["x", "y"]}), "has no 'text' column .columns: .'body'.."),
    (pa.table({"text": pa.array([1, 2], type=pa.int64())}),
     "row group 0: column 'text' has type int64, expected string"),
    (pa.table({"text": pa.array(["x", None], type=pa.string())}),
     "row group 0: column 'text' has 1 null values"),
])
def test_a_bad_column_names_the_file_and_row_group(tmp_path, table, message):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=message) as info:
        read_row_group_texts(open_parquet(path), 0, path)
    assert str(info.value).startswith(path)


def test_the_fix_names_the_directory_or_the_current_one():
    assert "--verify --data-dir /data/shards lists every bad shard" in verify_hint(
        "/data/shards/shard_00001.parquet")
    assert "--verify --data-dir . lists" in verify_hint("shard_00001.parquet")
