"""
Large inputs split into units (nanochat/data/processing/parts.py, inputs.py): a part's texts
(parquet row groups, jsonl lines by bytes, a .jsonl.gz's through one plain copy), the parts of an
input read in order equal to the whole input, for any number of parts and any line lengths
(hypothesis); how many parts an input gets; their pairs' names, listed in order where the whole
input's pair would be; a rerun that would split an input otherwise, refused; and the pairs of a
split run holding the unsplit run's documents and tokens, in order. Hermetic: files under
tmp_path. Run:
    python -m pytest tests/data/processing/test_parts.py -q
"""

import gzip
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import ByteArrayTokenizer, write_shard
from nanochat.data.base.layout import list_token_shards, part_name
from nanochat.data.pretokenized.token_shards import TokenShard
from nanochat.data.processing.inputs import check_parts, count_parts, plan_pairs
from nanochat.data.processing.parts import text_batches
from nanochat.data.processing.pretokenize_run import PretokenizeRun, run_pretokenize
from nanochat.data.processing.units import PretokenizeJob


def texts_of(path, part=0, parts=1, text_field="text") -> list[str]:
    return [t for batch in text_batches(path, text_field, part, parts) for t in batch]


def write_jsonl(path, texts, newline="\n", blank_every=0) -> str:
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text}) + newline)
            if blank_every and i % blank_every == 0:
                f.write(newline)  # an empty line: skipped by the whole reader and by the parts
    return str(path)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=0, max_size=40),
       parts=st.integers(1, 60), newline=st.sampled_from(["\n", "\r\n", "\r"]),
       blank_every=st.integers(0, 5), last_newline=st.booleans())
def test_a_jsonl_files_parts_hold_its_lines_once_in_order(tmp_path_factory, lengths, parts,
                                                          newline, blank_every, last_newline):
    # lines shorter and longer than a part (parts then hold no line at all), "\r\n" and lone "\r"
    # endings (the whole file's reader splits on both; the bounds only after a "\n"), blank lines,
    # no newline at the end, and characters of several bytes, whose bytes a bound must never split
    path = tmp_path_factory.mktemp("jsonl") / "a.jsonl"
    texts = [("é€" * n)[:n] + f"#{i}" for i, n in enumerate(lengths)]
    write_jsonl(path, texts, newline, blank_every)
    if not last_newline:
        path.write_bytes(path.read_bytes().rstrip(b"\r\n"))
    joined = [t for k in range(parts) for t in texts_of(str(path), k, parts)]
    assert joined == texts_of(str(path)) == texts


def test_a_parquet_files_parts_are_ranges_of_its_row_groups(tmp_path):
    path = str(tmp_path / "a.parquet")
    texts = [f"doc {i}" for i in range(50)]
    write_shard(path, texts, row_group_size=5)  # 10 row groups
    # part k of n: row groups k*10//n up to (k+1)*10//n
    assert texts_of(path, 0, 3) == texts[:15] and texts_of(path, 1, 3) == texts[15:30]
    assert texts_of(path, 2, 3) == texts[30:]
    for parts in (1, 2, 4, 7, 10):
        assert [t for k in range(parts) for t in texts_of(path, k, parts)] == texts


