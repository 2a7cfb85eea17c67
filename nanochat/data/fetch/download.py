"""
Fetch parquet files so that only complete, verified files appear under their final names.
A file comes over HTTP, or from a store (S3, GCS, ..., a local directory: stores.py, in chunks). It
is fetched into `<name>.tmp` under a per-file lock, checked (the size and hashes the source stated,
PAR1 at both ends, readable parquet metadata, every page when no hash was stated) and renamed into
place; `<name>.json` records its size and sha256, so later runs re-check it offline. An attempt, and
the read of a file's end, ends in bounded time (silence, a low rate, a deadline); a dropped transfer
resumes (Range + If-Range; a store: from the temp's end while the object's version is unchanged).

Cost: checking a ~100MB shard takes ~0.07 s from the page cache (sha256 at ~1.4 GB/s); reading
its pages (once, and only when no hash was stated) ~0.6 s.
Design: docs/downloads.md

May import: nanochat.data.base.checks, nanochat.data.base.files, nanochat.data.fetch.stores,
requests, urllib3, pyarrow, filelock.
"""

import contextlib
import errno
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import urllib.parse
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import requests
import urllib3
from filelock import FileLock

from nanochat.data.fetch import stores
from nanochat.data.base.checks import check_int, is_int
from nanochat.data.base.files import disk_full, fsync_dir, progress_bar, remove_if_exists

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# Settings

MAX_ATTEMPTS = 5  # attempts in a row without progress; waits between: base, 2, 4, 8 * base
BACKOFF_BASE = 2.0  # seconds (2, 4, 8, 16 s by default)
REQUEST_TIMEOUT = 30.0  # seconds of silence (connect or read) before an attempt counts as failed
# bytes/s: an attempt slower than this over RATE_WINDOW fails (a ~100MB shard takes ~35 min)
MIN_RATE = 50_000.0
RATE_WINDOW = 30.0  # seconds over which the rate is averaged
DEADLINE = 3600.0  # seconds for one file, all attempts together; past it the file fails this run
# An attempt that stored at least this many bytes made progress: the attempt count starts again. A
# link that drops every 200 KB then still completes, one that delivers a few bytes per attempt does
# not.
PROGRESS_BYTES = 64 * 1024
CHUNK_SIZE = 64 * 1024  # the most one read returns; a read returns as soon as any bytes arrive
# A store is read in ranged requests of this many bytes: a ~100MB shard in 12, so a request's
# latency (~20-50 ms to S3) costs little beside its transfer, while a broken request loses at most
# this much (a ranged read returns all of it or nothing) and 4 workers hold 32 MiB in memory.
STORE_CHUNK_BYTES = 8 * 1024**2
RETRY_AFTER_CAP = 60.0  # a server asking for longer than this gets this
# Used for the disk check when the server gives no Content-Length: FineWeb-Edu and ClimbMix shards
# are ~90-100MB (zstd), so 100MB errs on the side of asking for too much.
SHARD_BYTES_ESTIMATE = 100 * 1024**2
# what a full disk under a download asks of its user
DOWNLOAD_DISK_FIX = ("free some space, pass --data-dir on a bigger disk, or fetch fewer shards "
                     "(-n); a streaming loader: pass a smaller cache_limit")
SOURCE_FIX = ("Pass another data directory for this source (--data-dir, data_dir=), or the source "
              "its shards came from (--base-url, base_url=, NANOCHAT_DATA_URL), or remove those "
              "shards and their .json records to fetch this source's in their place")
DISK_MARGIN = 1.1  # shards differ in size by a few percent; keep 10% headroom over the estimate
MAGIC = b"PAR1"  # every parquet file starts and ends with it


@dataclass(frozen=True)
class Limits:
    """How often and for how long to try one file."""
    max_attempts: int = MAX_ATTEMPTS
    backoff_base: float = BACKOFF_BASE
    timeout: float = REQUEST_TIMEOUT
    min_rate: float = MIN_RATE
    rate_window: float = RATE_WINDOW
    deadline: float = DEADLINE

    def __post_init__(self):
        check_int("max_attempts", self.max_attempts, 1)
        for name in ("backoff_base", "min_rate"):  # 0: retry at once, no rate floor
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("timeout", "rate_window", "deadline"):  # 0 would fail every attempt at once
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


# -----------------------------------------------------------------------------
# Errors


class DownloadError(Exception):
    """A file could not be fetched. `reason` is a short category for the end-of-run summary
    ("HTTP 404", "too slow", ...); the message says what happened in full."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BadFileError(DownloadError):
    """A file on disk failed a check (size, sha256, magic, metadata). Partial files that fail are
    discarded."""


class HostNotFoundError(OSError):
    """The server's name does not resolve: no file can be fetched, so the whole run stops."""


class _GiveUp(DownloadError):
    """Retrying cannot help in this run (404, a symlink in the way, the deadline)."""


class _NotThere(_GiveUp):
    """The source has no such file, or refuses it (404, another 4xx, a store's not found or access
    denied): a rerun gets the same answer, so the summary does not advise one."""


class _RetryLater(DownloadError):
    """The server asked us to wait (429/503 with Retry-After) instead of using our backoff."""

    def __init__(self, reason: str, message: str, seconds: float):
        super().__init__(reason, message)
        self.seconds = seconds


class _Stopped(Exception):
    """Another file of the run hit an error that stops the run (or the user pressed Ctrl-C)."""


