"""
Tests for nanochat/data/streaming/streamed_split.py: the split a streaming loader reads, whether
its files are on disk or not. Without a listing the dataset's names (val its last index, train the
first num_shards); with one, the rule on disk (val the last name). Each name comes with its path in
data_dir and its address at the source. The streaming loader itself: tests/data/streaming/.
Hermetic: nothing is fetched. Run:
    python -m pytest tests/data/streaming/test_streamed_split.py -q
"""

import os

import pytest

from nanochat.data.base.datasets import get_data_dir
from nanochat.data.streaming.streamed_split import stream_source, streamed_split

URL = "https://example.com/shards"


def test_without_a_listing_the_datasets_names_apply(tmp_path):
    data_dir = get_data_dir("fineweb-edu-100b")
    got_dir, paths, urls, val = streamed_split("train", data_dir, 3, URL)
    names = ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    assert got_dir == data_dir and val == "shard_01822.parquet"
    assert paths == [os.path.join(data_dir, n) for n in names]
    assert urls == [f"{URL}/{n}" for n in names]
    _, paths, urls, _ = streamed_split("val", data_dir, 3, URL)
    assert paths == [os.path.join(data_dir, "shard_01822.parquet")]
    assert urls == [f"{URL}/shard_01822.parquet"]
    # another directory: the dataset found for the readers, ClimbMix by default
    assert streamed_split("val", str(tmp_path / "cache"), 1, URL)[3] == "shard_06542.parquet"


def test_with_a_listing_val_is_its_last_name(tmp_path):
    listing = ["a.parquet", "b.parquet", "c.parquet", "z.parquet"]
    cache = str(tmp_path / "cache")
    _, paths, urls, val = streamed_split("train", cache, None, URL, listing)
    assert val == "z.parquet" and urls == [f"{URL}/{n}" for n in listing[:3]]
    assert paths == [os.path.join(cache, n) for n in listing[:3]]  # every train name by default
    assert streamed_split("train", cache, 2, URL, listing)[1] == paths[:2]
    assert streamed_split("val", cache, 1, URL, listing)[2] == [f"{URL}/z.parquet"]


@pytest.mark.parametrize("num_shards", [0, 4])
def test_num_shards_counts_train_shards_the_listing_has(tmp_path, num_shards):
    listing = ["a.parquet", "b.parquet", "c.parquet", "z.parquet"]
    with pytest.raises(ValueError, match="num_shards .or NANOCHAT_STREAM_SHARDS.") as info:
        streamed_split("train", str(tmp_path), num_shards, URL, listing)
    assert f"(the train shards {URL}/index.json lists)" in str(info.value)
    with pytest.raises(ValueError, match="'train' or 'val'"):
        streamed_split("test", str(tmp_path), 1, URL, listing)


def test_the_source_is_filled_in_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_DATA_URL", URL)
    assert stream_source(str(tmp_path), None) == (str(tmp_path), URL)
    with pytest.raises(ValueError, match="is the source directory"):
        stream_source(str(tmp_path), str(tmp_path))
