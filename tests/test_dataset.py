"""
Tests for nanochat/dataset.py: datasets, listing, splitting and reading shards; repackage.
The downloader and its CLI are tested in tests/data/fetch/test_download.py.
Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/test_dataset.py -q
"""

import gzip
import json
import os
import subprocess
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT, sample_texts, write_shard, write_shards
from nanochat import dataset
from nanochat.dataset import (
    download_single_file, get_data_dir, get_dataset, index_to_filename, list_parquet_files, main,
    parquets_iter_batched, repackage, split_parquet_files,
)



# -----------------------------------------------------------------------------
# Datasets, listing, splitting, reading


def test_import_does_no_io(tmp_path):
    base = tmp_path / "never_created"
    code = ("import logging, nanochat.dataset; "
            "assert not logging.getLogger().handlers, 'import configured logging'")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env)
    assert not base.exists()


def test_get_dataset_and_data_dir(monkeypatch):
    assert get_dataset().name == "climbmix-400b"  # nanochat's own default since 92d63d4
    assert get_dataset().val_filename == "shard_06542.parquet"
    assert get_data_dir().endswith(os.path.join("nanochat_base", "base_data_climbmix"))
    monkeypatch.setenv("NANOCHAT_DATASET", "fineweb-edu-100b")
    assert get_dataset().max_shard == 1822
    assert get_data_dir().endswith(os.path.join("nanochat_base", "base_data"))
    with pytest.raises(ValueError, match="nope"):
        get_dataset("nope")
    with pytest.raises(ValueError, match="nope"):
        download_single_file(0, dataset="nope")


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
# Finding the data with no configuration: where nanochat's downloader puts it


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """Warnings are logged once per process: start each test with none logged yet."""
    monkeypatch.setattr(dataset, "_LOGGED", set())
    caplog.set_level("WARNING", logger="nanochat.dataset")
    return caplog


def _shards(name, indices):
    """Shards of these indices in a dataset's directory, one document and row group each."""
    data_dir = get_data_dir(name)
    os.makedirs(data_dir, exist_ok=True)
    for i in indices:
        write_shard(os.path.join(data_dir, index_to_filename(i)), [f"{name} {i}"],
                    row_group_size=1)
    return data_dir


def _downloaded(name, train_shards):
    """What the downloader writes for a dataset: train shards 0..n-1 and the val shard."""
    return _shards(name, list(range(train_shards)) + [get_dataset(name).max_shard])


def _names(paths):
    return [os.path.basename(p) for p in paths]


@pytest.mark.parametrize("name, val", [("climbmix-400b", "shard_06542.parquet"),
                                       ("fineweb-edu-100b", "shard_01822.parquet")])
