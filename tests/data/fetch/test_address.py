"""
Tests for nanochat/data/fetch/address.py: an address's forms (checked, taken apart, joined, the
store each names), an address as messages show it (no user:password, no secret of the
environment), and check_source: a local directory as the source must be one, and apart from
data_dir (never the same directory, never one inside it).
Hermetic: tmp_path only. Run:
    python -m pytest tests/data/fetch/test_address.py -q
"""

import os

import pytest

from nanochat.data.fetch.address import (LOCAL, check_source, check_store_address, is_http,
                                         is_local, join, path_in_store, shown, store_of)
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


# -----------------------------------------------------------------------------
# An address's forms: checked, taken apart, joined; the store each names


@pytest.mark.parametrize("address", [
    "s3://b/p", "s3://bucket", "gs://b/p", "gcs://b/p", "az://container/p", "abfs://c/p",
    "hf://datasets/owner/name/dir", "file:///x", "/a/local/dir", "relative/dir",
    "https://host/path", "http://127.0.0.1:8000"])
def test_check_store_address_accepts(address):
    check_store_address(address)


@pytest.mark.parametrize("address, words", [
    ("ftp://host/x", "unknown address 'ftp://host/x'"),
    ("s3://", "names no bucket or repository of S3"),
    ("s3:///", "names no bucket or repository of S3"),
    ("gs://", "names no bucket or repository of GCS"),
    ("hf://", "e.g. hf://datasets/owner/name/folder"),
    ("hf://datasets/owner", "names no repository of the Hugging Face hub"),
    ("file://", "names no directory"),
    ("", "must be a non-empty string"), (None, "must be a non-empty string"),
    ("https:///path", "names no host")])
def test_check_store_address_refuses(address, words):
    with pytest.raises(ValueError) as e:
        check_store_address(address)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_path_in_store_and_join(tmp_path, monkeypatch):
    assert path_in_store("s3://b/p/") == "b/p"
    assert path_in_store("gs://b/p/x.parquet") == "b/p/x.parquet"
    assert path_in_store("hf://datasets/o/n/dir") == "datasets/o/n/dir"
    assert path_in_store("file:///x/a%20b") == "/x/a b"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert path_in_store("~/data") == str(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert path_in_store("rel") == str(tmp_path / "rel")
    # a URL quotes the name; a store's path takes it as it is
    assert join("https://h/p/", "a b.parquet") == "https://h/p/a%20b.parquet"
    assert join("s3://b/p/", "a b.parquet") == "s3://b/p/a b.parquet"
    assert join("s3://b", "x.parquet") == "s3://b/x.parquet"


def test_store_of():
    assert store_of("gs://b") is store_of("gcs://b")
    assert store_of("gs://b").protocol == "gcs"
    assert store_of("az://c").package == "adlfs"
    assert store_of("abfs://c").extra == "azure"
    assert store_of("hf://datasets/o/n").package == "huggingface_hub"
    assert store_of("s3://b").install_hint() == "pip install 'nanochat-data[s3]'"
    assert store_of("/x") is LOCAL and store_of("file:///x") is LOCAL
    assert is_local("/x") and not is_local("s3://b")
    assert not is_local("http://h")
    assert is_http("HTTPS://h/x") and not is_http("s3://b")
    with pytest.raises(ValueError, match="unknown address 'ftp://h/x'"):
        store_of("ftp://h/x")
