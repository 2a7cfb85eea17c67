"""
The store transport: one attempt of a file from a store, and its small requests.
A store is S3, GCS, Azure, the hub or a local directory (stores.py, over fsspec). The temp file
fills in ranged reads of STORE_CHUNK_BYTES, resumed while the object's version is unchanged; each
call is bounded by the limits, and a store's errors become the fetch's, by whether a retry helps.

May import: nanochat.data.base.files, nanochat.data.fetch.address, nanochat.data.fetch.errors,
nanochat.data.fetch.install, nanochat.data.fetch.limits, nanochat.data.fetch.records,
nanochat.data.fetch.stores.
"""

import contextlib
import errno
import logging
import os
import time

from nanochat.data.base.files import progress_bar
from nanochat.data.fetch import stores
from nanochat.data.fetch.address import redact
from nanochat.data.fetch.errors import (BadFileError, DiskFull, DownloadError, GiveUp, NotThere,
                                        StoreError)
from nanochat.data.fetch.install import resume_point
from nanochat.data.fetch.limits import Limits, Pace
from nanochat.data.fetch.records import open_nofollow, record_path, write_json

logger = logging.getLogger(__name__)

# A store is read in ranged requests of this many bytes: a ~100MB shard in 12, so a request's
# latency (~20-50 ms to S3) costs little beside its transfer, while a broken request loses at most
# this much (a ranged read returns all of it or nothing) and 4 workers hold 32 MiB in memory.
STORE_CHUNK_BYTES = 8 * 1024**2


# -----------------------------------------------------------------------------
# One attempt of a download: stat, ranged reads in chunks, stat again


def fetch_object_to_tmp(address: str, tmp: str, limits: Limits, deadline: float,
                        progress: bool | None, stop) -> dict:
    """One attempt from a store: bring tmp up to the whole object, resuming when tmp holds a prefix
    of the version the store has now. Returns tmp's record: the version (validator), size and the
    hashes the store states. An object replaced during the attempt: BadFileError (the caller
    discards tmp and starts over), so two versions are never spliced."""
    info = _stat_object(address, limits, deadline)
    have, record = resume_point(tmp)
    if have and (record.get("validator") != info.version or record.get("size") != info.size):
        logger.info("%s: the object changed on the store since %s was started; starting over",
                    redact(address), tmp)
        have = 0
    if not have:
        record = {"url": address, "validator": info.version, "size": info.size,
                  "hashes": info.hashes}
        if info.version is None:
            logger.warning("%s: the store states no version of it, so a broken transfer of it "
                           "cannot be resumed: each attempt starts from byte 0",
                           redact(address))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC)
    pace = Pace(limits, deadline, stop)
    try:
        with open_nofollow(tmp, flags, "ab" if have else "wb") as f, \
                progress_bar(progress=progress, lines=False, total=info.size, initial=have,
                             unit="B", unit_scale=True, desc=os.path.basename(address),
                             leave=False) as bar:
            if not have:  # as for HTTP: the truncation is on disk before the record names it
                os.fsync(f.fileno())
                write_json(record_path(tmp), record)
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
            raise DiskFull(info.size) from e
        raise
    # the ranged reads name no version: one replaced between them would splice two
    after = _stat_object(address, limits, deadline)
    if (after.version, after.size) != (info.version, info.size):
        raise BadFileError("changed on the store",
                           f"{redact(address)} changed on the store during the "
                           f"download of {tmp}")
    return record


# -----------------------------------------------------------------------------
# Small requests: a file's end, a file's size


def object_tail_attempt(address: str, nbytes: int, limits: Limits,
                        deadline: float) -> tuple[int, bytes]:
    """One attempt of fetch_tail from a store."""
    size = _stat_object(address, limits, deadline).size
    return size, _read_object(address, max(size - nbytes, 0), size, limits, deadline)


def probe_object_bytes(address: str, timeout: float) -> int | None:
    """The size of one object, or None when the store won't say (StoreError without credentials
    and MissingExtra are raised: no file of the store can be fetched)."""
    try:
        return stores.stat(address, timeout).size
    except StoreError as e:
        if e.reason == "no credentials":
            raise
        logger.info("%s; using the per-shard estimate", e)
        return None


# -----------------------------------------------------------------------------
# One store call: bounded in time, its errors made ours


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
                           f"{redact(address)}: asked for bytes {start}-{end}, got "
                           f"{len(body)}: it changed on the store")
    return body


def _call_bound(limits: Limits, deadline: float, nbytes: int) -> float:
    """Seconds one store call may take: limits.timeout, plus what a transfer of nbytes at exactly
    min_rate needs (no rate floor: no bound but the deadline), never past the deadline."""
    need = limits.timeout + (nbytes / limits.min_rate if limits.min_rate > 0 else float("inf"))
    return max(min(need, deadline - time.monotonic()), 0.01)


@contextlib.contextmanager
def _store_errors(limits: Limits, deadline: float):
    """Within the block, a store's error becomes ours: one a retry cannot help (not found, access
    denied) gives up at once, the others (slow down, timed out, connection failed) go to the
    backoff. Missing credentials stop the run (the StoreError itself, an OSError): no file of that
    store can be fetched. A missing extra (MissingExtra) passes unchanged."""
    try:
        yield
    except StoreError as e:
        if e.reason == "no credentials":
            raise
        if time.monotonic() >= deadline:  # the call was cut at the deadline
            raise GiveUp("past the deadline", f"{e}; past the deadline of {limits.deadline:g}s "
                                              "for one file") from None
        if not e.retry:
            raise NotThere(e.reason, str(e)) from None
        raise DownloadError(e.reason, str(e)) from None
