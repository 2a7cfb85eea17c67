"""
Tests for a download's temp file and its installation (nanochat/data/fetch/install.py), against
the fault-injecting local HTTP server of conftest.py (`fault_server`): a partial file from an
earlier run resumed only when its record names a version, complete, overlong and garbage temp files,
bad bodies (garbage, cut, bit-flipped, a web page, a corrupt page) never installed, and the fsyncs
around each rename. Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_install.py -q
"""

import json
import os

import pytest

from conftest import assert_only_complete_shards, download_shard, serve_shards, sha256_hex
from nanochat.data.fetch import download, errors
from nanochat.data.fetch.limits import Limits
from nanochat.data.base.datasets import index_to_filename, list_parquet_files

NAME = index_to_filename(0)  # the shard most tests fetch


def _leave_partial(data_dir, partial: bytes, body: bytes, validator: str | None) -> None:
    """What a killed run leaves: partial in the temp file and, with a validator, the record that
    says it belongs to the file body (its size and sha256 as the server stated them)."""
    data_dir.mkdir(exist_ok=True)
    (data_dir / f"{NAME}.tmp").write_bytes(partial)
    if validator is not None:
        record = {"url": "", "validator": validator, "size": len(body), "sha256": sha256_hex(body)}
        (data_dir / f"{NAME}.tmp.json").write_text(json.dumps(record))


def test_partial_file_from_an_earlier_run_is_resumed(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0][:1000], served[0], f'"{sha256_hex(served[0])}"')
    assert list_parquet_files(str(data_dir)) == []
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.ranges[NAME] == ["bytes=1000-"]
    assert_only_complete_shards(data_dir, served)


def test_partial_file_without_a_record_starts_over(fault_server, tmp_path):
    # nothing says which version of the file those bytes belong to: never spliced onto another
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0][:1000], served[0], None)
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.ranges[NAME] == [None]
    assert_only_complete_shards(data_dir, served)


@pytest.mark.parametrize("extra, ranges", [(b"", ["bytes=LEN-"]), (b"junk", [None])])
def test_complete_or_overlong_temp_file(fault_server, tmp_path, extra, ranges):
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0] + extra, served[0], f'"{sha256_hex(served[0])}"')
    assert download_shard(fault_server, tmp_path, 0)
    # complete: the 416 names our size and the checks pass;
    # overlong: discarded up front, fetched again
    asked = [r and r.replace("LEN", str(len(served[0]))) for r in ranges]
    assert fault_server.ranges[NAME] == asked
    assert_only_complete_shards(data_dir, served)


def test_garbage_leftover_temp_file_is_discarded(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, b"<html>Service Unavailable</html>" * 100, served[0],
                   f'"{sha256_hex(served[0])}"')
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.ranges[NAME] == [None]
    assert_only_complete_shards(data_dir, served)


@pytest.mark.parametrize("fault", ["garbage", "cut", "flip", "html"])
def test_bad_body_is_discarded_and_retried(fault_server, tmp_path, fault):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = [fault]
    assert download_shard(fault_server, tmp_path, 0)
    # the bad body was deleted, so the retry asked for the whole file again
    assert fault_server.ranges[NAME] == [None, None]
    assert_only_complete_shards(tmp_path / "data", served)


def test_same_length_corruption_with_a_stated_sha256_is_never_installed(fault_server, tmp_path):
    # the hub's way: a redirect to the CDN whose X-Linked-Etag states the sha256;
    # the CDN's ETag is an md5
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.redirect = True
    fault_server.always[NAME] = "flip"
    data_dir = tmp_path / "data"
    assert not download_shard(fault_server, tmp_path, 0, max_attempts=2)
    assert fault_server.gets[NAME] == 2 and not os.path.exists(data_dir / NAME)
    assert not os.path.exists(data_dir / f"{NAME}.tmp")  # a body that hashed wrong is discarded
    del fault_server.always[NAME]
    assert download_shard(fault_server, tmp_path, 0)
    assert_only_complete_shards(data_dir, served)
    assert json.loads((data_dir / f"{NAME}.json").read_text())["sha256_stated_by_server"] is True


def test_a_corrupt_page_from_a_server_without_a_sha256_is_never_installed(fault_server, tmp_path):
    # an md5 ETag: a validator, not a sha256, so nothing but the bytes vouches for them
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.etag = "md5"
    fault_server.always[NAME] = "flip_page"
    data_dir = tmp_path / "data"
    with pytest.raises(errors.DownloadError, match="row group 1 does not read") as info:
        download.download_file(f"{fault_server.url}/{NAME}", str(data_dir / NAME),
                               Limits(max_attempts=2, backoff_base=0.01))
    assert info.value.reason == "corrupt page" and "gave up after 2 attempts" in str(info.value)
    assert fault_server.gets[NAME] == 2
    assert os.listdir(data_dir) == [f".{NAME}.lock"]  # nothing installed, nothing kept
    del fault_server.always[NAME]
    fault_server.faults[NAME] = ["flip_page"] * 3  # (the GETs are counted from the first above)
    assert download_shard(fault_server, tmp_path, 0)  # refused once, then the honest body
    assert fault_server.gets[NAME] == 4
    assert_only_complete_shards(data_dir, served)
    record = json.loads((data_dir / f"{NAME}.json").read_text())
    assert record["sha256_stated_by_server"] is False and record["pages_checked"] is True


def test_files_and_directory_are_fsynced_around_each_rename(fault_server, tmp_path, monkeypatch):
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: calls.append(
        ("replace", str(src), str(dst))) or replace(src, dst))
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name a descriptor's file")
    assert download_shard(fault_server, tmp_path, 0)
    shard, record, folder = str(data_dir / NAME), str(data_dir / NAME) + ".json", str(data_dir)
    for final in (shard, record):
        tmp = final + ".tmp"
        rename = calls.index(("replace", tmp, final))
        assert ("fsync", tmp) in calls[:rename]  # the bytes are on disk before the name
        assert ("fsync", folder) in calls[rename + 1:]  # and the name is on disk after the rename
    assert (calls.index(("replace", record + ".tmp", record))
            < calls.index(("replace", shard + ".tmp", shard)))
    assert_only_complete_shards(data_dir, served)