def test_how_many_parts_an_input_gets(tmp_path):
    parquet = str(tmp_path / "a.parquet")
    write_shard(parquet, [f"doc {i} " + "x" * 200 for i in range(40)], row_group_size=10)
    size = os.path.getsize(parquet)
    assert count_parts(parquet, size) == 1  # not larger than a unit: whole
    assert count_parts(parquet, size // 2 + 1) == 2
    assert count_parts(parquet, 1) == 4  # at most one part per row group
    jsonl = write_jsonl(tmp_path / "b.jsonl", ["y" * 100] * 10)
    assert count_parts(jsonl, 1000) == -(-os.path.getsize(jsonl) // 1000)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(open(jsonl).read())
    gz = str(tmp_path / "c.jsonl.gz")
    assert count_parts(gz, 1) == os.path.getsize(gz)  # by its compressed size
    big = write_jsonl(tmp_path / "big.jsonl", ["y" * 1000] * 110)
    with pytest.raises(ValueError, match="split into 11.,... parts, more than a name's 99,999; "
                                         "raise --unit-mb"):
        count_parts(big, 1)
    with pytest.raises(ValueError, match="a part of a .jsonl.gz is read from its plain copy"):
        texts_of(gz, 1, 2)


def test_the_parts_names_and_the_order_the_loaders_list_them_in(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "a.jsonl", ["a" * 50] * 12)  # split in 3
    write_jsonl(raw / "a.b.jsonl", ["small"])  # sorts before "a.part-..." by name, and before a
    write_jsonl(raw / "b.jsonl", ["small"])
    out = str(tmp_path / "out")
    units = plan_pairs([str(raw)], out, unit_bytes=os.path.getsize(raw / "a.jsonl") // 3 + 1)
    names = [os.path.basename(u.prefix) for u in units]
    assert names == ["a.b", "a.part-00000-of-00003", "a.part-00001-of-00003",
                     "a.part-00002-of-00003", "b"]
    assert [(u.part, u.parts) for u in units] == [(0, 1), (0, 3), (1, 3), (2, 3), (0, 1)]
    assert part_name("a", 1, 3) == "a.part-00001-of-00003" and part_name("a", 0, 1) == "a"
    # the loaders list a split input's parts in order, where its whole pair would sort
    train = tmp_path / "train"
    train.mkdir()
    for name in ["b", "a.part-00002-of-00003", "a.pa", "a.part-00000-of-00003", "a.b",
                 "a.part-00001-of-00003"]:
        for suffix in (".bin", ".idx"):
            (train / (name + suffix)).write_bytes(b"")
    listed = [os.path.basename(p) for p in list_token_shards(str(train))]
    # unsplit, a.b.idx < a.idx < a.pa.idx < b.idx: the parts take a.idx's place
    assert listed == ["a.b", "a.part-00000-of-00003", "a.part-00001-of-00003",
                      "a.part-00002-of-00003", "a.pa", "b"]
    (raw / "c.part-00000-of-00002.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"end like the part of a split input"):
        plan_pairs([str(raw)], out)


def a_job(raw, out, unit_bytes) -> PretokenizeRun:
    job = PretokenizeJob([str(raw)], str(out), ByteArrayTokenizer, str(raw / "a.parquet"),
                         unit_bytes=unit_bytes)
    return PretokenizeRun(job, num_workers=2, rank=0, world_size=1, lock_timeout=0.0)


def entries(directory) -> list[np.ndarray]:
    return [TokenShard(p).entry(i) for p in list_token_shards(str(directory))
            for i in range(len(TokenShard(p)))]


def test_a_jsonl_gz_is_split_through_one_plain_copy_removed_with_its_last_part(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    texts = [f"gz document {i} " + "w" * (i % 50) for i in range(600)]
    with gzip.open(raw / "g.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    write_jsonl(tmp_path / "val.jsonl", ["val"])

    def job(out, unit_bytes):
        return PretokenizeRun(PretokenizeJob([str(raw)], str(tmp_path / out), ByteArrayTokenizer,
                                             str(tmp_path / "val.jsonl"),
                                             val_inputs=[str(tmp_path / "val.jsonl")],
                                             unit_bytes=unit_bytes), 2, 0, 1, 0.0)

    assert run_pretokenize(job("whole", None)) == 0
    unit = os.path.getsize(raw / "g.jsonl.gz") // 4 + 1
    [first] = [u for u in plan_pairs([str(raw)], str(tmp_path / "split"), unit_bytes=unit)][:1]
    assert first.parts == 4 and first.staged == str(tmp_path / "split" / ".inputs" / "train" /
                                                    "g.jsonl")
    assert run_pretokenize(job("split", unit)) == 0
    listed = [os.path.basename(p) for p in list_token_shards(str(tmp_path / "split" / "train"))]
    assert listed == [part_name("g", k, 4) for k in range(4)]
    whole, parted = entries(tmp_path / "whole" / "train"), entries(tmp_path / "split" / "train")
    assert len(whole) == len(parted) == 600
    assert all(np.array_equal(a, b) for a, b in zip(whole, parted))
    assert os.listdir(tmp_path / "split" / ".inputs" / "train") == []  # the copy is gone


def test_a_split_run_writes_the_unsplit_runs_documents_in_order(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_shard(str(raw / "a.parquet"), [f"parquet doc {i}" for i in range(64)], 8)
    write_shard(str(raw / "b.parquet"), [f"val doc {i}" for i in range(16)], 8)  # val
    assert run_pretokenize(a_job(raw, tmp_path / "whole", None)) == 0
    assert run_pretokenize(a_job(raw, tmp_path / "split", 1)) == 0  # a part per row group
    assert "2 inputs in 10 units of work" in capsys.readouterr().out
    for split, parts in (("train", 8), ("val", 2)):
        listed = [os.path.basename(p) for p in list_token_shards(str(tmp_path / "split" / split))]
        name = "a" if split == "train" else "b"
        assert listed == [part_name(name, k, parts) for k in range(parts)]
        whole, parted = entries(tmp_path / "whole" / split), entries(tmp_path / "split" / split)
        assert len(whole) == len(parted) == (64 if split == "train" else 16)
        assert all(np.array_equal(a, b) for a, b in zip(whole, parted))
    with open(tmp_path / "whole" / "pretokenize.json") as f, \
            open(tmp_path / "split" / "pretokenize.json") as g:
        assert f.read() == g.read()  # the split is not a setting: names say it
    # a rerun that would split otherwise is refused before it writes anything
    with pytest.raises(ValueError, match=r"a.part-00000-of-00008.idx splits its input otherwise "
                                         r"than this run \(2 parts\): rerun with the --unit-mb"):
        run_pretokenize(a_job(raw, tmp_path / "split", os.path.getsize(raw / "a.parquet") // 2))
    with pytest.raises(ValueError, match=r"otherwise than this run \(one pair, unsplit\)"):
        run_pretokenize(a_job(raw, tmp_path / "split", None))
    with pytest.raises(ValueError, match=r"a.idx splits its input otherwise than this run "
                                         r"\(8 parts\)"):
        check_parts(plan_pairs([str(raw)], str(tmp_path / "whole"), unit_bytes=1))
    check_parts(plan_pairs([str(raw)], str(tmp_path / "split"), unit_bytes=1))  # the same: fine
