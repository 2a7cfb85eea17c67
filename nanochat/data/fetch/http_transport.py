"""
The HTTP transport: one attempt of a file over HTTP(S), and its small requests.
A GET into the temp file (resumed with Range and If-Range), the reads of a file's end and of a
listing, HEAD, and what a response states (status, size, version, sha256). Every request ends by
its deadline: a watchdog timer shuts its socket, the wait for headers included, which requests'
per-read timeout cannot do. docs/downloads.md says what fsspec's HTTP filesystem lacks for this.

May import: nanochat.data.base.files, nanochat.data.fetch.errors, nanochat.data.fetch.install,
nanochat.data.fetch.limits, nanochat.data.fetch.records, requests, urllib3.
"""

import contextlib
import errno
import logging
import os
import re
import socket
import threading
import time

import requests
import urllib3

from nanochat.data.base.files import progress_bar
from nanochat.data.fetch.errors import (BadFileError, DiskFull, DownloadError, GiveUp, NotThere,
                                        RetryLater, Stopped, note_answered, unresolved_host)
from nanochat.data.fetch.install import resume_point
from nanochat.data.fetch.limits import Limits, Pace
from nanochat.data.fetch.records import open_nofollow, record_path, size_on_disk, write_json

logger = logging.getLogger(__name__)

CHUNK_SIZE = 64 * 1024  # the most one read returns; a read returns as soon as any bytes arrive


RETRY_AFTER_CAP = 60.0  # a server asking for longer than this gets this


# -----------------------------------------------------------------------------
# One attempt of a download: a GET (resumed with Range and If-Range), the body into the temp file


def fetch_to_tmp(url: str, tmp: str, limits: Limits, deadline: float, progress: bool | None,
                 stop) -> dict:
    """One attempt: bring tmp up to the whole file, resuming when it holds a prefix of the same
    version. Returns its record: the validator, and the size and sha256 the server stated (None
    when it did not)."""
    have, record = resume_point(tmp)
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
            if not fired.is_set() or isinstance(e, Stopped):
                raise
            record = None  # the watchdog cut the connection: the deadline is the reason
    # a cut can also end headers early (a 200 with no body); a transfer that completed as the timer
    # fired stands
    if fired.is_set() and not (record and record["size"] is not None
                               and size_on_disk(tmp) == record["size"]):
        raise GiveUp("past the deadline",
                     f"past the deadline of {limits.deadline:g}s for one file")
    return record


def _attempt(session: requests.Session, url: str, tmp: str, have: int, record: dict | None,
             headers: dict, *, timeout: float, limits: Limits, deadline: float,
             progress: bool | None, stop) -> dict:
    """The request and the body of one attempt (see fetch_to_tmp)."""
    with session.get(url, headers=headers, stream=True, timeout=timeout) as response:
        note_answered(response)  # a later failed lookup of one of its hosts is a hiccup
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
            with open_nofollow(tmp, flags, "ab" if append else "wb") as f, \
                    progress_bar(progress=progress, lines=False,  # (the files bar's lines say it)
                                 total=record["size"], initial=have if append else 0, unit="B",
                                 unit_scale=True, desc=os.path.basename(url), leave=False) as bar:
                if not append:
                    # the truncation is on disk before the record names the new version: a crash
                    # never leaves old bytes under a new validator
                    os.fsync(f.fileno())
                    write_json(record_path(tmp), record)
                for chunk in _chunks(response, limits, deadline, stop):
                    f.write(chunk)
                    bar.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # (the size stated, for the message)
                raise DiskFull(record["size"]) from e
            raise
    return record


def _chunks(response: requests.Response, limits: Limits, deadline: float, stop):
    """The body as it arrives; raises when the rate over a window falls below limits.min_rate, past
    the deadline, or when the run stops (Pace). read1 returns whatever has arrived, so a
    trickling server is noticed within one window."""
    pace = Pace(limits, deadline, stop)
    while chunk := response.raw.read1(CHUNK_SIZE):
        yield chunk  # the caller keeps it before a check below ends the attempt
        pace.check(len(chunk))


