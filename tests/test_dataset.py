"""
Tests for nanochat/dataset.py's own API: importing it does nothing, nanochat's
parquets_iter_batched (start/step across ranks, errors naming the file and row group), and
download_single_file's check of the dataset's name. The pieces behind it are tested beside their
modules: tests/data/base/test_datasets.py (the table, a directory's split, reading a shard),
tests/data/fetch/ (repackage, listing, address, and the downloader and its CLI in test_download.py).
Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/test_dataset.py -q
"""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT, write_shard, write_shards
from nanochat.dataset import download_single_file, parquets_iter_batched


def test_import_does_no_io(tmp_path):
    base = tmp_path / "never_created"
    code = ("import logging, nanochat.dataset; "
            "assert not logging.getLogger().handlers, 'import configured logging'")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env)
    assert not base.exists()


def test_an_unknown_dataset_is_named():
    with pytest.raises(ValueError, match="nope"):
        download_single_file(0, dataset="nope")


def test_parquets_iter_batched_start_step(tmp_path):
    # 2 train shards of 5 row groups (2 docs each) + a val shard
    files = [[f"s{s}d{d}" for d in range(10)] for s in range(3)]
    write_shards(tmp_path, files, row_group_size=2)
    got = list(parquets_iter_batched("train", start=1, step=2, data_dir=str(tmp_path)))
    assert got == [["s0d2", "s0d3"], ["s0d6", "s0d7"], ["s1d2", "s1d3"], ["s1d6", "s1d7"]]
    # all ranks together cover the split exactly once
    ranks = [doc for r in range(3) for rg in parquets_iter_batched("train", r, 3, str(tmp_path))
             for doc in rg]
    assert sorted(ranks) == sorted(files[0] + files[1])
    assert ([d for rg in parquets_iter_batched("val", data_dir=str(tmp_path)) for d in rg]
            == files[2])
    with pytest.raises(ValueError, match="step"):
        next(parquets_iter_batched("train", step=0, data_dir=str(tmp_path)))


@pytest.mark.parametrize("table, message", [
    (pa.table({"body": ["x", "y"]}), "no 'text' column"),
    (pa.table({"text": pa.array([1, 2], type=pa.int64())}),
     "row group 0: column 'text' has type int64"),
    (pa.table({"text": pa.array(["x", None], type=pa.string())}),
     "row group 0: column 'text' has 1 null"),
])
def test_read_errors_name_file_and_row_group(tmp_path, table, message):
    path = tmp_path / "shard_00000.parquet"
    pq.write_table(table, path)
    write_shard(tmp_path / "shard_00001.parquet", ["val"], row_group_size=1)
    with pytest.raises(ValueError, match=message) as info:
        list(parquets_iter_batched("train", data_dir=str(tmp_path)))
    assert str(path) in str(info.value)
