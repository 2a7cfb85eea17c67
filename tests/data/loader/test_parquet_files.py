"""
Tests for nanochat/data/loader/parquet_files.py: the parquet shards of a directory (partial
downloads never listed) and nanochat's split rule (val is the last file in sorted order, train the
others), also for your own shards in a dataset's directory (one warning naming the val shard), and
the errors of an empty, missing or val-only directory.
Hermetic: tiny shards in tmp_path. Run:
    python -m pytest tests/data/loader/test_parquet_files.py -q
"""

import os

import pytest

from conftest import basenames, dataset_shards, write_shard, write_shards
from nanochat.data.base.datasets import get_data_dir
from nanochat.data.loader.parquet_files import list_parquet_files, split_parquet_files


def test_list_ignores_temp_and_lock_files(tmp_path):
    write_shards(tmp_path, [["a"], ["b"]], row_group_size=1)
    for name in ("shard_00002.parquet.tmp", "shard_00002.parquet.tmp.json",
                 ".shard_00002.parquet.lock", "shard_00000.parquet.json", "notes.txt"):
        (tmp_path / name).write_bytes(b"partial")
    names = [os.path.basename(p) for p in list_parquet_files(str(tmp_path))]
    assert names == ["shard_00000.parquet", "shard_00001.parquet"]


def test_split_val_is_the_last_sorted_file(tmp_path):
    # nanochat's rule, also past a name that is some dataset's val shard
    for name in ("a.parquet", "shard_00000.parquet", "shard_01822.parquet", "z.parquet"):
        write_shard(tmp_path / name, [name], row_group_size=1)
    assert ([os.path.basename(p) for p in split_parquet_files("val", str(tmp_path))]
            == ["z.parquet"])
    train = [os.path.basename(p) for p in split_parquet_files("train", str(tmp_path))]
    assert train == ["a.parquet", "shard_00000.parquet", "shard_01822.parquet"]


def test_split_without_known_val_uses_last_sorted(tmp_path):
    write_shards(tmp_path, [["a"], ["b"], ["c"]], row_group_size=1)
    assert ([os.path.basename(p) for p in split_parquet_files("val", str(tmp_path))]
            == ["shard_00002.parquet"])
    assert len(split_parquet_files("train", str(tmp_path))) == 2
    with pytest.raises(ValueError, match="'train' or 'val'"):
        split_parquet_files("test", str(tmp_path))


def test_split_single_shard_has_no_train(tmp_path):
    write_shards(tmp_path, [["only"]], row_group_size=1)
    assert len(split_parquet_files("val", str(tmp_path))) == 1
    with pytest.raises(FileNotFoundError, match="train split is empty"):
        split_parquet_files("train", str(tmp_path))


def test_missing_or_empty_dir_names_the_download_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m nanochat.dataset"):
        split_parquet_files("train", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="python -m nanochat.dataset"):
        split_parquet_files("train", str(tmp_path))  # exists, but holds no shards



# -----------------------------------------------------------------------------
# Your own shards in a dataset's directory: nanochat's rule, and one warning


def test_own_shards_in_the_dataset_dir_use_the_last_file_as_val(fresh_log):
    # a user's own shards where nanochat looks: nanochat's rule (last file is val), one warning
    data_dir = get_data_dir("climbmix-400b")
    write_shards(data_dir, [["a"], ["b"], ["c"]], row_group_size=1)
    for _ in range(2):
        assert basenames(split_parquet_files("val")) == ["shard_00002.parquet"]
        assert (basenames(split_parquet_files("train"))
                == ["shard_00000.parquet", "shard_00001.parquet"])
    [record] = fresh_log.records
    assert "shard_06542.parquet" in record.message and "shard_00002.parquet" in record.message
    assert "python -m nanochat.dataset --dataset climbmix-400b -n 0" in record.message


def test_a_train_shard_named_like_the_other_datasets_val_is_train(fresh_log):
    # shard_01822 is FineWeb's val shard but an ordinary ClimbMix train shard
    dataset_shards("climbmix-400b", (0, 1822, 6542))
    assert basenames(split_parquet_files("val")) == ["shard_06542.parquet"]
    assert (basenames(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_01822.parquet"])


def test_own_shards_past_the_val_index_keep_nanochats_rule(fresh_log):
    # 1900 of one's own shards in FineWeb's directory: its val index 1822 is a train shard there
    dataset_shards("fineweb-edu-100b", (0, 1822, 1899))
    assert basenames(split_parquet_files("val")) == ["shard_01899.parquet"]
    assert (basenames(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_01822.parquet"])
    [record] = fresh_log.records
    assert ("shard_01899.parquet, is val" in record.message
            and "shard_01822.parquet sorts before it" in record.message)
