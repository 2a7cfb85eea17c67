"""
Tests for nanochat/data/fetch/address.py: an address as messages show it (no user:password, no
secret of the environment), and check_source: a local directory as the source must be one, and
apart from data_dir (never the same directory, never one inside it).
Hermetic: tmp_path only. Run:
    python -m pytest tests/data/fetch/test_address.py -q
"""

import os

import pytest

from nanochat.data.fetch.address import check_source, shown
from nanochat.data.streaming.streamed_split import streamed_split

NAMES = ["alpha.parquet", "beta.parquet", "delta.parquet", "gamma.parquet", "omega.parquet"]


def test_messages_show_an_address_without_its_credentials(monkeypatch, tmp_path):
    assert shown("https://user:hunter22@example.com:8443/x") == "https://example.com:8443/x"
    assert shown("s3://bucket/prefix") == "s3://bucket/prefix"
    monkeypatch.setenv("MY_STORE_TOKEN", "tok-123456")
    assert shown("https://example.com/x?sig=tok-123456") == "https://example.com/x?sig=***"
    # a listing of shards of your own, refused for a dataset's directory: the URL is named bare
    dataset_dir = tmp_path / "base_data_climbmix"
    with pytest.raises(ValueError) as error:
        streamed_split("train", str(dataset_dir), base_url="https://user:hunter22@example.com/x",
                       listing=NAMES)
    assert "example.com/x" in str(error.value) and "hunter22" not in str(error.value)


def test_a_local_source_is_a_directory_apart_from_data_dir(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    check_source(str(source), str(tmp_path / "cache"))  # apart: fine
    check_source(f"file://{source}", str(tmp_path / "cache"))
    check_source("https://example.com/x", str(source))  # not local: data_dir is not checked
    for data_dir, words in ((source, "is the source directory"),
                            (source / "cache", "is inside the source directory")):
        with pytest.raises(ValueError, match=f"{words} {source} .base_url.") as info:
            check_source(str(source), str(data_dir))
        assert f"e.g. {source}_cache" in str(info.value)
    with pytest.raises(ValueError, match="is not a directory here; a URL must start with http"):
        check_source(str(tmp_path / "missing"), str(tmp_path / "cache"))
    assert os.listdir(source) == []  # nothing was written into the source
