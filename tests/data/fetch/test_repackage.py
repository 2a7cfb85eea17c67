"""
Tests for nanochat/data/fetch/repackage.py: your own text (.txt, .jsonl, .jsonl.gz, .parquet) as
shuffled zstd shards whose last is val, by size or by documents per shard, through the function and
through `python -m nanochat.dataset repackage`; bad inputs are errors naming the file and line, and
write nothing.
Hermetic: inputs and shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_repackage.py -q
"""

import gzip
import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import sample_texts
from nanochat.data.base.datasets import index_to_filename, list_parquet_files
from nanochat.data.fetch import repackage as repackage_module
from nanochat.data.fetch.repackage import repackage
from nanochat.dataset import main, parquets_iter_batched




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
    assert f" shard_size_mb={repackage_module.SHARD_SIZE_MB:g} " in first and "None" not in first
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
