"""
Tests for the shard downloader (nanochat/data/fetch/download.py, through nanochat/dataset.py's API
and CLI) against a real local HTTP server that injects faults: 5xx, 404, 429/503 with Retry-After,
dropped connections, short, garbage, bit-flipped and trickling bodies, a file that changes between
runs, with and without Range/If-Range support, behind a redirect that states the sha256 as the
Hugging Face hub does. Also leftover and symlinked temp files, bad files already under their final
names, --verify, an unresolvable host, URLs without a scheme, concurrency, the disk check and the
end-of-run summary. Hermetic: no internet, tiny shards in tmp_path, waits of milliseconds. Run:
    python -m pytest tests/data/fetch/test_download.py -q
"""

import errno
import hashlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict, namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT, ByteTokenizer, outcome, sample_texts, write_shard
from nanochat import dataset
from nanochat.data.fetch import download
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.dataset import (
    DATASETS, DatasetSpec, download_shards, download_single_file, get_data_dir, index_to_filename,
    list_parquet_files, main, parquets_iter_batched, split_parquet_files,
)
from nanochat.data.fetch.download import HostNotFoundError, Limits, summarize

QUICK_BACKOFF = ["--backoff-base", "0.01"]  # 5 attempts then cost 0.01+0.02+0.04+0.08 s of sleep
NAME = "shard_00000.parquet"


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _corrupt_page(body: bytes) -> bytes:
    """The shard with one byte flipped in the middle of row group 1's first page (the dictionary
    page, which holds the texts): same size, PAR1 at both ends, the footer intact, and row group 1
    no longer decompresses."""
    chunk = pq.read_metadata(pa.BufferReader(body)).row_group(1).column(0)
    if chunk.has_dictionary_page:
        first, end = chunk.dictionary_page_offset, chunk.data_page_offset
    else:
        first, end = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
    middle = (first + end) // 2
    bad = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
    with pytest.raises(OSError, match="ZSTD"):  # or the tests built on it would pass vacuously
        pq.ParquetFile(pa.BufferReader(bad)).read_row_group(1)
    return bad


# -----------------------------------------------------------------------------
# A local shard server that misbehaves on request


