"""
The parquet datasets (nanochat/data/base/datasets.py): the table and where a dataset's shards
live; a directory's shards and nanochat's split of them (val the last), with the errors for an
empty directory or one of another kind; reading a row group's text, with errors that name the file.

Run: python -m pytest tests/data/base/test_datasets.py -q
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import basenames, dataset_shards, write_shard, write_shards
from nanochat.data.base.datasets import (get_data_dir, get_dataset, index_to_filename,
                                         list_parquet_files, open_parquet, read_row_group_column,
                                         read_row_group_texts, split_parquet_files, verify_hint)
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
