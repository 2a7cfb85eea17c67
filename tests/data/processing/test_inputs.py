"""
A pretokenize run's inputs (nanochat/data/processing/inputs.py): a parquet directory split as on
disk (its last shard is val), jsonl files and directories, each input's pair under
OUTPUT/<split>/[<bucket>/], and the inputs refused up front (two inputs of one pair, a parquet
file given alone, a missing path, an HTTP address). Hermetic: files under tmp_path. Run:
    python -m pytest tests/data/processing/test_inputs.py -q
"""

import os

import pytest

from conftest import write_shards
from nanochat.data.processing.inputs import (STAGING, PairToWrite, is_store, local_input,
                                               plan_pairs)


def test_a_parquet_directory_is_split_as_on_disk(tmp_path):
    data = str(tmp_path / "parquet")
    write_shards(data, [["a"], ["b"], ["c"]], row_group_size=1)
    names = sorted(os.listdir(data))  # shard_00000.parquet ...
    out = str(tmp_path / "out")
    pairs = plan_pairs([data], out)
    assert pairs == [PairToWrite(os.path.join(data, name), os.path.join(out, split, name[:-8]))
                     for name, split in zip(names, ["train", "train", "val"])]
    assert all(pair.staged is None for pair in pairs)  # local: read in place
    # a bucket's pairs go one level deeper
    assert [p.prefix for p in plan_pairs([data], out, bucket="web")] == [
        os.path.join(out, split, "web", f"shard_0000{i}")
        for i, split in enumerate(["train", "train", "val"])]
    with pytest.raises(ValueError, match="parquet dataset, whose last shard is val already; "
                                         "drop --val-input"):
        plan_pairs([data], out, val_inputs=[data])
    with pytest.raises(ValueError, match="pass their directory"):
        plan_pairs([os.path.join(data, names[0])], out)


def test_jsonl_files_and_directories(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("b.jsonl", "a.jsonl.gz", "notes.txt"):
        (raw / name).write_text("")
    val = tmp_path / "v.jsonl"
    val.write_text("")
    out = str(tmp_path / "out")
    # a directory's files sorted, the suffix off each name; val inputs go to val/
    assert plan_pairs([str(raw)], out, val_inputs=[str(val)]) == [
        PairToWrite(str(raw / "a.jsonl.gz"), os.path.join(out, "train", "a")),
        PairToWrite(str(raw / "b.jsonl"), os.path.join(out, "train", "b")),
        PairToWrite(str(val), os.path.join(out, "val", "v"))]
    (raw / "a.jsonl").write_text("")  # a.jsonl and a.jsonl.gz would both write train/a
    with pytest.raises(ValueError, match=r"train inputs \['a'\] would write the same output pair"):
        plan_pairs([str(raw)], out)
    with pytest.raises(ValueError, match="notes.txt is not .jsonl or .jsonl.gz"):
        plan_pairs([str(raw / "notes.txt")], out)
    with pytest.raises(FileNotFoundError, match="--val-input path .*nowhere does not exist"):
        plan_pairs([str(raw / "b.jsonl")], out, val_inputs=[str(tmp_path / "nowhere")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="--input directory .*empty holds no .parquet"):
        plan_pairs([str(empty)], out)


def test_stores_and_local_paths():
    assert is_store("s3://bucket/prefix") and is_store("hf://datasets/o/n")
    assert not is_store("/data/x") and not is_store("file:///data/x")
    assert local_input("file:///data/x") == "/data/x"
    assert local_input("~/x") == os.path.expanduser("~/x")
    assert local_input("s3://bucket/x") == "s3://bucket/x"  # read through the store
    with pytest.raises(ValueError, match="download over HTTP first"):
        plan_pairs(["https://example.com/data"], "/tmp/out")
    with pytest.raises(ValueError, match="pass it alone"):
        plan_pairs(["s3://bucket/data", "/data/more"], "/tmp/out")
    assert STAGING.startswith(".")  # hidden: no listing of pairs or buckets sees it