def check_url(url: str) -> None:
    """Raise ValueError unless url is an http:// or https:// URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"download URL {url!r} must start with http:// or https:// and name a "
                         "host, e.g. https://huggingface.co/datasets/...; fix --base-url or "
                         "NANOCHAT_DATA_URL")


def check_address(address: str) -> None:
    """Raise ValueError unless address is an http(s) URL with a host (check_url) or a store's
    address (stores.check_address: s3://bucket/prefix, ..., file://..., a local path)."""
    if not isinstance(address, str) or stores.is_http(address):
        return check_url(address)
    if stores.scheme_of(address) and stores.scheme_of(address) not in stores.STORES:
        netloc = urllib.parse.urlsplit(address).netloc  # (shown without a user:password@)
        shown = stores.redact(address.replace(netloc, netloc.rsplit("@", 1)[-1], 1))
        raise ValueError(f"base_url {shown!r} must start with http:// or https:// or be a store's "
                         f"address: {stores.ADDRESS_FORMS}; fix --base-url or NANOCHAT_DATA_URL")
    stores.check_address(address)


def _dns_failure(error: BaseException) -> socket.gaierror | None:
    """The failed DNS lookup (socket.gaierror) somewhere in the error's chain, if that was the
    cause. requests wraps it: ConnectionError <- urllib3's MaxRetryError <- NameResolutionError <-
    gaierror."""
    seen = set()  # a chain can loop (an error set as its own context's cause)
    while error is not None and id(error) not in seen:
        if isinstance(error, socket.gaierror):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


# Hosts that have answered in this process: a failed lookup of one of them later (a resolver's
# hiccup in a long run) is retried like any network error, not a reason to stop every download.
_ANSWERED_HOSTS: set = set()


def _failed_url(error: Exception, url: str) -> str:
    """The URL of the request that failed: after a redirect, the target's, not the one we asked
    for."""
    request = getattr(error, "request", None)
    return getattr(request, "url", None) or url


def _host_not_found(url: str, error: socket.gaierror) -> HostNotFoundError:
    host = urllib.parse.urlsplit(url).hostname
    return HostNotFoundError(f"cannot resolve the host {host!r} of {url} ({error.strerror}); check "
                             "the network connection and the URL (--base-url, NANOCHAT_DATA_URL), "
                             "then rerun (files already fetched are kept)")


def _reason_of(error: Exception) -> str:
    """The summary category of a network or local error."""
    if isinstance(error, (requests.Timeout, urllib3.exceptions.TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(error, (requests.RequestException, urllib3.exceptions.HTTPError)):
        return "connection failed"
    return "local error"


# -----------------------------------------------------------------------------
# Files beside the download: names, records, opening without following links


def tmp_path(path: str) -> str:
    return path + ".tmp"  # never a *.parquet name, so the listing never sees a partial file


def record_path(path: str) -> str:
    """`<path>.json`: what was verified about path (size, sha256), or for a `.tmp` which version it
    holds."""
    return path + ".json"


def lock_path(path: str) -> str:
    # a hidden name that does not end in .parquet, so the listing never sees it. We never delete it
    # ourselves: unlinking a lock file another process is waiting on lets a third process lock a
    # fresh file of the same name, and then two writers would share one temp file.
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.lock")


def _discard(tmp: str) -> None:
    remove_if_exists(tmp)
    remove_if_exists(record_path(tmp))  # a record without its bytes would vouch for nothing


def _size(path: str) -> int:
    return os.lstat(path).st_size if os.path.lexists(path) else 0  # lstat: a link's own size


def _open_nofollow(path: str, flags: int, mode: str):
    """os.open with O_NOFOLLOW: a symlink at path is an error; its target is never read or
    written."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # what O_NOFOLLOW gives for a symlink
            raise _GiveUp("symlink in the way",
                          f"{path} is a symbolic link; the downloader never writes through one. "
                          f"Remove the link (rm {path}) and rerun") from None
        raise
    return os.fdopen(fd, mode)


def _resumable(tmp: str) -> int:
    """Bytes of tmp a next attempt can resume from: none unless its record names a validator."""
    try:
        record = _read_json(record_path(tmp))
    except BadFileError:
        return 0
    return _size(tmp) if record and record.get("validator") else 0


def _write_json(path: str, record: dict) -> None:
    """Write a small JSON record atomically (the caller holds the file's lock, so the temp name is
    ours)."""
    tmp = tmp_path(path)
    try:
        with _open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the record
        os.replace(tmp, path)
    except OSError:
        remove_if_exists(tmp)  # (a full disk: an empty temporary file would stay for good)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # and the rename itself survives a crash


def _read_json(path: str) -> dict | None:
    """The record at path, None when there is none; BadFileError when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadFileError("unreadable record", f"{path} could not be read ({e})") from None
    if not isinstance(record, dict):
        raise BadFileError("unreadable record",
                           f"{path} holds {type(record).__name__}, not a JSON object")
    return record


# -----------------------------------------------------------------------------
# Checking a file: size, sha256, parquet structure


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            # hashlib releases the GIL for big buffers: threads hash in parallel
            digest.update(chunk)
    return digest.hexdigest()


def check_parquet(path: str) -> None:
    """Raise BadFileError unless path starts and ends with PAR1, its footer parses, and every column
    chunk of every row group lies between the leading magic and the footer."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4)
        f.seek(max(size - 8, 0))
        tail = f.read(8)  # the footer's length (4 bytes, little-endian), then PAR1
        # 12 bytes: PAR1, a footer length and PAR1, the least a parquet file can be
        if size < 12 or head != MAGIC:
            raise BadFileError("not parquet", f"{path} does not start with PAR1 ({size} bytes, "
                                              f"starting with {head!r})")
        if tail[4:] != MAGIC:
            raise BadFileError("not parquet", f"{path} does not end with PAR1 ({size} bytes): "
                                              "truncated, or not a parquet file")
        footer_start = size - 8 - int.from_bytes(tail[:4], "little")
        try:
            metadata = pq.ParquetFile(f).metadata
            # a footer can parse and still point past the data (a file cut and padded): each
            # column chunk must lie inside the file, or reading it later fails mid-epoch
            for i in range(metadata.num_row_groups):
                row_group = metadata.row_group(i)
                for j in range(row_group.num_columns):
                    column = row_group.column(j)
                    first = (column.dictionary_page_offset if column.has_dictionary_page
                             else column.data_page_offset)
                    if not 4 <= first <= first + column.total_compressed_size <= footer_start:
                        raise BadFileError("unreadable parquet metadata",
                                           f"{path}: row group {i} column {j} lies outside the "
                                           f"data (bytes {first}+{column.total_compressed_size}, "
                                           f"footer at {footer_start})")
        except (pa.ArrowException, OSError) as e:
            raise BadFileError("unreadable parquet metadata",
                               f"{path} has no readable parquet footer ({e})") from None


def check_pages(path: str) -> None:
    """Raise BadFileError unless every row group of path reads: each page decompresses and decodes,
    as a reader will need them to (~0.6 s for a 124MB shard of 300 MB of text). Run after
    check_parquet."""
    with open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        for i in range(parquet.metadata.num_row_groups):
            try:
                parquet.read_row_group(i)  # every column: the text and whatever else is there
            except (pa.ArrowException, OSError) as e:
                raise BadFileError("corrupt page",
                                   f"{path}: row group {i} does not read ({e})") from None


def _pages_vouched(record: dict | None) -> bool:
    """Whether a record whose sha256 the file matches also vouches that every page reads: the server
    stated that sha256, or a store a hash it matched (the bytes are the publisher's), or the pages
    were read before."""
    return record is not None and (record.get("sha256_stated_by_server") is True
                                   or record.get("pages_checked") is True
                                   or bool(record.get("stated_hashes")))


def check_file(path: str) -> None:
    """Raise BadFileError unless path is a sound parquet file that matches its record, when it has
    one (size and sha256, checked in that order). Every page is read too (check_pages) unless the
    record vouches for them (_pages_vouched): a shard the server stated no sha256 for is read once,
    a file without a record at every check."""
    record = _read_json(record_path(path))
    if record is not None and not (isinstance(record.get("size"), int)
                                   and re.fullmatch(r"[0-9a-f]{64}", str(record.get("sha256")))):
        raise BadFileError("unreadable record", f"{record_path(path)} lacks a size and a sha256")
    try:
        size = os.path.getsize(path)
        # cheapest first: the size costs a stat, the sha256 reads the whole file
        if record is not None and size != record["size"]:
            raise BadFileError("wrong size",
                               f"{path} has {size} bytes, its record says {record['size']}")
        check_parquet(path)
        if record is not None and sha256_of(path) != record["sha256"]:
            raise BadFileError("sha256 mismatch",
                               f"{path} does not hash to the sha256 in its record")
        if not _pages_vouched(record):
            check_pages(path)
    except OSError as e:  # a directory or an unreadable file under the name
        raise BadFileError("unreadable", f"{path} could not be read ({e})") from None


def check_files(paths: list[str], num_workers: int = 4, *,
                progress: bool | None = None) -> dict[str, BadFileError]:
    """check_file on each path with num_workers threads; returns {path: error} for the bad ones."""
    def check(path):
        try:
            check_file(path)
        except BadFileError as e:
            return e
        return None

    bad = {}
    with ThreadPoolExecutor(max_workers=max(num_workers, 1)) as pool:
        results = pool.map(check, paths)  # in the order of paths, so the bar counts in order
        # the bar first: zip then asks it once more, and it counts the last file and closes
        for error, path in zip(progress_bar(results, progress=progress, total=len(paths),
                                            unit="file", desc="checking"), paths):
            if error is not None:
                bad[path] = error
    return bad


# -----------------------------------------------------------------------------
# What the server says: status, sizes, validators, sha256


def _retry_after_seconds(value: str | None) -> float | None:
    """The seconds form of a Retry-After header, capped at RETRY_AFTER_CAP; None if absent or a
    date."""
    if value is None or not value.strip().isdigit():
        return None  # the HTTP-date form is rare for these servers; our own backoff covers it
    return min(float(value.strip()), RETRY_AFTER_CAP)


def _content_length(response: requests.Response) -> int | None:
    # with a Content-Encoding the header counts compressed bytes, not what we write to disk
    if response.headers.get("Content-Encoding", "identity") != "identity":
        return None
    value = response.headers.get("Content-Length", "")
    return int(value) if value.isdigit() else None


def _parse_content_range(value: str | None) -> tuple[int, int | None]:
    """(first byte, total size or None) of a `bytes first-last/total` Content-Range."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (value or "").strip())
    if not match:
        raise BadFileError("bad Content-Range",
                           f"206 answer with an invalid Content-Range {value!r}")
    first, last = int(match.group(1)), int(match.group(2))
    total = None if match.group(3) == "*" else int(match.group(3))  # "*": size unknown
    if last < first or (total is not None and last >= total):
        raise BadFileError("bad Content-Range",
                           f"206 answer with an inconsistent Content-Range {value!r}")
    return first, total


def _unsatisfied_range_total(response: requests.Response) -> int | None:
    """The file size a 416 answer reports in its `bytes */total` Content-Range, if any."""
    match = re.fullmatch(r"bytes \*/(\d+)", response.headers.get("Content-Range", "").strip())
    return int(match.group(1)) if match else None


def _check_status(response: requests.Response, url: str) -> None:
    """Return for 200/206; otherwise raise the error that says whether and when to retry."""
    code = response.status_code
    if code in (200, 206):
        return
    if code == 416:  # our partial file is longer than the server's: discarded, then start over
        raise BadFileError("HTTP 416", f"{url}: 416 Range Not Satisfiable for our partial file")
    if code in (429, 503):  # without Retry-After these fall through to our own backoff
        seconds = _retry_after_seconds(response.headers.get("Retry-After"))
        if seconds is not None:
            raise _RetryLater(f"HTTP {code}", f"{url}: HTTP {code}, Retry-After {seconds:g}s",
                              seconds)
    if code == 404:
        raise _NotThere("HTTP 404", f"{url}: HTTP 404, not on the server; check the URL "
                                    "(--base-url, NANOCHAT_DATA_URL) and that the dataset has "
                                    "this file")
    # other client errors will not change on a retry; 408 (timeout) and 429 (busy) may
    if 400 <= code < 500 and code not in (408, 429):
        raise _NotThere(f"HTTP {code}", f"{url}: HTTP {code}")
    raise DownloadError(f"HTTP {code}", f"{url}: HTTP {code}")


def validator(response: requests.Response) -> str | None:
    """What If-Range may name to mean "this version of the file": a strong ETag, else
    Last-Modified. (A weak ETag, W/"...", is not allowed in If-Range.)"""
    etag = response.headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return response.headers.get("Last-Modified")


def stated_sha256(response: requests.Response) -> str | None:
    """The file's sha256 if the server states it, as huggingface_hub reads it: X-Linked-Etag (the
    hub puts it on the redirect to its CDN, so it may be on a response in history), else the ETag
    of the first response. Only a quoted 64-hex-digit value (W/ allowed) is a sha256; anything else
    is just a validator (S3's md5, a git blob sha1, ...)."""
    chain = [*response.history, response]
    value = next((r.headers["X-Linked-Etag"] for r in chain if "X-Linked-Etag" in r.headers), None)
    if value is None:
        value = chain[0].headers.get("ETag", "")
    match = re.fullmatch(r'(?:W/)?"([0-9a-fA-F]{64})"', value.strip())
    return match.group(1).lower() if match else None


# -----------------------------------------------------------------------------
# One attempt: resume or restart the temp file, stream with bounds, verify, install


def _resume_point(tmp: str) -> tuple[int, dict | None]:
    """(bytes of tmp to keep, its record). A tmp that cannot be trusted is discarded: one without a
    record naming a validator (nothing could tell whether its bytes belong to the file the server
    has now, and splicing two versions is the one failure we must never risk), one that does not
    start with PAR1, or one longer than the file."""
    try:
        f = _open_nofollow(tmp, os.O_RDONLY, "rb")
    except FileNotFoundError:
        remove_if_exists(record_path(tmp))
        return 0, None
    with f:
        have = os.fstat(f.fileno()).st_size
        head = f.read(4)
    try:
        record = _read_json(record_path(tmp))
    except BadFileError:
        record = None
    why = None
    if not record or not record.get("validator"):
        why = "no record of which version of the file it holds"
    elif not MAGIC.startswith(head):  # startswith: a tmp of 1-3 bytes holds part of the magic
        why = f"it does not start with PAR1 (starts with {head!r})"
    elif record.get("size") is not None and have > record["size"]:
        why = f"it is longer than the file ({record['size']} bytes)"
    if why:
        if have:
            logger.warning("discarding %d bytes of %s: %s", have, tmp, why)
        _discard(tmp)
        return 0, None
    return have, record


# The deadline cuts an attempt off wherever it is, the wait for the response's headers included:
# requests' timeout only bounds each read, and a server can send one header byte per read. The
# connections of a download session note their sockets by thread, so that a timer can shut the
# socket of that thread's attempt.
_SOCKETS: dict[int, socket.socket] = {}


class _NotedHTTPConnection(urllib3.connection.HTTPConnection):
    def connect(self):
        super().connect()
        _SOCKETS[threading.get_ident()] = self.sock


class _NotedHTTPSConnection(urllib3.connection.HTTPSConnection):
    def connect(self):
        super().connect()
        _SOCKETS[threading.get_ident()] = self.sock


class _NotedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _NotedHTTPConnection


class _NotedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _NotedHTTPSConnection


class _NotedAdapter(requests.adapters.HTTPAdapter):
    """Connections that note their sockets, direct or through an HTTP(S) proxy (not SOCKS: those
    keep only the per-read timeout and the checks as the body arrives)."""

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _NotedHTTPPool, "https": _NotedHTTPSPool}

    def proxy_manager_for(self, proxy, **kwargs):
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):  # SOCKS managers build their own connections
            manager.pool_classes_by_scheme = {"http": _NotedHTTPPool, "https": _NotedHTTPSPool}
        return manager


def _cut(thread: int) -> None:
    sock = _SOCKETS.get(thread)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once; the attempt fails
        except OSError:
            pass  # already closed


def _session() -> requests.Session:
    session = requests.Session()  # one per attempt: a cut socket is never reused
    for scheme in ("http://", "https://"):
        session.mount(scheme, _NotedAdapter())
    return session


@contextlib.contextmanager
def _watchdog(deadline: float):
    """Within the block, this thread's connection is shut at the deadline (see _SOCKETS). Yields
    the event that says whether it was: whatever error the cut caused, the deadline is the
    reason."""
    # 0.01 s at least: a timer of 0 or less would fire before the request even starts
    left, fired = max(deadline - time.monotonic(), 0.01), threading.Event()
    timer = threading.Timer(left, lambda thread: fired.set() or _cut(thread),
                            args=(threading.get_ident(),))
    timer.daemon = True  # a pending timer never keeps the process alive
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()
        _SOCKETS.pop(threading.get_ident(), None)


class _Pace:
    """The checks after each piece of a body arrives: the run's stop, the deadline, and the rate
    over disjoint windows of limits.rate_window (a body shorter than one window is never judged by
    its rate)."""

    def __init__(self, limits: Limits, deadline: float, stop):
        self.limits, self.deadline, self.stop = limits, deadline, stop
        self.window_start, self.window_bytes = time.monotonic(), 0

    def check(self, nbytes: int) -> None:
        """Raise when the attempt must end, nbytes having just arrived."""
        if self.stop.is_set():
            raise _Stopped()
        now = time.monotonic()
        if now > self.deadline:
            raise _GiveUp("past the deadline",
                          f"past the deadline of {self.limits.deadline:g}s for one file")
        self.window_bytes += nbytes
        if now - self.window_start >= self.limits.rate_window:
            rate = self.window_bytes / (now - self.window_start)
            if rate < self.limits.min_rate:
                raise DownloadError("too slow", f"{rate / 1e3:.3g} KB/s over "
                                                f"{now - self.window_start:.1f}s, below the "
                                                f"minimum of {self.limits.min_rate / 1e3:g} KB/s")
            # disjoint windows: a fast start hides no stall
            self.window_start, self.window_bytes = now, 0


def _chunks(response: requests.Response, limits: Limits, deadline: float, stop):
    """The body as it arrives; raises when the rate over a window falls below limits.min_rate, past
    the deadline, or when the run stops (_Pace). read1 returns whatever has arrived, so a
    trickling server is noticed within one window."""
    pace = _Pace(limits, deadline, stop)
    while chunk := response.raw.read1(CHUNK_SIZE):
        yield chunk  # the caller keeps it before a check below ends the attempt
        pace.check(len(chunk))


def _fetch_to_tmp(url: str, tmp: str, limits: Limits, deadline: float, progress: bool | None,
                  stop) -> dict:
    """One attempt: bring tmp up to the whole file, resuming when it holds a prefix of the same
    version. Returns its record: the validator, and the size and sha256 the server stated (None
    when it did not)."""
    have, record = _resume_point(tmp)
    # identity: we compare bytes on disk with Content-Length, which compression would break
    headers = {"Accept-Encoding": "identity"}
    if have:
        # If-Range: "the rest, if the file is still this version; else the whole file" (a 200)
        headers.update({"Range": f"bytes={have}-", "If-Range": record["validator"]})
    timeout = min(limits.timeout, max(deadline - time.monotonic(), 0.01))
    with _watchdog(deadline) as fired:
        try:
            with _session() as session:
                record = _attempt(session, url, tmp, have, record, headers, timeout=timeout,
                                  limits=limits, deadline=deadline, progress=progress, stop=stop)
        except Exception as e:
            if not fired.is_set() or isinstance(e, _Stopped):
                raise
            record = None  # the watchdog cut the connection: the deadline is the reason
    # a cut can also end headers early (a 200 with no body); a transfer that completed as the timer
    # fired stands
    if fired.is_set() and not (record and record["size"] is not None
                               and _size(tmp) == record["size"]):
        raise _GiveUp("past the deadline",
                      f"past the deadline of {limits.deadline:g}s for one file")
    return record


def _attempt(session: requests.Session, url: str, tmp: str, have: int, record: dict | None,
             headers: dict, *, timeout: float, limits: Limits, deadline: float,
             progress: bool | None, stop) -> dict:
    """The request and the body of one attempt (see _fetch_to_tmp)."""
    with session.get(url, headers=headers, stream=True, timeout=timeout) as response:
        # every host on the redirect chain answered: a later failed lookup of one is a hiccup
        _ANSWERED_HOSTS.update(urllib.parse.urlsplit(r.url).hostname
                               for r in [*response.history, response])
        if response.status_code == 416 and have and _unsatisfied_range_total(response) == have:
            return record  # a run stopped between the last byte and the rename; the checks decide
        _check_status(response, url)
        if response.status_code == 206:
            first, total = _parse_content_range(response.headers.get("Content-Range"))
            if not have or first != have:
                asked = f"bytes from {have}" if have else "the whole file"
                raise BadFileError("bad Content-Range",
                                   f"{url}: asked for {asked}, got a range from byte {first}")
            # a server that ignores If-Range could still answer 206 for a changed file
            other_size = None not in (total, record["size"]) and total != record["size"]
            if validator(response) not in (None, record["validator"]) or other_size:
                raise BadFileError("changed on the server",
                                   f"{url} changed since {tmp} was started")
            append = True
        else:
            if have:
                logger.info("%s: the server sent the whole file (it changed, or ignores Range); "
                            "starting over", url)
            record = {"url": url, "validator": validator(response),
                      "size": _content_length(response), "sha256": stated_sha256(response)}
            if record["validator"] is None:
                logger.warning("%s: the server sends no ETag or Last-Modified, so a broken "
                               "transfer of it cannot be resumed: each attempt starts from byte 0",
                               url)
            append = False
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        try:
            with _open_nofollow(tmp, flags, "ab" if append else "wb") as f, \
                    progress_bar(progress=progress, lines=False,  # (the files bar's lines say it)
                                 total=record["size"], initial=have if append else 0, unit="B",
                                 unit_scale=True, desc=os.path.basename(url), leave=False) as bar:
                if not append:
                    # the truncation is on disk before the record names the new version: a crash
                    # never leaves old bytes under a new validator
                    os.fsync(f.fileno())
                    _write_json(record_path(tmp), record)
                for chunk in _chunks(response, limits, deadline, stop):
                    f.write(chunk)
                    bar.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # (the size stated, for the message)
                raise _DiskFull(record["size"]) from e
            raise
    return record


# -----------------------------------------------------------------------------
# One attempt from a store: stat, then ranged reads in chunks, then stat again


@contextlib.contextmanager
def _store_errors(limits: Limits, deadline: float):
    """Within the block, a store's error becomes ours: one a retry cannot help (not found, access
    denied) gives up at once, the others (slow down, timed out, connection failed) go to the
    backoff. Missing credentials stop the run (the StoreError itself, an OSError): no file of that
    store can be fetched. A missing extra (MissingExtra) passes unchanged."""
    try:
        yield
    except stores.StoreError as e:
        if e.reason == "no credentials":
            raise
        if time.monotonic() >= deadline:  # the call was cut at the deadline
            raise _GiveUp("past the deadline", f"{e}; past the deadline of {limits.deadline:g}s "
                                               "for one file") from None
        if not e.retry:
            raise _NotThere(e.reason, str(e)) from None
        raise DownloadError(e.reason, str(e)) from None


def _call_bound(limits: Limits, deadline: float, nbytes: int) -> float:
    """Seconds one store call may take: limits.timeout, plus what a transfer of nbytes at exactly
    min_rate needs (no rate floor: no bound but the deadline), never past the deadline."""
    need = limits.timeout + (nbytes / limits.min_rate if limits.min_rate > 0 else float("inf"))
    return max(min(need, deadline - time.monotonic()), 0.01)


def _stat_object(address: str, limits: Limits, deadline: float) -> stores.ObjectInfo:
    with _store_errors(limits, deadline):
        return stores.stat(address, limits.timeout, within=_call_bound(limits, deadline, 0))


def _read_object(address: str, start: int, end: int, limits: Limits, deadline: float) -> bytes:
    """Bytes [start, end) of the object; a short answer means it shrank: BadFileError."""
    with _store_errors(limits, deadline):
        body = stores.read_range(address, start, end, limits.timeout,
                                 within=_call_bound(limits, deadline, end - start))
    if len(body) != end - start:
        raise BadFileError("changed on the store",
                           f"{stores.redact(address)}: asked for bytes {start}-{end}, got "
                           f"{len(body)}: it changed on the store")
    return body


def _fetch_object_to_tmp(address: str, tmp: str, limits: Limits, deadline: float,
                         progress: bool | None, stop) -> dict:
    """One attempt from a store: bring tmp up to the whole object, resuming when tmp holds a prefix
    of the version the store has now. Returns tmp's record: the version (validator), size and the
    hashes the store states. An object replaced during the attempt: BadFileError (the caller
    discards tmp and starts over), so two versions are never spliced."""
    info = _stat_object(address, limits, deadline)
    have, record = _resume_point(tmp)
    if have and (record.get("validator") != info.version or record.get("size") != info.size):
        logger.info("%s: the object changed on the store since %s was started; starting over",
                    stores.redact(address), tmp)
        have = 0
    if not have:
        record = {"url": address, "validator": info.version, "size": info.size,
                  "hashes": info.hashes}
        if info.version is None:
            logger.warning("%s: the store states no version of it, so a broken transfer of it "
                           "cannot be resumed: each attempt starts from byte 0",
                           stores.redact(address))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC)
    pace = _Pace(limits, deadline, stop)
    try:
        with _open_nofollow(tmp, flags, "ab" if have else "wb") as f, \
                progress_bar(progress=progress, lines=False, total=info.size, initial=have,
                             unit="B", unit_scale=True, desc=os.path.basename(address),
                             leave=False) as bar:
            if not have:  # as for HTTP: the truncation is on disk before the record names it
                os.fsync(f.fileno())
                _write_json(record_path(tmp), record)
            while have < info.size:
                # stop, the deadline and the rate are checked between chunks: a chunk itself is
                # bounded by _call_bound
                body = _read_object(address, have, min(have + STORE_CHUNK_BYTES, info.size),
                                    limits, deadline)
                f.write(body)
                f.flush()  # on disk for a next attempt, whatever ends this one
                have += len(body)
                bar.update(len(body))
                if have < info.size:  # (a complete file is installed whatever its rate)
                    pace.check(len(body))
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _DiskFull(info.size) from e
        raise
    # the ranged reads name no version: one replaced between them would splice two
    after = _stat_object(address, limits, deadline)
    if (after.version, after.size) != (info.version, info.size):
        raise BadFileError("changed on the store",
                           f"{stores.redact(address)} changed on the store during the "
                           f"download of {tmp}")
    return record


def _install(tmp: str, path: str, record: dict) -> None:
    """Check tmp against what the server (or store) stated and as parquet, then rename it to path;
    its record first. A bad file that was at path stays there until this moment, so the name is
    never empty."""
    size = os.path.getsize(tmp)
    who = "the store" if "hashes" in record else "the server"
    if record["size"] is not None and size != record["size"]:
        raise BadFileError("wrong size", f"{tmp} has {size} bytes, {who} stated {record['size']}")
    check_parquet(tmp)
    digests = _digests(tmp, record.get("hashes") or {})  # one read for every hash
    digest = digests["sha256"]
    if record.get("sha256") is not None and digest != record["sha256"]:
        raise BadFileError("sha256 mismatch",
                           f"{tmp} hashes to {digest}, the server stated {record['sha256']}")
    matched = _check_stated(tmp, record, digests) if "hashes" in record else []
    stated = record.get("sha256") is not None or "sha256" in matched
    vouched = stated or bool(matched)  # the bytes are the publisher's: their pages read
    if not vouched:  # only the bytes vouch for themselves: read every page, as a reader will
        check_pages(tmp)
    # the sha256 is recorded either way: from then on a local change to the file is caught, and
    # check_file need not read the pages again
    installed = {"size": size, "sha256": digest, "sha256_stated_by_server": stated,
                 "pages_checked": not vouched, "source": source_of(record["url"]),
                 # the version the source stated: an ETag (or Last-Modified), a store's version
                 "source_version": record.get("validator")}
    if "hashes" in record:  # which of the store's hashes matched (none: size and structure only)
        installed["stated_hashes"] = matched
    if record.get("streamed"):  # a streaming cache's: it may evict it (ledger.py rebuilds by it)
        installed["streamed"] = True
    _write_json(record_path(path), installed)
    with _open_nofollow(tmp, os.O_RDONLY, "rb") as f:
        # its bytes are on disk before its name is (a 416 finish skipped the write's fsync)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    remove_if_exists(record_path(tmp))


# the CRCs a store may state that the standard library lacks: (module, how to extend a value), in
# order of preference; none installed: the CRC is not checked (and not counted as checked)
_OPTIONAL_CRCS = {
    "crc32c": (("google_crc32c", lambda m, data, value: m.extend(value, data)),
               ("crc32c", lambda m, data, value: m.crc32c(data, value)),
               ("awscrt.checksums", lambda m, data, value: m.crc32c(data, value))),
    "crc64nvme": (("awscrt.checksums", lambda m, data, value: m.crc64nvme(data, value)),)}
_CRC_PACKAGES = {"crc32c": "google-crc32c", "crc64nvme": "awscrt"}


def _optional_crc(name: str):
    """update(data, value) -> value for a CRC of _OPTIONAL_CRCS, or None when no module for it is
    installed."""
    for module_name, extend in _OPTIONAL_CRCS[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        return lambda data, value: extend(module, data, value)
    return None


def _digests(path: str, stated: dict) -> dict:
    """{"sha256": hex} of path, with each hash named in stated that we can compute (md5, sha1,
    sha256 hex; crc32, crc32c, crc64nvme int), all in one read of the file."""
    hashers = {"sha256": hashlib.sha256()}
    hashers |= {name: hashlib.new(name, usedforsecurity=False) for name in ("md5", "sha1")
                if name in stated}
    crcs = {"crc32": lambda data, value: zlib.crc32(data, value)} if "crc32" in stated else {}
    for name in _OPTIONAL_CRCS:
        update = _optional_crc(name) if name in stated else None
        if update is not None:
            crcs[name] = update
    values = dict.fromkeys(crcs, 0)
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            for hasher in hashers.values():
                hasher.update(chunk)
            for name, update in crcs.items():
                values[name] = update(chunk, values[name])
    return {name: hasher.hexdigest() for name, hasher in hashers.items()} | values


def _shown(value) -> str:
    return f"{value:08x}" if isinstance(value, int) else str(value)  # a crc as 8 hex digits


def _check_stated(tmp: str, record: dict, digests: dict) -> list[str]:
    """The names of the store's stated hashes tmp matches (sorted); BadFileError on a mismatch.
    One that cannot be computed here (crc32c without its package) is skipped, not counted."""
    matched = []
    for name, want in sorted(record["hashes"].items()):
        if name not in digests:
            logger.info("%s: %s stated by the store not checked (pip install %s)", tmp, name,
                        _CRC_PACKAGES.get(name, "its package"))
            continue
        if digests[name] != want:
            raise BadFileError(f"{name} mismatch",
                               f"{tmp} has {name} {_shown(digests[name])}, the store stated "
                               f"{_shown(want)} for {stores.redact(record['url'])}")
        matched.append(name)
    return matched


def stated_check(path: str) -> str | None:
    """The hashes the server or store stated that path matched when it was installed, e.g.
    "sha256" or "crc32, md5"; None when none was stated (only its size and parquet structure were
    checked: never call it "verified") or path has no readable record."""
    record = _record_or_none(path) or {}
    names = record.get("stated_hashes")
    if not isinstance(names, list):
        names = ["sha256"] if record.get("sha256_stated_by_server") is True else []
    return ", ".join(names) or None


class _DiskFull(OSError):
    """A write of a download found the disk full; `size`: the file's size, as the server stated
    it (None: it did not)."""

    def __init__(self, size: int | None):
        super().__init__(errno.ENOSPC, "no space left on the device")
        self.size = size


def _full_disk(name: str, path: str, stated: int | None) -> OSError:
    """The error for a download that found the disk full (no retry can help): the directory, the
    bytes still needed (a block at least: what is left may be only a record) and those free, and
    the fix. An empty partial file goes; one that holds bytes stays for a rerun to resume."""
    tmp, directory = tmp_path(path), os.path.dirname(os.path.abspath(path))
    have = _size(tmp)
    if not is_int(stated):
        stated = (_record_or_none(tmp) or {}).get("size")
    estimated = "" if is_int(stated) else ", its size estimated (none was stated)"
    stated = stated if is_int(stated) else max(have, SHARD_BYTES_ESTIMATE)
    if have:
        kept = f"{have} bytes kept in {tmp}" + (": a rerun resumes" if _resumable(tmp) else "")
    else:
        _discard(tmp)
        kept = "nothing kept"
    return disk_full(directory, max(stated - have, os.statvfs(directory).f_bsize),
                     f"fetching {name} ({kept}{estimated})", DOWNLOAD_DISK_FIX)


def _download_locked(url: str, path: str, limits: Limits, progress: bool | None, stop, *,
                     streamed: bool) -> None:
    """The retry loop; the caller holds the file's lock, so the temp names are ours alone."""
    name, tmp = os.path.basename(path), tmp_path(path)
    deadline = time.monotonic() + limits.deadline
    attempt = 1  # attempts in a row without progress, this one included
    fetch = _fetch_to_tmp if stores.is_http(url) else _fetch_object_to_tmp
    while True:
        before = _resumable(tmp)
        try:
            record = fetch(url, tmp, limits, deadline, progress, stop)
            _install(tmp, path, record | {"streamed": True} if streamed else record)
            logger.info("downloaded %s (%.1f MB)", name, os.path.getsize(path) / 1e6)
            return
        except _GiveUp as e:
            kept = _resumable(tmp)  # tmp keeps what it holds: the next run resumes it
            raise type(e)(e.reason, f"{name}: {e}; not retrying"
                          + (f" ({kept} bytes kept in {tmp})" if kept else "")) from None
        except _RetryLater as e:
            error, wait = e, e.seconds
        except BadFileError as e:
            _discard(tmp)  # a wrong body cannot be resumed; start over
            error, wait = e, None
        except DownloadError as e:
            error, wait = e, None
        except stores.StoreError:  # (missing credentials: no file of that store can be fetched)
            raise
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # no retry can help
                raise _full_disk(name, path, getattr(e, "size", None)) from None
            # after a redirect, the host that did not resolve is the target's
            failed_url = _failed_url(e, url)
            if (_dns_failure(e)
                    and urllib.parse.urlsplit(failed_url).hostname not in _ANSWERED_HOSTS):
                raise _host_not_found(failed_url, _dns_failure(e)) from None
            error, wait = DownloadError(_reason_of(e), str(e)), None
        # without a validator nothing can be resumed, so nothing counts as progress
        kept = _resumable(tmp)
        progressed = kept - before >= PROGRESS_BYTES
        if attempt >= limits.max_attempts and not progressed:
            in_a_row = "s in a row" if attempt > 1 else ""
            raise DownloadError(error.reason, f"{name}: {error}; gave up after {attempt} "
                                              f"attempt{in_a_row} without progress"
                                + (f" ({kept} bytes kept in {tmp}: a rerun resumes)"
                                   if kept else ""))
        if wait is None:
            # exponential backoff; after progress the link works again, so the shortest wait
            wait = limits.backoff_base * 2 ** (0 if progressed else attempt - 1)
        logger.warning("%s attempt %d/%d: %s; %sretrying in %gs", name, attempt,
                       limits.max_attempts, error,
                       "it made progress, so the count starts again; " if progressed else "", wait)
        if progressed:
            attempt = 0  # the deadline still bounds the whole file
        if time.monotonic() + wait > deadline:  # waiting would end past it: fail now
            raise DownloadError("past the deadline",
                                f"{name}: {error}; no time left before the deadline of "
                                f"{limits.deadline:g}s"
                                + (f" ({kept} bytes kept in {tmp})" if kept else ""))
        if stop.wait(wait):  # the wait ends early when another file stops the run
            raise _Stopped()
        attempt += 1


def download_file(url: str, path: str, limits: Limits | None = None, *,
                  progress: bool | None = None, stop: threading.Event | None = None,
                  streamed: bool = False, recheck: bool = True) -> str | None:
    """Make path a verified copy of the parquet file at url (an http(s) URL or a store's address,
    check_address). Returns None when it was already there and passed check_file; else it was
    fetched, and the return value says what was wrong with the file that was there ("" when there
    was none). Raises DownloadError when it could not be fetched (a bad file that was there stays),
    HostNotFoundError when no file from that host can be, stores.StoreError when the store finds
    no credentials, stores.MissingExtra when the store's package is missing, OtherSourceError when
    path holds a shard from another source. Safe to call from several threads or processes at
    once: one downloads, the others wait and find the file there. streamed: a streaming cache
    fetches it (its record says so: the cache may evict it). recheck: a file there is asked of
    its source (changed_at_source, one request), and fetched anew when it changed there (a
    streaming cache asks at its start instead)."""
    check_address(url)
    _check_not_the_source(url, path)
    check_file_source(url, path)
    limits = Limits() if limits is None else limits
    stop = threading.Event() if stop is None else stop
    record = _record_or_none(path)
    changed = changed_at_source(url, path, limits) if recheck and record is not None else None
    # without the lock first: a sound file waits for nobody (unless its record is to say that its
    # pages were read, or where it came from: records are written under the lock)
    if (changed is None and (record is None or (_pages_vouched(record) and "source" in record))
            and _problem_with(path) is None):
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lock = lock_path(path)
    # a symlink there is an error, never followed
    _open_nofollow(lock, os.O_RDWR | os.O_CREAT, "rb").close()
    with FileLock(lock):
        # another thread or process may have fetched it while we waited
        check_file_source(url, path)  # (as the last holder left it)
        problem = _problem_with(path)
        if problem is None and changed is not None and _record_or_none(path) == record:
            problem = changed  # (unless the last holder fetched it anew)
        if problem is None:
            record = _record_or_none(path)
            if record is not None and not _pages_vouched(record):  # check_file read every page
                _write_json(record_path(path), record | {"pages_checked": True})
            adopt_source(url, path)
            return None
        if problem:
            logger.warning("%s is bad (%s); fetching it again (it stays until the new one is "
                           "verified)", path, problem)
        _download_locked(url, path, limits, progress, stop, streamed=streamed)
    return problem.reason if problem else ""


def _check_not_the_source(url: str, path: str) -> None:
    """A local directory we copy from is never written to: path (with its temp file and lock
    beside it) must be in another directory."""
    if stores.is_http(url) or not stores.is_local(url):
        return
    source = os.path.dirname(os.path.realpath(stores.path_in_store(url)))
    if source == os.path.dirname(os.path.realpath(path)):
        raise ValueError(f"{path} would be written into the directory it is copied from "
                         f"({source}), which is never written to; pass another --data-dir")


def _record_or_none(path: str) -> dict | None:
    """path's record; None when there is none or it cannot be read (check_file says why)."""
    try:
        return _read_json(record_path(path))
    except BadFileError:
        return None


def source_of(address: str) -> str:
    """What a shard's record names as its source: the address without a URL's user:password@, a
    local directory's file by its real path (two spellings of one source are one)."""
    if stores.is_http(address):
        parts = urllib.parse.urlsplit(address)
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    if stores.is_local(address):
        return os.path.realpath(stores.path_in_store(address))
    return address


def _parent(source: str) -> str:
    """The source of a shard's directory: its address less the file's name."""
    return source.rsplit("/", 1)[0]


def recorded_source(path: str) -> str | None:
    """The source path's record names (source_of the address it was fetched from); None when it
    has no readable record, or a record written before sources were recorded."""
    source = (_record_or_none(path) or {}).get("source")
    return source if isinstance(source, str) else None


class OtherSourceError(ValueError):
    """A directory holds shards from another source than the one asked for, or shards whose
    source now states other contents for them: one directory holds one source's shards, so that
    no run reads another dataset's files (or an old version) as the ones it asked for."""


class Stated(NamedTuple):
    """What a source states of one of its files now."""
    sha256: str | None  # the content's sha256, when the source states one (the hub, serve)
    version: str | None  # the validator a download records: ETag or Last-Modified, a store's


# sources that did not answer a question about their files in this process: not asked again
_SILENT: set[str] = set()


def stated_now(address: str, limits: Limits) -> Stated | None:
    """What the source states now of the file at address: one HEAD (redirects followed) or a
    store's stat, bounded by limits.timeout. None when it cannot say (no such file, an error, no
    answer: logged once per source, which is then not asked again in this process)."""
    parent = _parent(source_of(address))
    if parent in _SILENT:
        return None
    try:
        if not stores.is_http(address):
            info = stores.stat(address, limits.timeout)
            return Stated(info.hashes.get("sha256"), info.version)
        response = _head(address, limits.timeout)
        if response is None:
            raise requests.Timeout(f"no whole answer in {limits.timeout:g}s")
    except (requests.RequestException, stores.StoreError, OSError) as e:
        _SILENT.add(parent)
        logger.warning("could not ask %s whether its files changed (%s): the shards on disk from "
                       "it are taken as its files, by their records", stores.redact(parent), e)
        return None
    if response.status_code != 200:  # (gone from the source: the copy here is what it had)
        return None
    return Stated(stated_sha256(response), validator(response))


def same_file(record: dict, stated: Stated) -> bool | None:
    """Whether what a source states now is the file a record describes: by the sha256 when the
    source states one, else by the version it stated at the download; None when neither tells."""
    if stated.sha256 is not None:
        return stated.sha256 == record.get("sha256")
    if stated.version is not None and record.get("source_version") is not None:
        return stated.version == record["source_version"]
    return None


def _on_disk_from_elsewhere(files: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(the address the run asks for at the same name, path, the recorded source) of each shard in
    the directories of files whose record names a source in another directory than the run's."""
    # directory -> the run's address of its shards' directory, and the source that names
    asked = {}
    for address, path in files:
        asked.setdefault(os.path.dirname(os.path.abspath(path)),
                         (_parent(address), _parent(source_of(address))))
    found = []
    for directory, (parent, wanted) in asked.items():
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
            path = os.path.join(directory, name)
            source = recorded_source(path) if name.endswith(".parquet") else None
            if source is not None and _parent(source) != wanted:
                found.append((stores.join(parent, name), path, source))
    return found


def check_sources(files: list[tuple[str, str]], fix: str, limits: Limits | None = None) -> None:
    """One source per directory, at the call: OtherSourceError, in one line naming both sources
    and `fix`, when a directory of files' (address, path) holds a shard whose record names another
    source. Unless the run's source states, for every such shard, the sha256 its record holds (a
    mirror, or the same server on another port): their records then name it, and the run goes on.
    A shard without a recorded source (your own, or fetched before sources were recorded) passes:
    see adopt_source."""
    others = _on_disk_from_elsewhere(files)
    if not others:
        return
    limits = Limits() if limits is None else limits
    with ThreadPoolExecutor(min(16, len(others))) as pool:
        stated = list(pool.map(lambda other: stated_now(other[0], limits), others))
    records = [_record_or_none(path) or {} for _, path, _ in others]
    if all(s is not None and s.sha256 is not None and same_file(r, s)
           for s, r in zip(stated, records)):
        for (address, path, source), now in zip(others, stated):
            with FileLock(lock_path(path)):
                record = _record_or_none(path)
                if record is not None and record.get("source") == source:
                    _write_json(record_path(path), record | {"source": source_of(address),
                                                             "source_version": now.version})
        logger.info("%d shard(s) in %s from %s are the same files at %s (it states their "
                    "sha256): their records name it now", len(others),
                    os.path.dirname(others[0][1]), stores.redact(_parent(others[0][2])),
                    stores.redact(_parent(source_of(others[0][0]))))
        return
    address, path, source = others[0]
    names = ", ".join(os.path.basename(p) for _, p, _ in others[:2])
    raise OtherSourceError(
        f"{os.path.dirname(path)} holds {len(others)} shard(s) fetched from "
        f"{stores.redact(_parent(source))} ({names}{', ...' if len(others) > 2 else ''}), not "
        f"from {stores.redact(_parent(source_of(address)))}, which this run reads from, and that "
        f"does not state the same sha256 for them: one directory holds one source's shards. {fix}")


def check_file_source(address: str, path: str) -> None:
    """check_sources for the one file path, from its record alone (no directory listing, no
    request): OtherSourceError when it names another source than address."""
    source = recorded_source(path)
    if source is not None and source != source_of(address):
        raise OtherSourceError(
            f"{path} was fetched from {stores.redact(source)}, not from "
            f"{stores.redact(source_of(address))}, which this call reads it from: one directory "
            f"holds one source's shards. {SOURCE_FIX}")


def changed_at_source(address: str, path: str, limits: Limits) -> BadFileError | None:
    """BadFileError("changed at its source") when path's record names address's source and the
    source states other contents for it now (one request; none when the record names no version
    and no sha256 is stated); None when it is the same file, or that cannot be told."""
    record = _record_or_none(path)
    if record is None or record.get("source") != source_of(address):
        return None
    stated = stated_now(address, limits)
    if stated is None or same_file(record, stated) is not False:
        return None
    now = f"sha256 {stated.sha256}" if stated.sha256 is not None else f"version {stated.version}"
    return BadFileError("changed at its source",
                        f"{path}: {stores.redact(source_of(address))} now states {now} for it, "
                        "not the file here: it changed at its source")


def check_versions(files: list[tuple[str, str]], fix: str, limits: Limits) -> None:
    """OtherSourceError, in one line with `fix`, when a file of files' (address, path) on disk
    changed at its source (changed_at_source: one request each, 16 at a time)."""
    there = [(address, path) for address, path in files if os.path.exists(path)]
    if not there:
        return
    with ThreadPoolExecutor(min(16, len(there))) as pool:
        changed = [e for e in pool.map(lambda f: changed_at_source(*f, limits), there) if e]
    if changed:
        more = ", ..." if len(changed) > 1 else ""
        raise OtherSourceError(f"{len(changed)} shard(s) on disk changed at their source "
                               f"({changed[0]}{more}). {fix}")


def adopt_source(address: str, path: str) -> None:
    """Write address as the source of a shard whose record names none (installed before sources
    were recorded): from then on it counts only for that source. The caller holds path's lock."""
    record = _record_or_none(path)
    if record is not None and "source" not in record:
        logger.info("%s records no source: taken as from %s, the source that asks for it first",
                    path, stores.redact(source_of(address)))
        _write_json(record_path(path), record | {"source": source_of(address),
                                                 "source_version": None})


def recorded_size(path: str) -> int | None:
    """The size path was verified at when it was installed (its record's); None without a
    readable record."""
    size = (_record_or_none(path) or {}).get("size")
    return size if is_int(size) else None


def _problem_with(path: str) -> BadFileError | str | None:
    """None when path is there and sound; "" when it is missing; else what is wrong with it."""
    if not os.path.exists(path):
        return ""
    try:
        check_file(path)
    except BadFileError as e:
        return e
    return None


# -----------------------------------------------------------------------------
# A file's last bytes: the footer of a shard that is not fetched yet (a streaming loader's catalog)

# one request holds the footer of a ~100MB hosted shard (~20 KB) with room to spare
TAIL_BYTES = 64 * 1024


def fetch_tail(url: str, nbytes: int, limits: Limits | None = None) -> tuple[int, bytes]:
    """(the file's size, its last min(nbytes, size) bytes) by one HTTP Range request (a store: a
    stat and one ranged read), bounded and retried by the rules of a file (limits: attempts,
    backoff, timeout, min_rate, deadline for all attempts together). Raises DownloadError naming
    the URL when it keeps failing or the server ignores Range, HostNotFoundError when the host does
    not resolve (a store: StoreError without credentials, MissingExtra without its package)."""
    attempt = _tail_attempt if stores.is_http(url) else _object_tail_attempt
    return _retried(url, limits, "reading the end of",
                    lambda limits, deadline: attempt(url, nbytes, limits, deadline))


def fetch_small(url: str, max_bytes: int, limits: Limits | None = None) -> bytes | None:
    """A small file whole (a listing), by one GET bounded and retried as fetch_tail's; None when
    the server has no such file (HTTP 404, or 403 and 410, which S3-like stores answer for a
    missing key). Raises DownloadError naming the URL past max_bytes or when it keeps failing.
    HTTP only: a store lists its files (stores.list_names)."""
    if isinstance(url, str) and not stores.is_http(url):
        raise ValueError(f"fetch_small reads http(s) URLs only, not {url!r}: a store's files are "
                         "listed with stores.list_names")
    return _retried(url, limits, "reading",
                    lambda limits, deadline: _small_attempt(url, max_bytes, limits, deadline))


def _retried(url: str, limits: Limits | None, doing: str, attempt_once):
    """attempt_once(limits, deadline), retried by the rules of a file; `doing` names the work in
    the messages ("reading the end of" URL)."""
    check_address(url)
    limits = Limits() if limits is None else limits
    deadline = time.monotonic() + limits.deadline
    shown = url if stores.is_http(url) else stores.redact(url)  # (a store's address: no secret)
    attempt = 1
    while True:
        wait = limits.backoff_base * 2 ** (attempt - 1)
        try:
            return attempt_once(limits, deadline)
        except (_GiveUp, stores.StoreError):  # (StoreError: missing credentials)
            raise
        except _RetryLater as e:
            error, wait = e, e.seconds
        except DownloadError as e:
            error = e
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            if (_dns_failure(e) and urllib.parse.urlsplit(_failed_url(e, url)).hostname
                    not in _ANSWERED_HOSTS):
                raise _host_not_found(_failed_url(e, url), _dns_failure(e)) from None
            error = DownloadError(_reason_of(e), f"{url}: {e}")
        if attempt == limits.max_attempts or time.monotonic() + wait > deadline:
            raise DownloadError(error.reason, f"{error}; gave up {doing} {shown} after "
                                              f"{attempt} attempt{'s' if attempt > 1 else ''}")
        logger.warning("%s %s, attempt %d/%d: %s; retrying in %gs", doing, shown, attempt,
                       limits.max_attempts, error, wait)
        time.sleep(wait)
        attempt += 1


def _bounded_get(url: str, headers: dict, limits: Limits, deadline: float, read):
    """read(response) of one GET, bounded as a download's attempt is: the watchdog at the deadline
    (the wait for headers included), the per-read timeout, the rate over a window."""
    timeout = min(limits.timeout, max(deadline - time.monotonic(), 0.01))
    with _watchdog(deadline) as fired:
        try:
            with _session() as session, session.get(url, headers=headers, stream=True,
                                                    timeout=timeout) as response:
                _ANSWERED_HOSTS.update(urllib.parse.urlsplit(r.url).hostname
                                       for r in [*response.history, response])
                return read(response)
        except Exception:
            if not fired.is_set() and time.monotonic() <= deadline:
                raise
            raise _GiveUp("past the deadline",
                          f"{url}: past the deadline of {limits.deadline:g}s for reading "
                          "it") from None


def _tail_attempt(url: str, nbytes: int, limits: Limits, deadline: float) -> tuple[int, bytes]:
    """One attempt of fetch_tail."""
    def read(response):
        _check_status(response, url)
        if response.status_code != 206:  # a 200 would be the whole file, ~100MB
            raise _GiveUp("no Range support",
                          f"{url}: HTTP {response.status_code} to a Range request; a streaming "
                          "loader reads each shard's footer before fetching the shard, so the "
                          "server must honour Range requests, as the Hugging Face hub does "
                          "(python -m http.server does not). To serve a directory of shards: "
                          "python -m nanochat.dataset serve DIR")
        first, total = _parse_content_range(response.headers.get("Content-Range"))
        return first, total, b"".join(_chunks(response, limits, deadline, threading.Event()))

    # -n: the last n bytes
    headers = {"Range": f"bytes=-{nbytes}", "Accept-Encoding": "identity"}
    first, total, body = _bounded_get(url, headers, limits, deadline, read)
    if total is None or first + len(body) != total:
        raise BadFileError("bad Content-Range", f"{url}: {len(body)} bytes from byte {first} are "
                                                f"not the end of a file of {total} bytes")
    return total, body


def _object_tail_attempt(address: str, nbytes: int, limits: Limits,
                         deadline: float) -> tuple[int, bytes]:
    """One attempt of fetch_tail from a store."""
    size = _stat_object(address, limits, deadline).size
    return size, _read_object(address, max(size - nbytes, 0), size, limits, deadline)


def _small_attempt(url: str, max_bytes: int, limits: Limits, deadline: float) -> bytes | None:
    """One attempt of fetch_small."""
    def read(response):
        if response.status_code in (403, 404, 410):
            return None
        _check_status(response, url)
        body = bytearray()
        for chunk in _chunks(response, limits, deadline, threading.Event()):
            body += chunk
            if len(body) > max_bytes:  # a listing is small: this is not one
                raise _GiveUp("too large", f"{url}: more than {max_bytes} bytes")
        return bytes(body)

    return _bounded_get(url, {"Accept-Encoding": "identity"}, limits, deadline, read)


# -----------------------------------------------------------------------------
# Many files: the disk check, the pool, the summary


def _head(url: str, timeout: float) -> requests.Response | None:
    """A HEAD request (redirects followed), the whole of it within timeout: a server that sends
    its headers a byte at a time too. None when it was cut at the timeout (a cut can end the
    headers early); a failed request raises requests' error."""
    with _watchdog(time.monotonic() + timeout) as fired, _session() as session:
        response = session.head(url, allow_redirects=True, timeout=timeout,
                                headers={"Accept-Encoding": "identity"})
    return None if fired.is_set() else response


def _probe_bytes(url: str, timeout: float) -> int | None:
    """Content-Length of one file from a HEAD request, or None when the server won't say."""
    try:
        response = _head(url, timeout)
    except requests.RequestException as e:
        if _dns_failure(e):
            raise _host_not_found(_failed_url(e, url), _dns_failure(e)) from None
        logger.info("HEAD %s failed (%s); using the per-shard estimate", url, e)
        return None
    if response is None or response.status_code != 200:
        return None
    return _content_length(response)


def _probe_object_bytes(address: str, timeout: float) -> int | None:
    """The size of one object, or None when the store won't say (StoreError without credentials
    and MissingExtra are raised: no file of the store can be fetched)."""
    try:
        return stores.stat(address, timeout).size
    except stores.StoreError as e:
        if e.reason == "no credentials":
            raise
        logger.info("%s; using the per-shard estimate", e)
        return None


def check_disk_space(data_dir: str, num_shards: int, probe_url: str | None = None, *,
                     timeout: float = REQUEST_TIMEOUT) -> None:
    """Raise OSError(ENOSPC) if num_shards more shards would not fit in data_dir.
    Shard size comes from a HEAD of probe_url (a store: its stat; shards of one dataset are within
    a few percent of each other), else SHARD_BYTES_ESTIMATE; 10% headroom is added either way. An
    unresolvable host raises HostNotFoundError here, before any download (a store without
    credentials, StoreError)."""
    if num_shards <= 0:
        return
    probe = _probe_bytes if probe_url and stores.is_http(probe_url) else _probe_object_bytes
    shard_bytes = probe(probe_url, timeout) if probe_url else None
    asked = "from a HEAD request" if stores.is_http(probe_url or "http:") else "from the store"
    source = asked if shard_bytes else "estimated"
    shard_bytes = shard_bytes or SHARD_BYTES_ESTIMATE
    need = int(shard_bytes * num_shards * DISK_MARGIN)
    free = shutil.disk_usage(data_dir).free
    if need > free:
        raise OSError(errno.ENOSPC,
                      f"{num_shards} shards need about {need / 1e9:.2f} GB "
                      f"({shard_bytes / 1e6:.1f} MB each, {source}, +10%) but {data_dir} has "
                      f"{free / 1e9:.2f} GB free; free some space, pass --data-dir on a bigger "
                      "disk, or fetch fewer shards with -n")


@dataclass
class Report:
    """What a run did, by file name."""
    total: int
    # name -> what was wrong with the file that was there
    replaced: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it could not be fetched
    # those of failed that a rerun cannot fetch: the source has no such file, or refuses it
    final: set[str] = field(default_factory=set)


def download_files(files: list[tuple[str, str]], num_workers: int = 4, limits: Limits | None = None,
                   *, progress: bool | None = None, check_disk: bool = True) -> Report:
    """download_file for each (url, path) with num_workers threads (0 or 1: in this thread). Every
    URL (or store address) is checked first; the disk check (when asked) covers the missing files.
    HostNotFoundError stops the run (so do a store's StoreError for missing credentials and
    MissingExtra): the other threads stop at their next read or wait, keeping their partial files,
    and it is raised."""
    check_int("num_workers", num_workers, 0, hint=" (0: download in this thread)")
    for url, _ in files:  # every URL before any download: a typo fails at once, not file by file
        check_address(url)
    limits = Limits() if limits is None else limits
    # and the sources of the directory's shards: nothing is fetched into a mix
    check_sources(files, SOURCE_FIX, limits)
    missing = [(url, path) for url, path in files if not os.path.exists(path)]
    if files:
        logger.info("%d of %d files already in %s (each is checked)", len(files) - len(missing),
                    len(files), os.path.dirname(files[0][1]))
    if missing:
        # the files of one call share a directory: the first one's stands for all
        os.makedirs(os.path.dirname(os.path.abspath(missing[0][1])), exist_ok=True)
        if check_disk:
            check_disk_space(os.path.dirname(os.path.abspath(missing[0][1])), len(missing),
                             missing[0][0], timeout=limits.timeout)
    report = Report(total=len(files))
    stop = threading.Event()

    def fetch(url: str, path: str) -> tuple[str, str | None, DownloadError | None]:
        try:
            return path, download_file(url, path, limits, progress=progress, stop=stop), None
        except DownloadError as e:  # this file failed; the others go on
            logger.error("%s", e)
            return path, None, e
        except _Stopped:
            return path, None, None  # the error that stopped the run is raised by its own thread
        except BaseException:
            stop.set()  # the others stop at their next read or wait
            raise

    def record(path, replaced, error):
        if error is not None:
            report.failed[os.path.basename(path)] = error.reason
            if isinstance(error, _NotThere):
                report.final.add(os.path.basename(path))
        elif replaced:  # "" means the file was missing, nothing was replaced
            report.replaced[os.path.basename(path)] = replaced

    with progress_bar(progress=progress, total=len(files), unit="file", desc="files") as bar:
        if num_workers <= 1:
            for url, path in files:
                record(*fetch(url, path))
                bar.update(1)
        else:
            with ThreadPoolExecutor(max_workers=num_workers) as pool:
                futures = [pool.submit(fetch, url, path) for url, path in files]
                try:
                    for future in as_completed(futures):
                        record(*future.result())
                        bar.update(1)
                except BaseException:  # Ctrl-C included: the threads stop, queued files never start
                    stop.set()
                    pool.shutdown(cancel_futures=True)
                    raise
    return report


def summarize(reasons: dict[str, str], shown: int = 3) -> list[str]:
    """One line per reason, most frequent first: how many files, and the first few names.
    Stays short for thousands of files: `  1000 x HTTP 404: a, b, c and 997 more`."""
    by_reason: dict[str, list[str]] = {}
    for name in sorted(reasons):
        by_reason.setdefault(reasons[name], []).append(name)
    lines = []
    for reason, names in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        lines.append(f"  {len(names)} x {reason}: {', '.join(names[:shown])}{more}")
    return lines
