"""
Tests for nanochat/data/fetch/listing.py: a listing's names (index.json's files, sorted, parquet
only), the errors of a wrong one naming its URL, a store's listing, and check_own: a listing of
shards of your own never goes into a dataset's directory. The listing served by `python -m
nanochat.dataset serve` is tested end to end in tests/data/fetch/test_own_shards.py.
Hermetic: tmp_path only. Run:
    python -m pytest tests/data/fetch/test_listing.py -q
"""

import json

import pytest

from conftest import write_shard
from nanochat.data.base.datasets import get_data_dir
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.listing import (check_own, listing_source, listing_url, parse_listing,
                                         read_listing)

URL = "http://127.0.0.1:8000/index.json"


def test_a_listing_names_its_parquet_files_sorted():
    body = json.dumps({"files": [{"name": "b.parquet", "size": 12}, {"name": "a.parquet"},
                                 {"name": "notes.txt", "size": 3}]}).encode()
    assert parse_listing(body, URL) == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize("body, message", [
    (b"not json {", "is not JSON"),
    (b'{"shards": ["a.parquet"]}', "has no list of files with names"),
    (b'{"files": [{"size": 3}]}', "has no list of files with names"),
    (b'{"files": [{"name": "only.parquet"}]}', "lists 1 parquet files; a loader needs at least 2"),
    (b'{"files": [{"name": "a.parquet"}, {"name": "a.parquet"}]}', "names a file twice"),
    (b'{"files": [{"name": "x/a.parquet"}, {"name": "b.parquet"}]}', "which is not a file name"),
])
def test_a_wrong_listing_names_its_url_and_the_form(body, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_listing(body, URL)
    assert str(info.value).startswith(f"the shard listing {URL} ")


def test_where_a_listing_is():
    assert listing_url("http://h:1/shards/") == "http://h:1/shards/index.json"
    assert listing_source("https://u:pw@h/x") == "https://h/x/index.json"  # no password shown
    assert listing_source("s3://bucket/prefix") == "s3://bucket/prefix"


def test_a_local_directory_lists_the_parquet_files_directly_in_it(tmp_path):
    for name in ("b.parquet", "a.parquet", "sub/c.parquet"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        write_shard(tmp_path / name, [name], row_group_size=1)
    (tmp_path / "notes.txt").write_text("x")
    assert read_listing(str(tmp_path), Limits()) == ["a.parquet", "b.parquet"]


def test_your_own_shards_never_go_into_a_datasets_directory(tmp_path):
    own = ["a.parquet", "b.parquet"]
    check_own(own, str(tmp_path / "cache"), "the source")  # a directory of their own: fine
    mirror = [f"shard_{i:05d}.parquet" for i in range(3)] + ["shard_06542.parquet"]
    check_own(mirror, get_data_dir("climbmix-400b"), "the source")  # the dataset's own names
    with pytest.raises(ValueError, match="the source lists shards of your own .val b.parquet.") \
            as info:
        check_own(own, get_data_dir("climbmix-400b"), "the source")
    assert "is the directory of climbmix-400b" in str(info.value)
