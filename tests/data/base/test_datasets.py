"""
Tests for nanochat/data/base/datasets.py: the datasets we know (names, val shards, directories),
and finding the data with no configuration, where nanochat's downloader puts it: the one dataset
whose directory holds train shards, the default when both do (said once), NANOCHAT_DATASET.
Hermetic: tiny shards under a tmp base dir. Run:
    python -m pytest tests/data/base/test_datasets.py -q
"""

import os

import pytest

from conftest import basenames, dataset_shards, write_shard, write_shards
from nanochat.data.base.datasets import get_data_dir, get_dataset, index_to_filename
from nanochat.data.loader.parquet_files import list_parquet_files, split_parquet_files
from nanochat.dataset import parquets_iter_batched


def test_get_dataset_and_data_dir(monkeypatch):
    assert get_dataset().name == "climbmix-400b"  # nanochat's own default since 92d63d4
    assert get_dataset().val_filename == "shard_06542.parquet"
    assert get_data_dir().endswith(os.path.join("nanochat_base", "base_data_climbmix"))
    monkeypatch.setenv("NANOCHAT_DATASET", "fineweb-edu-100b")
    assert get_dataset().max_shard == 1822
    assert get_data_dir().endswith(os.path.join("nanochat_base", "base_data"))
    with pytest.raises(ValueError, match="nope"):
        get_dataset("nope")


# -----------------------------------------------------------------------------
# Finding the data with no configuration: where nanochat's downloader puts it


def _downloaded(name, train_shards):
    """What the downloader writes for a dataset: train shards 0..n-1 and the val shard."""
    return dataset_shards(name, list(range(train_shards)) + [get_dataset(name).max_shard])


@pytest.mark.parametrize("name, val", [("climbmix-400b", "shard_06542.parquet"),
                                       ("fineweb-edu-100b", "shard_01822.parquet")])
def test_the_one_downloaded_dataset_is_found(name, val, fresh_log):
    data_dir = _downloaded(name, 2)
    assert list_parquet_files() == list_parquet_files(data_dir)
    assert basenames(split_parquet_files("val")) == [val]
    assert (basenames(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_00001.parquet"])
    assert list(parquets_iter_batched("val")) == [[f"{name} {get_dataset(name).max_shard}"]]
    assert list(parquets_iter_batched("train")) == [[f"{name} 0"], [f"{name} 1"]]
    assert not fresh_log.records  # nothing to warn about


def test_both_datasets_present_reads_the_default_and_says_so(fresh_log):
    fineweb = _downloaded("fineweb-edu-100b", 3)
    climbmix = _downloaded("climbmix-400b", 1)
    for _ in range(3):
        assert list_parquet_files() == list_parquet_files(climbmix)
    assert basenames(split_parquet_files("val")) == ["shard_06542.parquet"]
    [record] = fresh_log.records  # once, however often the data is listed
    assert record.message.startswith(f"found {climbmix} and {fineweb}; reading {climbmix}, "
                                     "the default")
    assert "NANOCHAT_DATASET" in record.message


def test_nanochat_dataset_variable_chooses(monkeypatch, fresh_log):
    fineweb = _downloaded("fineweb-edu-100b", 1)
    _downloaded("climbmix-400b", 1)
    monkeypatch.setenv("NANOCHAT_DATASET", "fineweb-edu-100b")
    assert list_parquet_files() == list_parquet_files(fineweb)
    assert not fresh_log.records


@pytest.mark.parametrize("climbmix_holds", [[], [6542]])
def test_a_dataset_dir_without_train_shards_hides_nothing(climbmix_holds, fresh_log):
    # a failed first download (an empty directory, lock files) or `-n 0` (the val shard alone)
    fineweb = _downloaded("fineweb-edu-100b", 2)
    climbmix = get_data_dir("climbmix-400b")
    os.makedirs(climbmix)
    (open(os.path.join(climbmix, ".shard_00000.parquet.lock"), "w")).close()
    for i in climbmix_holds:
        write_shard(os.path.join(climbmix, index_to_filename(i)), ["v"], row_group_size=1)
    assert list_parquet_files() == list_parquet_files(fineweb)
    assert basenames(split_parquet_files("val")) == ["shard_01822.parquet"]
    assert not fresh_log.records


def test_no_data_anywhere_names_the_default_dir_and_the_download_command():
    with pytest.raises(FileNotFoundError,
                       match="base_data_climbmix does not exist.*python -m nanochat.dataset -n 8"):
        split_parquet_files("train")


def test_loaders_read_the_found_dataset_with_no_configuration(byte_tokenizer):
    from nanochat.dataloader import (
        tokenizing_distributed_data_loader_with_state_bos_bestfit as loader,
    )
    data_dir = get_data_dir("fineweb-edu-100b")
    write_shards(data_dir, [[f"doc {i} " * (i + 1) for i in range(40)]] * 2, row_group_size=8)
    os.replace(os.path.join(data_dir, "shard_00001.parquet"),
               os.path.join(data_dir, "shard_01822.parquet"))
    found = loader(byte_tokenizer, 2, 16, "train", device="cpu", prefetch=0)
    given = loader(byte_tokenizer, 2, 16, "train", device="cpu", prefetch=0, data_dir=data_dir)
    for _ in range(3):
        (x1, y1, s1), (x2, y2, s2) = next(found), next(given)
        assert x1.tolist() == x2.tolist() and y1.tolist() == y2.tolist() and s1 == s2