# -----------------------------------------------------------------------------
# Small requests: a file's end, a small file, a HEAD; each bounded as an attempt is


def tail_attempt(url: str, nbytes: int, limits: Limits, deadline: float) -> tuple[int, bytes]:
    """One attempt of fetch_tail."""
    def read(response):
        _check_status(response, url)
        if response.status_code != 206:  # a 200 would be the whole file, ~100MB
            raise GiveUp("no Range support",
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


def small_attempt(url: str, max_bytes: int, limits: Limits, deadline: float) -> bytes | None:
    """One attempt of fetch_small."""
    def read(response):
        if response.status_code in (403, 404, 410):
            return None
        _check_status(response, url)
        body = bytearray()
        for chunk in _chunks(response, limits, deadline, threading.Event()):
            body += chunk
            if len(body) > max_bytes:  # a listing is small: this is not one
                raise GiveUp("too large", f"{url}: more than {max_bytes} bytes")
        return bytes(body)

    return _bounded_get(url, {"Accept-Encoding": "identity"}, limits, deadline, read)


def _bounded_get(url: str, headers: dict, limits: Limits, deadline: float, read):
    """read(response) of one GET, bounded as a download's attempt is: the watchdog at the deadline
    (the wait for headers included), the per-read timeout, the rate over a window."""
    timeout = min(limits.timeout, max(deadline - time.monotonic(), 0.01))
    with _watchdog(deadline) as fired:
        try:
            with _session() as session, session.get(url, headers=headers, stream=True,
                                                    timeout=timeout) as response:
                note_answered(response)
                return read(response)
        except Exception:
            if not fired.is_set() and time.monotonic() <= deadline:
                raise
            raise GiveUp("past the deadline",
                         f"{url}: past the deadline of {limits.deadline:g}s for reading "
                         "it") from None


def head(url: str, timeout: float) -> requests.Response | None:
    """A HEAD request (redirects followed), the whole of it within timeout: a server that sends
    its headers a byte at a time too. None when it was cut at the timeout (a cut can end the
    headers early); a failed request raises requests' error."""
    with _watchdog(time.monotonic() + timeout) as fired, _session() as session:
        response = session.head(url, allow_redirects=True, timeout=timeout,
                                headers={"Accept-Encoding": "identity"})
    return None if fired.is_set() else response


def probe_bytes(url: str, timeout: float) -> int | None:
    """Content-Length of one file from a HEAD request, or None when the server won't say."""
    try:
        response = head(url, timeout)
    except requests.RequestException as e:
        host = unresolved_host(e, url, even_if_answered=True)
        if host is not None:
            raise host from None
        logger.info("HEAD %s failed (%s); using the per-shard estimate", url, e)
        return None
    if response is None or response.status_code != 200:
        return None
    return _content_length(response)


# -----------------------------------------------------------------------------
# The watchdog: a timer that shuts an attempt's socket at the deadline


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


def _cut(thread: int) -> None:
    sock = _SOCKETS.get(thread)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once; the attempt fails
        except OSError:
            pass  # already closed


# -----------------------------------------------------------------------------
# What the server says: status, sizes, validators, sha256


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
            raise RetryLater(f"HTTP {code}", f"{url}: HTTP {code}, Retry-After {seconds:g}s",
                             seconds)
    if code == 404:
        raise NotThere("HTTP 404", f"{url}: HTTP 404, not on the server; check the URL "
                                   "(--base-url, NANOCHAT_DATA_URL) and that the dataset has "
                                   "this file")
    # other client errors will not change on a retry; 408 (timeout) and 429 (busy) may
    if 400 <= code < 500 and code not in (408, 429):
        raise NotThere(f"HTTP {code}", f"{url}: HTTP {code}")
    raise DownloadError(f"HTTP {code}", f"{url}: HTTP {code}")


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