def test_the_one_downloaded_dataset_is_found(name, val, fresh_log):
    data_dir = _downloaded(name, 2)
    assert list_parquet_files() == list_parquet_files(data_dir)
    assert _names(split_parquet_files("val")) == [val]
    assert (_names(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_00001.parquet"])
    assert list(parquets_iter_batched("val")) == [[f"{name} {get_dataset(name).max_shard}"]]
    assert list(parquets_iter_batched("train")) == [[f"{name} 0"], [f"{name} 1"]]
    assert not fresh_log.records  # nothing to warn about


def test_both_datasets_present_reads_the_default_and_says_so(fresh_log):
    fineweb = _downloaded("fineweb-edu-100b", 3)
    climbmix = _downloaded("climbmix-400b", 1)
    for _ in range(3):
        assert list_parquet_files() == list_parquet_files(climbmix)
    assert _names(split_parquet_files("val")) == ["shard_06542.parquet"]
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


def test_own_shards_in_the_dataset_dir_use_the_last_file_as_val(fresh_log):
    # a user's own shards where nanochat looks: nanochat's rule (last file is val), one warning
    data_dir = get_data_dir("climbmix-400b")
    write_shards(data_dir, [["a"], ["b"], ["c"]], row_group_size=1)
    for _ in range(2):
        assert _names(split_parquet_files("val")) == ["shard_00002.parquet"]
        assert (_names(split_parquet_files("train"))
                == ["shard_00000.parquet", "shard_00001.parquet"])
    [record] = fresh_log.records
    assert "shard_06542.parquet" in record.message and "shard_00002.parquet" in record.message
    assert "python -m nanochat.dataset --dataset climbmix-400b -n 0" in record.message


def test_a_train_shard_named_like_the_other_datasets_val_is_train(fresh_log):
    # shard_01822 is FineWeb's val shard but an ordinary ClimbMix train shard
    _shards("climbmix-400b", (0, 1822, 6542))
    assert _names(split_parquet_files("val")) == ["shard_06542.parquet"]
    assert (_names(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_01822.parquet"])


def test_own_shards_past_the_val_index_keep_nanochats_rule(fresh_log):
    # 1900 of one's own shards in FineWeb's directory: its val index 1822 is a train shard there
    _shards("fineweb-edu-100b", (0, 1822, 1899))
    assert _names(split_parquet_files("val")) == ["shard_01899.parquet"]
    assert (_names(split_parquet_files("train"))
            == ["shard_00000.parquet", "shard_01822.parquet"])
    [record] = fresh_log.records
    assert ("shard_01899.parquet, is val" in record.message
            and "shard_01822.parquet sorts before it" in record.message)


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
    assert _names(split_parquet_files("val")) == ["shard_01822.parquet"]
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


# -----------------------------------------------------------------------------
# Repackaging your own data


def _write_inputs(folder) -> tuple[list[str], list[str]]:
    """One input of each kind, 2600 distinct documents in all; returns (paths, documents)."""
    docs = sample_texts(7, 2600)
    txt, jsonl, jsonl_gz, parquet = docs[:600], docs[600:1200], docs[1200:1900], docs[1900:]
    paths = [str(folder / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz", "d.parquet")]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write("\n\n".join(txt) + "\n   \n")  # blank and whitespace-only lines are not documents
    with open(paths[1], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(jsonl))
    with gzip.open(paths[2], "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in jsonl_gz)
    pq.write_table(pa.table({"url": ["u"] * len(parquet), "text": parquet}), paths[3],
                   row_group_size=100)
    return paths, docs


def test_repackage_all_input_kinds(tmp_path):
    paths, docs = _write_inputs(tmp_path)
    out = tmp_path / "out"
    # 2 shards of 1300: row groups 1024 + 276
    shards = repackage(paths, str(out), docs_per_shard=1500)
    assert [os.path.basename(p) for p in shards] == [index_to_filename(i) for i in range(2)]
    assert list_parquet_files(str(out)) == shards  # no temp files left behind
    train = [d for rg in parquets_iter_batched("train", data_dir=str(out)) for d in rg]
    val = [d for rg in parquets_iter_batched("val", data_dir=str(out)) for d in rg]
    assert Counter(train + val) == Counter(docs)  # every document exactly once
    assert len(val) == pq.ParquetFile(shards[-1]).metadata.num_rows  # the last shard is val
    assert train[:len(docs) // 10] != docs[:len(docs) // 10]  # shuffled
    for path in shards:
        pf = pq.ParquetFile(path)
        assert (pf.schema_arrow.names == ["text"]
                and pf.schema_arrow.field("text").type == pa.string())
        rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        assert rows[:-1] == [1024] * (len(rows) - 1) and 0 < rows[-1] <= 1024
        assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
    assert [pq.ParquetFile(p).num_row_groups for p in shards] == [2, 2]


def test_repackage_cli_by_size_and_seed(tmp_path, capsys):
    paths, docs = _write_inputs(tmp_path)
    args = ["repackage"] + paths + ["--shard-size-mb", "0.02", "--seed", "1"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert "is val" in capsys.readouterr().out
    shards = list_parquet_files(str(tmp_path / "a"))
    assert len(shards) >= 3
    # the size target is an estimate from a compressed sample; allow parquet overhead on tiny shards
    assert all(os.path.getsize(p) < 2 * 0.02e6 for p in shards)
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    same = [pq.read_table(p).column("text").to_pylist()
            for p in list_parquet_files(str(tmp_path / "b"))]
    # same seed, same shards
    assert same == [pq.read_table(p).column("text").to_pylist() for p in shards]


def test_repackage_cli_echoes_the_size_it_uses(tmp_path, capsys):
    paths, _ = _write_inputs(tmp_path)
    assert main(["repackage", *paths, "--out", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f" shard_size_mb={dataset.SHARD_SIZE_MB:g} " in first and "None" not in first
    assert "docs_per_shard" not in first  # (not the rule this run uses)
    assert main(["repackage", *paths, "--out", str(tmp_path / "b"), "--docs-per-shard", "7"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert " docs_per_shard=7 " in first and "shard_size_mb" not in first


def test_repackage_few_documents_still_makes_train_and_val(tmp_path):
    (tmp_path / "few.txt").write_text("one\ntwo\nthree\n", encoding="utf-8")
    shards = repackage([str(tmp_path / "few.txt")], str(tmp_path / "out"))
    assert [pq.ParquetFile(p).metadata.num_rows for p in shards] == [2, 1]
    (tmp_path / "one.txt").write_text("lonely\n", encoding="utf-8")
    with pytest.raises(ValueError, match="at least 2 documents"):
        repackage([str(tmp_path / "one.txt")], str(tmp_path / "out2"))


def test_repackage_bad_inputs(tmp_path):
    out = str(tmp_path / "out")
    good = tmp_path / "good.txt"
    good.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        repackage([str(good), str(tmp_path / "missing.jsonl")], out)
    (tmp_path / "no_field.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"no_field.jsonl line 1: no 'text' field"):
        repackage([str(tmp_path / "no_field.jsonl")], out)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl line 2: invalid JSON"):
        repackage([str(tmp_path / "bad.jsonl")], out)
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "no_col.parquet")
    with pytest.raises(ValueError, match="no_col.parquet has no 'text' column"):
        repackage([str(tmp_path / "no_col.parquet")], out)
    (tmp_path / "data.csv").write_text("text\nx\n", encoding="utf-8")
    with pytest.raises(ValueError, match="data.csv: unsupported"):
        repackage([str(tmp_path / "data.csv")], out)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="latin1.txt is not valid UTF-8"):
        repackage([str(tmp_path / "latin1.txt")], out)
    assert not os.path.exists(out)  # nothing was written for any bad input
    # --text-field picks another field; an out dir that already has shards is refused
    (tmp_path / "body.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n', encoding="utf-8")
    repackage([str(tmp_path / "body.jsonl")], out, text_field="body")
    with pytest.raises(FileExistsError, match="empty --out"):
        repackage([str(good)], out)
