"""
Tests for the HTTP transport (nanochat/data/fetch/http_transport.py) against the fault-injecting
local HTTP server of conftest.py (`fault_server`): a dropped body resumed with Range and If-Range, a
server without Range support, a wrong Content-Range, a file that changed between runs (never
spliced), a server without a validator, the watchdog that ends an attempt at its deadline while the
headers trickle in (direct and through an HTTP proxy), Retry-After, and the sha256 read as
huggingface_hub reads it. Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_http_transport.py -q
"""

import hashlib
import json
import os

import pytest

from conftest import (assert_only_complete_shards, download_shard, outcome, serve_shards,
                      sha256_hex)
from nanochat.data.fetch import http_transport
from nanochat.dataset import download_single_file
from nanochat.data.base.datasets import index_to_filename

NAME = index_to_filename(0)  # the shard most tests fetch


def test_dropped_connection_resumes_with_range_and_if_range(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["drop"]
    assert download_shard(fault_server, tmp_path, 0)
    # every byte that arrived was kept: the resume asks for exactly the rest, of the same version
    assert fault_server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-"]
    assert fault_server.if_ranges[NAME] == [None, f'"{sha256_hex(served[0])}"']
    assert fault_server.sent[NAME] == len(served[0])  # nothing fetched twice
    assert_only_complete_shards(tmp_path / "data", served)


def test_server_without_range_support_restarts_from_zero(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.range_support = False
    fault_server.faults[NAME] = ["drop", "drop"]
    assert download_shard(fault_server, tmp_path, 0)
    # each retry asked for the rest, got the whole file (200) and rewrote the temp file
    assert fault_server.ranges[NAME] == [None] + [f"bytes={len(served[0]) // 2}-"] * 2
    assert_only_complete_shards(tmp_path / "data", served)


def test_short_body_once_is_resumed(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["short"]
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.ranges[NAME] == [None, f"bytes={len(served[0]) - 100}-"]
    assert_only_complete_shards(tmp_path / "data", served)


def test_wrong_content_range_restarts_from_zero(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["drop", "bad_range"]
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-", None]
    assert_only_complete_shards(tmp_path / "data", served)


def _changed(body: bytes) -> bytes:
    """Another version of a shard, of the same length (the worst case for a splice)."""
    return body[:len(body) // 4] + bytes([body[len(body) // 4] ^ 1]) + body[len(body) // 4 + 1:]


@pytest.mark.parametrize("if_range_support", [True, False])
def test_file_changed_between_runs_restarts_instead_of_splicing(fault_server, tmp_path,
                                                                if_range_support):
    served = serve_shards(fault_server, tmp_path, [0])
    data_dir = tmp_path / "data"
    fault_server.always[NAME] = "drop"
    # a killed run: half of version 1 in .tmp
    assert not download_shard(fault_server, tmp_path, 0, max_attempts=1)
    assert (data_dir / f"{NAME}.tmp").read_bytes() == served[0][:len(served[0]) // 2]
    # version 2 changes a byte in the first quarter, which the resume would otherwise keep
    new = _changed(served[0])
    fault_server.files[NAME] = new
    fault_server.always.clear()
    fault_server.if_range_support = if_range_support
    assert download_shard(fault_server, tmp_path, 0)
    # If-Range: the server sends version 2 whole (200). A server that ignores If-Range answers 206
    # with version 2's ETag: we see the change, discard the half of version 1 and start over.
    expected = [None, f"bytes={len(new) // 2}-"] + ([] if if_range_support else [None])
    assert fault_server.ranges[NAME] == expected
    assert_only_complete_shards(data_dir, {0: new})


def test_a_validator_that_is_not_a_sha256_only_validates(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.etag = "md5"
    fault_server.faults[NAME] = ["drop"]
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.if_ranges[NAME] == [None, f'"{hashlib.md5(served[0]).hexdigest()}"']
    assert_only_complete_shards(tmp_path / "data", served)
    assert json.loads(
        (tmp_path / "data" / f"{NAME}.json").read_text())["sha256_stated_by_server"] is False


def test_a_dropping_link_without_a_validator_restarts_and_says_so(fault_server, tmp_path, caplog):
    # no ETag, no Last-Modified: the bytes of a broken transfer cannot be resumed, so they are
    # not progress
    served = serve_shards(fault_server, tmp_path, [0], big=True)
    fault_server.etag = None
    fault_server.drop_every = 70_000
    assert not download_shard(fault_server, tmp_path, 0, max_attempts=3)
    assert fault_server.ranges[NAME] == [None] * 3  # never a Range without a validator to guard it
    log = caplog.text
    assert "sends no ETag or Last-Modified, so a broken transfer of it cannot be resumed" in log
    assert "made progress" not in log and "a rerun resumes" not in log
    assert "gave up after 3 attempts in a row without progress" in log
    fault_server.drop_every = None
    assert download_shard(fault_server, tmp_path, 0)
    assert_only_complete_shards(tmp_path / "data", served)


def test_the_deadline_also_bounds_the_wait_for_headers(fault_server, tmp_path, caplog):
    # every read gets a byte well within --timeout, so only the deadline can end this attempt
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "slow_headers"
    # the header alone would take over 8 minutes (outcome: a bound on a hang, not a benchmark)
    assert outcome(lambda: download_shard(fault_server, tmp_path, 0, timeout=2, deadline=1.5,
                                          max_attempts=3)) is False
    assert "past the deadline of 1.5s for one file; not retrying" in caplog.text
    assert fault_server.gets[NAME] == 1 and not os.path.exists(tmp_path / "data" / NAME)


@pytest.mark.slow
def test_the_deadline_holds_through_an_http_proxy(fault_server, tmp_path, monkeypatch, caplog):
    # the test server serves as the proxy too: requests sends it "GET http://shards.example/...",
    # and the host in that URL is never looked up here
    served = serve_shards(fault_server, tmp_path, [0])
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", fault_server.url.rsplit("/resolve", 1)[0])
    url = "http://shards.example/resolve/main"
    data_dir = str(tmp_path / "data")
    assert download_single_file(0, data_dir, url, backoff_base=0.01)
    assert_only_complete_shards(tmp_path / "data", served)
    fault_server.always["shard_00001.parquet"] = "slow_headers"
    fault_server.files["shard_00001.parquet"] = served[0]
    assert outcome(lambda: download_single_file(1, data_dir, url, timeout=2, deadline=1.5,
                                                max_attempts=1)) is False
    assert "past the deadline of 1.5s for one file; not retrying" in caplog.text


def test_retry_after_parsing():
    assert http_transport._retry_after_seconds("0") == 0
    assert http_transport._retry_after_seconds(" 7 ") == 7
    assert http_transport._retry_after_seconds("86400") == http_transport.RETRY_AFTER_CAP
    assert http_transport._retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert http_transport._retry_after_seconds("-3") is None
    assert http_transport._retry_after_seconds(None) is None


def test_stated_sha256_is_read_as_huggingface_hub_reads_it():
    def response(headers, history=()):
        r = http_transport.requests.Response()
        r.headers.update(headers)
        r.history = list(history)
        return r

    digest = "ab" * 32
    cdn = response({"ETag": '"0123456789abcdef0123456789abcdef"'},
                   [response({"X-Linked-Etag": f'"{digest}"', "ETag": '"b1ob"'})])
    assert http_transport.stated_sha256(cdn) == digest
    assert http_transport.stated_sha256(response({"ETag": f'W/"{digest.upper()}"'})) == digest
    # an md5
    md5_etag = {"ETag": '"0123456789abcdef0123456789abcdef"'}
    assert http_transport.stated_sha256(response(md5_etag)) is None
    # unquoted: not the form we trust
    assert http_transport.stated_sha256(response({"ETag": digest})) is None
    assert http_transport.stated_sha256(response({})) is None
    # weak: not for If-Range
    assert http_transport.validator(response({"ETag": 'W/"x"', "Last-Modified": "Mon"})) == "Mon"