class _ServerState:
    """What the handler serves, how it misbehaves, and what it saw.
    faults[name]: behaviours for the 1st, 2nd, ... GET of that file; always[name]: for every GET.
    Behaviours: "500", "503:0", "429:1" (code[:Retry-After]), "drop" (half the body, then close),
    "short" (all but 100 bytes of the body), "cut" (half the body and no Content-Length),
    "garbage" (right length, not parquet), "flip" (right length, one byte changed),
    "flip_page" (right length, PAR1 and footer intact, a page that does not decompress),
    "html" (a 200 web page), "bad_range" (206 with a Content-Range from 0),
    "slow" (wait 0.3 s before the body), "trickle" (100 bytes, then 1 byte every 20 ms).
    drop_every: every body stops after this many bytes. etag: "sha256" (a quoted sha256 of the
    body, as the hub sends for LFS files), "md5" (a validator only) or None.
    redirect: /resolve/main/NAME answers 302 to /cdn/NAME with the sha256 in X-Linked-Etag, as the
    hub does; the CDN's ETag is an md5."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, list[str]] = {}
        self.always: dict[str, str] = {}
        self.range_support = True
        self.if_range_support = True
        self.etag = "sha256"
        self.redirect = False
        self.drop_every = None
        self.gets = Counter()
        self.listings = 0  # GETs of index.json when it is not served (as the hub has none)
        self.heads = Counter()
        self.sent = Counter()  # body bytes written, by name
        self.ranges = defaultdict(list)  # name -> the Range header of each GET (None when absent)
        self.if_ranges = defaultdict(list)  # name -> the If-Range header of each GET
        self.lock = threading.Lock()
        self.url = ""

    def behaviour(self, name: str, n: int) -> str | None:
        if name in self.always:
            return self.always[name]
        faults = self.faults.get(name, [])
        return faults[n - 1] if n <= len(faults) else None

    def etag_of(self, body: bytes, cdn: bool) -> str | None:
        if self.etag == "md5" or cdn:
            return f'"{hashlib.md5(body).hexdigest()}"'
        return f'"{_sha256(body)}"' if self.etag == "sha256" else None


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: every response ends with a close, so a short write is seen as a truncated body

    def log_message(self, format, *args):
        pass  # keep pytest output clean

    def _empty(self, code: int, headers: dict | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _slow_headers(self) -> None:
        """The status line and headers a byte at a time, never finished in time."""
        try:
            for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Padding: " + b"x" * 10_000:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on us, as it should

    def do_HEAD(self):
        state, name = self.server.state, self.path.rsplit("/", 1)[-1]
        with state.lock:
            state.heads[name] += 1
        body = state.files.get(name)
        if body is None:
            return self._empty(404)
        if state.always.get(name) == "slow_headers":
            return self._slow_headers()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()

    def _write(self, name: str, data: bytes) -> None:
        self.wfile.write(data)
        with self.server.state.lock:
            self.server.state.sent[name] += len(data)

    def do_GET(self):
        state, name = self.server.state, self.path.rsplit("/", 1)[-1]
        body = state.files.get(name)
        cdn = self.path.startswith("/cdn/")
        if name == "index.json" and body is None:  # the downloader asks for a listing first
            with state.lock:
                state.listings += 1
            return self._empty(404)
        if state.redirect and not cdn and body is not None:
            return self._empty(302, {"Location": f"/cdn/{name}",
                                     "X-Linked-Etag": f'"{_sha256(body)}"'})
        with state.lock:
            state.gets[name] += 1
            state.ranges[name].append(self.headers.get("Range"))
            state.if_ranges[name].append(self.headers.get("If-Range"))
            fault = state.behaviour(name, state.gets[name])
        if body is None:
            return self._empty(404)
        if fault and fault[:3].isdigit():
            code, _, retry_after = fault.partition(":")
            return self._empty(int(code), {"Retry-After": retry_after} if retry_after else None)
        if fault == "redirect_invalid":  # to a CDN host that does not resolve
            return self._empty(302, {"Location": f"http://cdn.invalid/x/{name}"})
        if fault == "slow_headers":
            return self._slow_headers()
        if fault == "html":
            page = b"<!DOCTYPE html><html><body>rate limited, try later</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            return self._write(name, page)
        etag = state.etag_of(body, cdn)
        start = 0
        requested = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        same_version = if_range is None or if_range == etag or not state.if_range_support
        if requested and state.range_support and same_version:
            first, last_n = re.fullmatch(r"bytes=(\d*)-(\d*)", requested).groups()
            # bytes=-n: the last n bytes, what a streaming loader reads a footer with
            start = int(first) if first else max(len(body) - int(last_n), 0)
            if start >= len(body):
                return self._empty(416, {"Content-Range": f"bytes */{len(body)}"})
            self.send_response(206)
            first = 0 if fault == "bad_range" else start
            self.send_header("Content-Range", f"bytes {first}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        if etag:
            self.send_header("ETag", etag)
        payload = body[start:]
        if fault == "garbage":
            payload = b"\x00not parquet" * (len(payload) // 12) + b"!" * (len(payload) % 12)
        if fault == "flip_page":
            payload = _corrupt_page(body)[start:]
        if fault == "flip":
            middle = len(payload) // 2
            payload = payload[:middle] + bytes([payload[middle] ^ 1]) + payload[middle + 1:]
        if fault != "cut":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault == "slow":
            time.sleep(0.3)
        if fault in ("drop", "cut"):
            payload = payload[:len(payload) // 2]
        if fault == "short":
            payload = payload[:max(len(payload) - 100, 0)]
        if state.drop_every is not None:
            payload = payload[:state.drop_every]
        if fault == "trickle":
            self._write(name, payload[:100])
            try:
                for i in range(100, len(payload)):
                    time.sleep(0.02)
                    self._write(name, payload[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on us, as it should
            return
        self._write(name, payload)


@pytest.fixture
def server(tmp_path):
    state = _ServerState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.state = state
    # a short poll so that shutdown() at teardown returns in ~50 ms, not the default 0.5 s
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/resolve/main"
    yield state
    httpd.shutdown()
    httpd.server_close()


def _serve(server, tmp_path, indices, *, big: bool = False) -> dict[int, bytes]:
    """Write a real shard per index (~14 KB; big: ~220 KB of hex text in 8 row groups),
    register its bytes with the server, return them by index."""
    folder = tmp_path / "served"
    folder.mkdir(exist_ok=True)
    served = {}
    for i in indices:
        path = folder / index_to_filename(i)
        if big:
            rng = random.Random(i)
            write_shard(path, [rng.randbytes(200).hex() for _ in range(1000)], row_group_size=128)
        else:
            write_shard(path, sample_texts(i, 300), row_group_size=64)
        served[i] = path.read_bytes()
        server.files[index_to_filename(i)] = served[i]
    return served


def _assert_only_complete_shards(data_dir, served: dict[int, bytes], *,
                                 partial_ok: bool = False) -> None:
    """Every *.parquet in data_dir is byte-identical to what was served, with a record of its size
    and sha256; no temp files remain (unless partial_ok: a failed shard keeps its partial download
    for the next run)."""
    names = sorted(os.listdir(data_dir))
    if not partial_ok:
        assert not [n for n in names if n.endswith(".tmp")], names
    parquet = [n for n in names if n.endswith(".parquet")]
    assert parquet == sorted(index_to_filename(i) for i in served)
    for i, body in served.items():
        path = os.path.join(data_dir, index_to_filename(i))
        with open(path, "rb") as f:
            assert f.read() == body
        with open(path + ".json") as f:
            assert json.load(f)["sha256"] == _sha256(body)


def _download(server, tmp_path, index, **kwargs) -> bool:
    return download_single_file(index, str(tmp_path / "data"), server.url, backoff_base=0.01,
                                **kwargs)


def _cli(server, data_dir, *args) -> int:
    return main(["--base-url", server.url, "--data-dir", str(data_dir), *QUICK_BACKOFF, *args])


# -----------------------------------------------------------------------------
# The happy path, skipping, the CLI


def test_main_downloads_train_and_val_shards(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "2", "-w", "2") == 0
    out = capsys.readouterr().out
    assert "workers=2" in out and f"base_url={server.url}" in out  # echoes what it parsed
    assert f"downloaded 3/3 shards to {data_dir}" in out
    _assert_only_complete_shards(data_dir, served)
    assert server.gets == {name: 1 for name in server.files}
    assert list_parquet_files(str(data_dir))[-1].endswith("shard_06542.parquet")
    record = json.loads((data_dir / "shard_00000.parquet.json").read_text())
    # the server stated the sha256, so the bytes are the publisher's: their pages were not read
    assert record == {"size": len(served[0]), "sha256": _sha256(served[0]),
                      "sha256_stated_by_server": True, "pages_checked": False,
                      "source": f"{server.url}/shard_00000.parquet",
                      "source_version": f'"{_sha256(served[0])}"'}


def test_existing_files_are_checked_then_skipped(server, tmp_path):
    served = _serve(server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for i in (0, 6542):
        (data_dir / index_to_filename(i)).write_bytes(served[i])  # sound, but with no record
    assert _cli(server, data_dir, "-n", "2") == 0
    assert server.gets == {"shard_00001.parquet": 1}
    # all there: no GET, nor the disk check's HEAD; one HEAD for the shard with a record, whose
    # source is asked whether it is still its file (the two without one are the user's own)
    server.heads.clear()
    assert _cli(server, data_dir, "-n", "2") == 0
    assert server.gets == {"shard_00001.parquet": 1}
    assert server.heads == {"shard_00001.parquet": 1}
    assert sorted(os.listdir(data_dir)) == sorted(
        [".shard_00001.parquet.lock", "shard_00001.parquet.json"]
        + [index_to_filename(i) for i in served])


@pytest.fixture
def tiny_dataset(monkeypatch):
    """A registered dataset with 3 train shards (0..2) and val shard 3."""
    monkeypatch.setitem(DATASETS, "tiny", DatasetSpec("tiny", "example/tiny", 3, "tiny_data"))
    return DATASETS["tiny"]


def test_n_past_the_end_fetches_what_there_is_and_says_so(server, tmp_path, tiny_dataset,
                                                          capsys):
    served = _serve(server, tmp_path, range(4))
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "10", "--dataset", "tiny") == 1
    out = capsys.readouterr().out
    assert "-n 10 asks for more train shards than the 3 tiny has: fetching those 3 and val, " \
           "then exiting 1\n" in out
    assert f"downloaded 4 of the 11 shards asked for (10 train and val) to {data_dir}: tiny has " \
           "only 3 train shards\n" in out
    _assert_only_complete_shards(data_dir, served)


def test_n_minus_one_fetches_all_and_defaults_come_from_env(
        server, tmp_path, tiny_dataset, monkeypatch):
    served = _serve(server, tmp_path, range(4))
    monkeypatch.setenv("NANOCHAT_DATASET", "tiny")
    monkeypatch.setenv("NANOCHAT_DATA_URL", server.url)
    assert main(["-n", "-1"] + QUICK_BACKOFF) == 0
    _assert_only_complete_shards(get_data_dir(), served)  # <NANOCHAT_BASE_DIR>/tiny_data
    assert get_data_dir().endswith("tiny_data")


def test_n_zero_fetches_only_the_val_shard(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "0") == 0
    assert "downloaded 1/1 shards" in capsys.readouterr().out
    _assert_only_complete_shards(data_dir, {6542: served[6542]})
    assert split_parquet_files("val", str(data_dir))[0].endswith("shard_06542.parquet")


@pytest.mark.parametrize("args, name", [
    (["-n", "-2"], "--num-files"),
    (["-w", "-1"], "--num-workers"),
    (["--backoff-base", "-1"], "--backoff-base"),
    (["--max-attempts", "0"], "--max-attempts"),
    (["--timeout", "0"], "--timeout"),
    (["--min-rate", "-1"], "--min-rate"),
    (["--rate-window", "0"], "--rate-window"),
    (["--deadline", "-5"], "--deadline"),
])
def test_bad_cli_arguments_are_named(args, name, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert name in capsys.readouterr().err


def test_help_states_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: -1, every shard; 0: only val)" in out
    for default in ("default: 4;", "default: $NANOCHAT_DATASET", "default: $NANOCHAT_DATA_URL",
                    "default: <base dir>", "(default: 5)", "(default: 2)", "(default: 30)",
                    "(default: 50)", "(default: 3600)"):
        assert default in out, default


def test_unknown_dataset_on_the_cli():
    with pytest.raises(ValueError, match="'nope'"):
        main(["--dataset", "nope", "-n", "0"])


def test_bad_api_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_workers"):
        download_shards([0], str(tmp_path), "http://127.0.0.1:9", num_workers=-1)
    with pytest.raises(ValueError, match="max_attempts"):
        download_single_file(0, str(tmp_path), "http://127.0.0.1:9", max_attempts=0)
    with pytest.raises(ValueError, match="rate_window"):
        download_single_file(0, str(tmp_path), "http://127.0.0.1:9", rate_window=0)
    with pytest.raises(ValueError, match="index"):
        download_single_file(-1, str(tmp_path), "http://127.0.0.1:9")


def test_api_resolves_defaults_at_call_time(server, tmp_path, monkeypatch):
    served = _serve(server, tmp_path, [5])
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "later"))
    monkeypatch.setenv("NANOCHAT_DATA_URL", server.url)
    assert download_single_file(5, backoff_base=0.01) is True
    _assert_only_complete_shards(tmp_path / "later" / "base_data_climbmix", served)


# -----------------------------------------------------------------------------
# Transient faults: retries and resume


def test_5xx_is_retried(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["500", "502"]
    assert _download(server, tmp_path, 0)
    assert server.gets[NAME] == 3
    _assert_only_complete_shards(tmp_path / "data", served)


def test_dropped_connection_resumes_with_range_and_if_range(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["drop"]
    assert _download(server, tmp_path, 0)
    # every byte that arrived was kept: the resume asks for exactly the rest, of the same version
    assert server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-"]
    assert server.if_ranges[NAME] == [None, f'"{_sha256(served[0])}"']
    assert server.sent[NAME] == len(served[0])  # nothing fetched twice
    _assert_only_complete_shards(tmp_path / "data", served)


def test_server_without_range_support_restarts_from_zero(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.range_support = False
    server.faults[NAME] = ["drop", "drop"]
    assert _download(server, tmp_path, 0)
    # each retry asked for the rest, got the whole file (200) and rewrote the temp file
    assert server.ranges[NAME] == [None] + [f"bytes={len(served[0]) // 2}-"] * 2
    _assert_only_complete_shards(tmp_path / "data", served)


def test_short_body_once_is_resumed(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["short"]
    assert _download(server, tmp_path, 0)
    assert server.ranges[NAME] == [None, f"bytes={len(served[0]) - 100}-"]
    _assert_only_complete_shards(tmp_path / "data", served)


def _leave_partial(data_dir, partial: bytes, body: bytes, validator: str | None) -> None:
    """What a killed run leaves: partial in the temp file and, with a validator, the record that
    says it belongs to the file body (its size and sha256 as the server stated them)."""
    data_dir.mkdir(exist_ok=True)
    (data_dir / f"{NAME}.tmp").write_bytes(partial)
    if validator is not None:
        record = {"url": "", "validator": validator, "size": len(body), "sha256": _sha256(body)}
        (data_dir / f"{NAME}.tmp.json").write_text(json.dumps(record))


def test_partial_file_from_an_earlier_run_is_resumed(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0][:1000], served[0], f'"{_sha256(served[0])}"')
    assert list_parquet_files(str(data_dir)) == []
    assert _download(server, tmp_path, 0)
    assert server.ranges[NAME] == ["bytes=1000-"]
    _assert_only_complete_shards(data_dir, served)


def test_partial_file_without_a_record_starts_over(server, tmp_path):
    # nothing says which version of the file those bytes belong to: never spliced onto another
    served = _serve(server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0][:1000], served[0], None)
    assert _download(server, tmp_path, 0)
    assert server.ranges[NAME] == [None]
    _assert_only_complete_shards(data_dir, served)


@pytest.mark.parametrize("extra, ranges", [(b"", ["bytes=LEN-"]), (b"junk", [None])])
def test_complete_or_overlong_temp_file(server, tmp_path, extra, ranges):
    served = _serve(server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, served[0] + extra, served[0], f'"{_sha256(served[0])}"')
    assert _download(server, tmp_path, 0)
    # complete: the 416 names our size and the checks pass;
    # overlong: discarded up front, fetched again
    assert server.ranges[NAME] == [r and r.replace("LEN", str(len(served[0]))) for r in ranges]
    _assert_only_complete_shards(data_dir, served)


def test_wrong_content_range_restarts_from_zero(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["drop", "bad_range"]
    assert _download(server, tmp_path, 0)
    assert server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-", None]
    _assert_only_complete_shards(tmp_path / "data", served)


@pytest.mark.parametrize("fault", ["garbage", "cut", "flip", "html"])
def test_bad_body_is_discarded_and_retried(server, tmp_path, fault):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = [fault]
    assert _download(server, tmp_path, 0)
    # the bad body was deleted, so the retry asked for the whole file again
    assert server.ranges[NAME] == [None, None]
    _assert_only_complete_shards(tmp_path / "data", served)


@pytest.mark.parametrize("fault, reason", [
    ("garbage", "not parquet"), ("short", "connection failed"), ("cut", "not parquet"),
    ("500", "HTTP 500"), ("flip", "sha256 mismatch"),
])
def test_shard_that_never_succeeds_fails_the_run(server, tmp_path, fault, reason, capsys):
    served = _serve(server, tmp_path, [0, 1, 6542])
    server.always["shard_00001.parquet"] = fault
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "2") == 1
    out = capsys.readouterr().out
    assert "downloaded 2/3 shards" in out
    assert f"failed (1); rerun the same command to retry (partial downloads resume):\n" \
           f"  1 x {reason}: shard_00001.parquet\n" in out
    assert server.gets["shard_00001.parquet"] == dataset.MAX_ATTEMPTS
    del served[1]
    # nothing bad under a final name; a short body keeps its partial download for the next run
    _assert_only_complete_shards(data_dir, served, partial_ok=True)
    assert os.path.exists(data_dir / "shard_00001.parquet.tmp") == (fault == "short")


def test_retry_after_is_honoured(server, tmp_path):
    served = _serve(server, tmp_path, [0, 1])
    server.faults["shard_00000.parquet"] = ["429:1"]
    server.faults["shard_00001.parquet"] = ["503:0", "503:0"]
    t0 = time.monotonic()
    assert _download(server, tmp_path, 0)
    # the backoff would have been 0.01 s; the server asked for 1 s
    assert time.monotonic() - t0 >= 0.9
    assert _download(server, tmp_path, 1)
    assert server.gets == {"shard_00000.parquet": 2, "shard_00001.parquet": 3}
    _assert_only_complete_shards(tmp_path / "data", served)


def test_retry_after_parsing():
    assert download._retry_after_seconds("0") == 0
    assert download._retry_after_seconds(" 7 ") == 7
    assert download._retry_after_seconds("86400") == download.RETRY_AFTER_CAP
    assert download._retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert download._retry_after_seconds("-3") is None
    assert download._retry_after_seconds(None) is None


class _RecordedWaits:
    """Stands in for the stop event: records each backoff instead of sleeping."""

    def __init__(self):
        self.waits = []

    def wait(self, seconds):
        self.waits.append(seconds)
        return False

    def is_set(self):
        return False


def test_backoff_doubles(server, tmp_path):
    _serve(server, tmp_path, [0])
    server.always[NAME] = "500"
    stop = _RecordedWaits()
    with pytest.raises(download.DownloadError, match="gave up after 5 attempts") as info:
        download.download_file(f"{server.url}/{NAME}", str(tmp_path / "data" / NAME), stop=stop)
    assert info.value.reason == "HTTP 500"
    assert stop.waits == [2.0, 4.0, 8.0, 16.0]  # the defaults: 5 attempts, base 2 s


# -----------------------------------------------------------------------------
# Never a corrupt shard under its final name


def test_same_length_corruption_with_a_stated_sha256_is_never_installed(server, tmp_path):
    # the hub's way: a redirect to the CDN whose X-Linked-Etag states the sha256;
    # the CDN's ETag is an md5
    served = _serve(server, tmp_path, [0])
    server.redirect = True
    server.always[NAME] = "flip"
    data_dir = tmp_path / "data"
    assert not _download(server, tmp_path, 0, max_attempts=2)
    assert server.gets[NAME] == 2 and not os.path.exists(data_dir / NAME)
    assert not os.path.exists(data_dir / f"{NAME}.tmp")  # a body that hashed wrong is discarded
    del server.always[NAME]
    assert _download(server, tmp_path, 0)
    _assert_only_complete_shards(data_dir, served)
    assert json.loads((data_dir / f"{NAME}.json").read_text())["sha256_stated_by_server"] is True


def test_a_validator_that_is_not_a_sha256_only_validates(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.etag = "md5"
    server.faults[NAME] = ["drop"]
    assert _download(server, tmp_path, 0)
    assert server.if_ranges[NAME] == [None, f'"{hashlib.md5(served[0]).hexdigest()}"']
    _assert_only_complete_shards(tmp_path / "data", served)
    assert json.loads(
        (tmp_path / "data" / f"{NAME}.json").read_text())["sha256_stated_by_server"] is False


def _changed(body: bytes) -> bytes:
    """Another version of a shard, of the same length (the worst case for a splice)."""
    return body[:len(body) // 4] + bytes([body[len(body) // 4] ^ 1]) + body[len(body) // 4 + 1:]


@pytest.mark.parametrize("if_range_support", [True, False])
def test_file_changed_between_runs_restarts_instead_of_splicing(server, tmp_path, if_range_support):
    served = _serve(server, tmp_path, [0])
    data_dir = tmp_path / "data"
    server.always[NAME] = "drop"
    # a killed run: half of version 1 in .tmp
    assert not _download(server, tmp_path, 0, max_attempts=1)
    assert (data_dir / f"{NAME}.tmp").read_bytes() == served[0][:len(served[0]) // 2]
    # version 2 changes a byte in the first quarter, which the resume would otherwise keep
    new = _changed(served[0])
    server.files[NAME] = new
    server.always.clear()
    server.if_range_support = if_range_support
    assert _download(server, tmp_path, 0)
    # If-Range: the server sends version 2 whole (200). A server that ignores If-Range answers 206
    # with version 2's ETag: we see the change, discard the half of version 1 and start over.
    expected = [None, f"bytes={len(new) // 2}-"] + ([] if if_range_support else [None])
    assert server.ranges[NAME] == expected
    _assert_only_complete_shards(data_dir, {0: new})


def test_garbage_leftover_temp_file_is_discarded(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    data_dir = tmp_path / "data"
    _leave_partial(data_dir, b"<html>Service Unavailable</html>" * 100, served[0],
                   f'"{_sha256(served[0])}"')
    assert _download(server, tmp_path, 0)
    assert server.ranges[NAME] == [None]
    _assert_only_complete_shards(data_dir, served)


@pytest.mark.parametrize("link", [f"{NAME}.tmp", f".{NAME}.lock"])
def test_symlinked_temp_or_lock_file_is_refused_and_its_target_untouched(
        server, tmp_path, link, capsys):
    _serve(server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_bytes(b"PAR1 keep me")
    os.symlink(target, data_dir / link)
    assert _cli(server, data_dir, "-n", "1") == 1
    assert "  1 x symlink in the way: shard_00000.parquet" in capsys.readouterr().out
    assert target.read_bytes() == b"PAR1 keep me"
    assert os.path.islink(data_dir / link) and not os.path.exists(data_dir / NAME)
    assert server.gets[NAME] == 0


def test_a_corrupt_page_from_a_server_without_a_sha256_is_never_installed(server, tmp_path):
    # an md5 ETag: a validator, not a sha256, so nothing but the bytes vouches for them
    served = _serve(server, tmp_path, [0])
    server.etag = "md5"
    server.always[NAME] = "flip_page"
    data_dir = tmp_path / "data"
    with pytest.raises(download.DownloadError, match="row group 1 does not read") as info:
        download.download_file(f"{server.url}/{NAME}", str(data_dir / NAME),
                               Limits(max_attempts=2, backoff_base=0.01))
    assert info.value.reason == "corrupt page" and "gave up after 2 attempts" in str(info.value)
    assert server.gets[NAME] == 2
    assert os.listdir(data_dir) == [f".{NAME}.lock"]  # nothing installed, nothing kept
    del server.always[NAME]
    server.faults[NAME] = ["flip_page"] * 3  # (the GETs are counted from the first above)
    assert _download(server, tmp_path, 0)  # refused once, then the honest body
    assert server.gets[NAME] == 4
    _assert_only_complete_shards(data_dir, served)
    record = json.loads((data_dir / f"{NAME}.json").read_text())
    assert record["sha256_stated_by_server"] is False and record["pages_checked"] is True


def test_pages_are_read_once_per_file(server, tmp_path, monkeypatch):
    served = _serve(server, tmp_path, [0, 1])
    data_dir = tmp_path / "data"
    server.etag = "md5"
    assert _download(server, tmp_path, 0)  # no sha256 stated: its pages are read to install it
    server.etag = "sha256"
    assert _download(server, tmp_path, 1)  # the publisher's sha256 matched: they are not
    read = []
    monkeypatch.setattr(download, "check_pages", lambda path: read.append(os.path.basename(path)))
    for _ in range(2):  # a file's record vouches for its pages from then on
        assert _download(server, tmp_path, 0) and _download(server, tmp_path, 1)
        assert download.check_files([str(data_dir / NAME)]) == {}
    assert read == []
    # a record without the mark (an earlier downloader's): read once, then marked
    record = json.loads((data_dir / f"{NAME}.json").read_text())
    del record["pages_checked"]
    (data_dir / f"{NAME}.json").write_text(json.dumps(record))
    for _ in range(2):
        assert _download(server, tmp_path, 0)
    assert read == [NAME]
    assert json.loads((data_dir / f"{NAME}.json").read_text())["pages_checked"] is True
    assert server.gets == {NAME: 1, "shard_00001.parquet": 1}
    _assert_only_complete_shards(data_dir, served)


def _install_corrupt(data_dir, body: bytes) -> None:
    """shard 0 with a corrupt page and the record a downloader without the page check wrote for
    it: the sha256 of those bytes, none stated by the server, no pages_checked."""
    data_dir.mkdir(exist_ok=True)
    bad = _corrupt_page(body)
    (data_dir / NAME).write_bytes(bad)
    (data_dir / f"{NAME}.json").write_text(json.dumps(
        {"size": len(bad), "sha256": _sha256(bad), "sha256_stated_by_server": False}))


def test_a_corrupt_page_installed_earlier_is_found_and_its_fix_works(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "2") == 0
    _install_corrupt(data_dir, served[0])
    # the reader's error names the file, the row group and the fix
    with pytest.raises(ValueError) as info:
        list(parquets_iter_batched("train", data_dir=str(data_dir)))
    message = str(info.value)
    assert f"{data_dir / NAME} row group 1 could not be read (ZSTD" in message
    fix = f"python -m nanochat.dataset --verify --data-dir {data_dir}"
    assert fix in message
    # the fix as the error states it: --verify names the shard and the command that fetches it
    capsys.readouterr()
    assert main(fix.split()[3:]) == 1
    out = capsys.readouterr().out
    assert "  1 x corrupt page: shard_00000.parquet\n" in out
    command = re.search(r"to fix: (python -m nanochat\.dataset .*?) \(", out).group(1)
    assert main(command.split()[3:] + ["--base-url", server.url, *QUICK_BACKOFF]) == 0
    assert "  1 x corrupt page: shard_00000.parquet\n" in capsys.readouterr().out
    assert main(fix.split()[3:]) == 0
    _assert_only_complete_shards(data_dir, served)
    assert len(list(parquets_iter_batched("train", data_dir=str(data_dir)))) == 10


def test_a_streaming_loader_replaces_a_corrupt_shard_installed_earlier(server, tmp_path):
    served = _serve(server, tmp_path, [0, 6542])
    cache = tmp_path / "cache"
    _install_corrupt(cache, served[0])
    args = dict(B=2, T=16, split="train", device="cpu", tokenizer_batch_size=8)
    expected = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(tmp_path / "served"), **args)
    streamed = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(cache), stream=True, num_shards=1, base_url=server.url,
        download_limits=Limits(backoff_base=0.01), **args)
    try:
        for _ in range(40):  # the buffer's first fill reads every row group of shard 0
            (inputs, targets, _), (x, y, _) = next(streamed), next(expected)
            assert inputs.tolist() == x.tolist() and targets.tolist() == y.tolist()
    finally:
        streamed.close()
        expected.close()
    assert (cache / NAME).read_bytes() == served[0]
    assert server.gets[NAME] == 1  # fetched again, whole


# -----------------------------------------------------------------------------
# Bad files already under their final names


def _truncated(body):
    return body[:len(body) // 2]


def _bit_flipped(body):
    return body[:100] + bytes([body[100] ^ 1]) + body[101:]


@pytest.mark.parametrize("bad, record, reason", [
    (lambda body: b"", False, "not parquet"),
    (_truncated, False, "not parquet"),
    (lambda body: b"<!DOCTYPE html><html>429 Too Many Requests</html>", False, "not parquet"),
    (_truncated, True, "wrong size"),
    (_bit_flipped, True, "sha256 mismatch"),
])
def test_bad_existing_shard_is_fetched_again_and_reported(
        server, tmp_path, bad, record, reason, capsys):
    served = _serve(server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "2") == 0
    (data_dir / NAME).write_bytes(bad(served[0]))
    if not record:
        os.remove(data_dir / f"{NAME}.json")
    capsys.readouterr()
    assert _cli(server, data_dir, "-n", "2") == 0
    out = capsys.readouterr().out
    assert f"downloaded 3/3 shards to {data_dir}\n3 verified against the hash {server.url} " \
           f"stated\nreplaced 1 bad shards that were there:\n" \
           f"  1 x {reason}: shard_00000.parquet\n" in out
    assert server.gets == {name: 1 + (name == NAME) for name in server.files}
    _assert_only_complete_shards(data_dir, served)


def test_unreadable_record_means_fetch_again(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "1") == 0
    (data_dir / f"{NAME}.json").write_text('{"size": 12')
    assert _cli(server, data_dir, "-n", "1") == 0
    assert "  1 x unreadable record: shard_00000.parquet\n" in capsys.readouterr().out
    assert server.gets[NAME] == 2
    _assert_only_complete_shards(data_dir, served)


def test_bad_existing_shard_stays_when_the_new_one_fails(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / NAME).write_bytes(_truncated(served[0]))
    server.always[NAME] = "500"
    assert _cli(server, data_dir, "-n", "1") == 1
    assert "  1 x HTTP 500: shard_00000.parquet" in capsys.readouterr().out
    # nothing is lost until a good one is there
    assert (data_dir / NAME).read_bytes() == _truncated(served[0])


def test_verify_names_bad_shards_and_the_fix(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 1, 2, 6542])
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "3") == 0
    assert main(["--verify", "--data-dir", str(data_dir)]) == 0
    assert f"checked 4 shards in {data_dir}: 4 good, 0 bad\n" in capsys.readouterr().out
    (data_dir / "shard_00001.parquet").write_bytes(_bit_flipped(served[1]))
    (data_dir / "shard_00002.parquet").write_bytes(b"")
    os.remove(data_dir / "shard_00002.parquet.json")
    (data_dir / "notes.parquet").write_bytes(b"PAR1 scribbles")
    server.gets.clear()
    server.heads.clear()
    assert main(["--verify", "--data-dir", str(data_dir)]) == 1
    out = capsys.readouterr().out
    assert f"checked 5 shards in {data_dir}: 2 good, 3 bad\n" in out
    assert "2 have no .json record" in out
    assert ("  2 x not parquet: notes.parquet, shard_00002.parquet\n"
            "  1 x sha256 mismatch: shard_00001.parquet\n") in out
    # the fix fetches only what the downloader fetched (shard_00002 lost its record)
    assert (f"to fix: python -m nanochat.dataset --dataset climbmix-400b --data-dir {data_dir}"
            " -n 2 ") in out
    assert ("not fetchable from climbmix-400b (named unlike its shards, or outside its "
            "directory with no .json record), so nothing here downloads them: "
            "notes.parquet, shard_00002.parquet; write them again") in out
    assert not server.gets and not server.heads  # offline
    # the fix it names works
    os.remove(data_dir / "notes.parquet")
    assert _cli(server, data_dir, "-n", "3") == 0
    assert main(["--verify", "--data-dir", str(data_dir)]) == 0
    _assert_only_complete_shards(data_dir, served)


# -----------------------------------------------------------------------------
# Every attempt ends in bounded time; progress is kept


def test_trickling_server_fails_within_the_rate_window(server, tmp_path):
    _serve(server, tmp_path, [0])
    server.always[NAME] = "trickle"  # 100 bytes, then ~50 bytes/s
    t0 = time.monotonic()
    assert not _download(server, tmp_path, 0, max_attempts=2, min_rate=1000, rate_window=0.3)
    # two attempts of ~0.3 s each (the rate window), not the minutes 14 KB at 50 B/s would take
    assert time.monotonic() - t0 < 5
    assert server.gets[NAME] == 2
    assert server.ranges[NAME][1].startswith("bytes=")  # the trickled bytes were kept


def test_trickle_once_then_the_rest(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["trickle"]
    assert _download(server, tmp_path, 0, min_rate=1000, rate_window=0.3)
    kept = int(re.fullmatch(r"bytes=(\d+)-", server.ranges[NAME][1]).group(1))
    assert kept > 100  # the fast part and what trickled before the window closed
    _assert_only_complete_shards(tmp_path / "data", served)


def test_deadline_bounds_a_shard_however_its_attempts_go(server, tmp_path, caplog):
    _serve(server, tmp_path, [0])
    server.always[NAME] = "trickle"
    t0 = time.monotonic()
    # fast enough, never finished
    assert not _download(server, tmp_path, 0, min_rate=0, deadline=0.5)
    assert time.monotonic() - t0 < 5
    assert "past the deadline" in caplog.text
    assert os.path.getsize(tmp_path / "data" / f"{NAME}.tmp") > 100  # kept for the next run


def test_the_deadline_also_bounds_the_wait_for_headers(server, tmp_path, caplog):
    # every read gets a byte well within --timeout, so only the deadline can end this attempt
    _serve(server, tmp_path, [0])
    server.always[NAME] = "slow_headers"
    t0 = time.monotonic()
    assert not _download(server, tmp_path, 0, timeout=2, deadline=1.5, max_attempts=3)
    assert time.monotonic() - t0 < 6  # the header alone would take over 8 minutes
    assert "past the deadline of 1.5s for one file; not retrying" in caplog.text
    assert server.gets[NAME] == 1 and not os.path.exists(tmp_path / "data" / NAME)


@pytest.mark.slow
def test_the_deadline_holds_through_an_http_proxy(server, tmp_path, monkeypatch, caplog):
    # the test server serves as the proxy too: requests sends it "GET http://shards.example/...",
    # and the host in that URL is never looked up here
    served = _serve(server, tmp_path, [0])
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", server.url.rsplit("/resolve", 1)[0])
    url = "http://shards.example/resolve/main"
    data_dir = str(tmp_path / "data")
    assert download_single_file(0, data_dir, url, backoff_base=0.01)
    _assert_only_complete_shards(tmp_path / "data", served)
    server.always["shard_00001.parquet"] = "slow_headers"
    server.files["shard_00001.parquet"] = served[0]
    t0 = time.monotonic()
    assert not download_single_file(1, data_dir, url, timeout=2, deadline=1.5, max_attempts=1)
    assert time.monotonic() - t0 < 6
    assert "past the deadline of 1.5s for one file; not retrying" in caplog.text


# the limits of the footer tests: a trickle is judged after 1 s, the whole read ends by 5 s
TAIL_LIMITS = Limits(deadline=5, timeout=3, min_rate=2000, rate_window=1)


@pytest.mark.slow
@pytest.mark.parametrize("fault, limits, reason", [
    # a valid 206, then ~50 B/s: the 14 KB would take 5 minutes
    ("trickle", TAIL_LIMITS, "too slow"),
    # no rate floor: the deadline alone ends it
    ("trickle", Limits(deadline=2, timeout=3, min_rate=0), "past the deadline"),
    # every read gets a byte well within the timeout: the deadline cuts the wait for headers
    ("slow_headers", Limits(deadline=2, timeout=3), "past the deadline"),
])
def test_reading_a_footer_from_a_slow_server_fails_in_bounded_time(server, tmp_path, fault,
                                                                    limits, reason):
    _serve(server, tmp_path, [0])
    server.always[NAME] = fault
    url = f"{server.url}/{NAME}"
    # the deadline (5 s) and some slack: a bound on a hang, not a benchmark
    error = outcome(lambda: download.fetch_tail(url, download.TAIL_BYTES, limits), 15)
    assert isinstance(error, download.DownloadError), error
    assert error.reason == reason and url in str(error)
    assert server.ranges[NAME][0] == f"bytes=-{download.TAIL_BYTES}"


@pytest.mark.slow
def test_a_trickling_footer_fails_a_streaming_loaders_first_call_in_bounded_time(server,
                                                                                   tmp_path):
    _serve(server, tmp_path, [0, 6542])  # one train shard and the val shard
    for name in server.files:
        server.always[name] = "trickle"

    def first_call():
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), 2, 16, "train", device="cpu", stream=True, num_shards=1,
            base_url=server.url, download_limits=TAIL_LIMITS, data_dir=str(tmp_path / "cache"))
        try:
            next(loader)
        finally:
            loader.close()

    error = outcome(first_call, 15)  # (the deadline, 5 s, and slack: a bound on a hang)
    assert isinstance(error, ConnectionError), error
    # the shard and its URL, then what went wrong
    assert f"could not read the footer of shard {NAME} from {server.url}/{NAME}: " in str(error)
    assert "below the minimum of 2 KB/s" in str(error)  # too slow


def test_a_redirect_to_a_host_that_does_not_resolve_names_that_host(server, tmp_path):
    _serve(server, tmp_path, [0])
    server.always[NAME] = "redirect_invalid"
    with pytest.raises(HostNotFoundError,
                       match="cannot resolve the host 'cdn.invalid' of http://cdn.invalid/x/"):
        _download(server, tmp_path, 0)


def test_a_link_that_drops_every_70kb_completes(server, tmp_path):
    served = _serve(server, tmp_path, [0], big=True)
    size = len(served[0])
    assert size > 3 * 70_000  # so 4+ connections are needed
    server.drop_every = 70_000
    # 2 attempts are enough: each one stores 70 KB (over PROGRESS_BYTES), so the count starts
    # again every time
    assert _download(server, tmp_path, 0, max_attempts=2)
    assert server.ranges[NAME] == [None] + [f"bytes={k}-" for k in range(70_000, size, 70_000)]
    assert server.sent[NAME] == size  # no byte fetched twice
    _assert_only_complete_shards(tmp_path / "data", served)


def test_a_link_that_makes_no_real_progress_gives_up_and_keeps_its_bytes(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.drop_every = 1000  # below PROGRESS_BYTES: not progress, so the attempts run out
    assert not _download(server, tmp_path, 0, max_attempts=3)
    assert server.ranges[NAME] == [None, "bytes=1000-", "bytes=2000-"]
    assert (tmp_path / "data" / f"{NAME}.tmp").read_bytes() == served[0][:3000]
    server.drop_every = None
    assert _download(server, tmp_path, 0)  # the next run resumes where this one stopped
    assert server.ranges[NAME][-1] == "bytes=3000-"
    _assert_only_complete_shards(tmp_path / "data", served)


def test_a_dropping_link_without_a_validator_restarts_and_says_so(server, tmp_path, caplog):
    # no ETag, no Last-Modified: the bytes of a broken transfer cannot be resumed, so they are
    # not progress
    served = _serve(server, tmp_path, [0], big=True)
    server.etag = None
    server.drop_every = 70_000
    assert not _download(server, tmp_path, 0, max_attempts=3)
    assert server.ranges[NAME] == [None] * 3  # never a Range without a validator to guard it
    log = caplog.text
    assert "sends no ETag or Last-Modified, so a broken transfer of it cannot be resumed" in log
    assert "made progress" not in log and "a rerun resumes" not in log
    assert "gave up after 3 attempts in a row without progress" in log
    server.drop_every = None
    assert _download(server, tmp_path, 0)
    _assert_only_complete_shards(tmp_path / "data", served)


def test_files_and_directory_are_fsynced_around_each_rename(server, tmp_path, monkeypatch):
    served = _serve(server, tmp_path, [0])
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
    assert _download(server, tmp_path, 0)
    shard, record, folder = str(data_dir / NAME), str(data_dir / NAME) + ".json", str(data_dir)
    for final in (shard, record):
        tmp = final + ".tmp"
        rename = calls.index(("replace", tmp, final))
        assert ("fsync", tmp) in calls[:rename]  # the bytes are on disk before the name
        assert ("fsync", folder) in calls[rename + 1:]  # and the name is on disk after the rename
    assert (calls.index(("replace", record + ".tmp", record))
            < calls.index(("replace", shard + ".tmp", shard)))
    _assert_only_complete_shards(data_dir, served)


def test_a_dns_failure_after_the_host_answered_is_retried(server, tmp_path, monkeypatch):
    # a resolver's hiccup in a long run (EAI_AGAIN) is not "the host does not exist": retried,
    # not fatal
    served = _serve(server, tmp_path, [0])
    server.faults[NAME] = ["drop"]
    lookups, getaddrinfo = [], socket.getaddrinfo

    def flaky(*args, **kwargs):
        lookups.append(args[0])
        if len(lookups) == 2:  # the reconnect after the drop
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return getaddrinfo(*args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    monkeypatch.setattr(download, "_ANSWERED_HOSTS", set())
    assert _download(server, tmp_path, 0)
    assert len(lookups) == 3 and server.gets[NAME] == 2
    assert server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-"]
    _assert_only_complete_shards(tmp_path / "data", served)


# -----------------------------------------------------------------------------
# Errors that retrying cannot heal fail at once


def test_404_fails_fast(server, tmp_path, capsys):
    served = _serve(server, tmp_path, [0, 6542])  # shard 1 does not exist on the server
    data_dir = tmp_path / "data"
    assert _cli(server, data_dir, "-n", "2") == 1
    assert "  1 x HTTP 404: shard_00001.parquet" in capsys.readouterr().out
    assert server.gets["shard_00001.parquet"] == 1
    _assert_only_complete_shards(data_dir, served)


def test_unresolvable_host_stops_the_run_at_once(tmp_path):
    # .invalid never resolves (RFC 2606); with a 30 s backoff any retry would show in the time taken
    url = "http://shards.invalid/resolve/main"
    data_dir = tmp_path / "data"
    t0 = time.monotonic()
    with pytest.raises(HostNotFoundError,
                       match="cannot resolve the host 'shards.invalid' of http://shards.invalid/"):
        download_shards(range(8), str(data_dir), url, num_workers=4, backoff_base=30,
                        check_disk=False)
    with pytest.raises(HostNotFoundError, match="shards.invalid"):
        download_single_file(0, str(data_dir), url, backoff_base=30)
    assert time.monotonic() - t0 < 10
    assert not [n for n in os.listdir(data_dir) if not n.endswith(".lock")]


@pytest.mark.slow
def test_unresolvable_host_on_the_cli_is_one_error(tmp_path):
    cmd = [sys.executable, "-m", "nanochat.dataset", "-n", "240",
           "--base-url", "https://shards.invalid/x", "--data-dir", str(tmp_path / "data")]
    t0 = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "shards.invalid" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "error: cannot resolve the host 'shards.invalid' of https://")
    assert "WARNING" not in result.stderr


def test_unresolvable_host_stops_downloads_in_flight(server, tmp_path):
    # one thread is mid-way through a trickling download (fast enough: min_rate 0) when another
    # finds the host of its file does not resolve: the run stops at once, the partial file is kept
    _serve(server, tmp_path, [0])
    server.always[NAME] = "trickle"  # ~14 KB at 50 bytes/s would take minutes
    data_dir = tmp_path / "data"
    files = [(f"{server.url}/{NAME}", str(data_dir / NAME)),
             ("http://shards.invalid/x/shard_00001.parquet", str(data_dir / "shard_00001.parquet"))]
    t0 = time.monotonic()
    with pytest.raises(HostNotFoundError):
        download.download_files(files, num_workers=2, limits=Limits(min_rate=0), check_disk=False)
    assert time.monotonic() - t0 < 10
    assert os.path.getsize(data_dir / f"{NAME}.tmp") > 0 and not os.path.exists(data_dir / NAME)


@pytest.mark.parametrize("url", ["127.0.0.1:8000/resolve/main", "ftp://example.com/x", "http://",
                                 "/srv/shards"])
def test_url_without_http_scheme_is_refused_up_front(server, tmp_path, url):
    data_dir = str(tmp_path / "data")
    for call in (lambda: download_shards([0], data_dir, url),
                 lambda: download_single_file(0, data_dir, url),
                 lambda: main(["-n", "1", "--base-url", url, "--data-dir", data_dir])):
        with pytest.raises(ValueError, match="must start with http:// or https://"):
            call()
    assert not os.path.exists(data_dir)


@pytest.mark.slow
def test_summary_stays_short_for_many_failures(server, tmp_path, monkeypatch, capsys):
    # 1,000 shards that are not on the server and one that always fails with a 500
    monkeypatch.setitem(DATASETS, "many", DatasetSpec("many", "example/many", 1000, "many_data"))
    served = _serve(server, tmp_path, [1000])
    server.always[index_to_filename(1000)] = "500"
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(10**15, 0, 10**15))
    assert _cli(server, tmp_path / "data", "--dataset", "many", "-w", "8",
                "--max-attempts", "1") == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-4:] == [
        "downloaded 0/1001 shards to " + str(tmp_path / "data"),
        # a 404 will be one on a rerun too: the advice is for the one that may succeed
        "failed (1001); rerun the same command to retry the 1 that may succeed (partial "
        "downloads resume):",
        "  1000 x HTTP 404: shard_00000.parquet, shard_00001.parquet, shard_00002.parquet"
        " and 997 more",
        "  1 x HTTP 500: shard_01000.parquet",
    ]
    assert served


def test_summarize():
    reasons = {f"f{i:04d}": "HTTP 404" for i in range(1000)} | {"a": "too slow", "b": "too slow"}
    assert summarize(reasons) == ["  1000 x HTTP 404: f0000, f0001, f0002 and 997 more",
                                  "  2 x too slow: a, b"]
    assert summarize({}) == []


def test_stated_sha256_is_read_as_huggingface_hub_reads_it():
    def response(headers, history=()):
        r = download.requests.Response()
        r.headers.update(headers)
        r.history = list(history)
        return r

    digest = "ab" * 32
    cdn = response({"ETag": '"0123456789abcdef0123456789abcdef"'},
                   [response({"X-Linked-Etag": f'"{digest}"', "ETag": '"b1ob"'})])
    assert download.stated_sha256(cdn) == digest
    assert download.stated_sha256(response({"ETag": f'W/"{digest.upper()}"'})) == digest
    # an md5
    assert download.stated_sha256(response({"ETag": '"0123456789abcdef0123456789abcdef"'})) is None
    # unquoted: not the form we trust
    assert download.stated_sha256(response({"ETag": digest})) is None
    assert download.stated_sha256(response({})) is None
    # weak: not for If-Range
    assert download.validator(response({"ETag": 'W/"x"', "Last-Modified": "Mon"})) == "Mon"


# -----------------------------------------------------------------------------
# Concurrency and disk space


def test_two_threads_download_one_shard_once(server, tmp_path):
    served = _serve(server, tmp_path, [0])
    server.always[NAME] = "slow"  # the second caller arrives mid-download
    results = []
    threads = [threading.Thread(target=lambda: results.append(_download(server, tmp_path, 0)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]
    assert server.gets[NAME] == 1  # the one waiting on the lock found the file and skipped
    _assert_only_complete_shards(tmp_path / "data", served)


@pytest.mark.slow
def test_two_processes_download_into_one_dir(server, tmp_path):
    served = _serve(server, tmp_path, [0, 1, 2, 6542])
    for name in server.files:
        server.always[name] = "slow"
    data_dir = tmp_path / "data"
    cmd = [sys.executable, "-m", "nanochat.dataset", "-n", "3", "-w", "2", "--base-url", server.url,
           "--data-dir", str(data_dir)] + QUICK_BACKOFF
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("downloaded 4/4 shards" in out for out in outputs)
    assert sum(server.gets.values()) == 4  # every shard was fetched by exactly one process
    _assert_only_complete_shards(data_dir, served)


_DiskUsage = namedtuple("_DiskUsage", "total used free")  # what shutil.disk_usage returns


def test_not_enough_disk_space_stops_before_downloading(server, tmp_path, monkeypatch):
    _serve(server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    monkeypatch.setattr(download.shutil, "disk_usage",
                        lambda path: _DiskUsage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError, match="--data-dir") as info:
        _cli(server, data_dir, "-n", "1")
    assert info.value.errno == errno.ENOSPC
    assert server.heads["shard_00000.parquet"] == 1 and not server.gets


@pytest.mark.slow
def test_the_disk_checks_head_request_ends_within_the_timeout(server, tmp_path, monkeypatch):
    _serve(server, tmp_path, [0])
    server.always[NAME] = "slow_headers"  # every read gets a byte well within the timeout
    # the headers alone would take over 8 minutes
    result = outcome(lambda: download.check_disk_space(str(tmp_path), 1, f"{server.url}/{NAME}",
                                                       timeout=1), 10)
    assert result is None
    # cut off, the server said no size: the estimate stands in
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(10**9, 0, 10**9))
    with pytest.raises(OSError, match="estimated"):
        download.check_disk_space(str(tmp_path), 10, f"{server.url}/{NAME}", timeout=1)


def test_disk_check_falls_back_to_the_estimate(tmp_path, monkeypatch):
    free = 3 * download.SHARD_BYTES_ESTIMATE
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(free, 0, free))
    download.check_disk_space(str(tmp_path), 2)  # 2 * 100MB * 1.1 fits in 300MB
    with pytest.raises(OSError, match="estimated"):
        download.check_disk_space(str(tmp_path), 3)


@pytest.mark.slow
def test_download_imports_nothing_of_dataset():
    code = "import sys, nanochat.data.fetch.download; assert 'nanochat.dataset' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="deadline"):
        Limits(deadline=0)
