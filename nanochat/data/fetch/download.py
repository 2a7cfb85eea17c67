"""
Fetch parquet files so that only complete, verified files appear under their final names.
download_file fetches one (under a per-file lock, retried with backoff, a file there checked first);
download_files fetches many (threads, the disk check, a Report); summarize words the failures.
Transports: http_transport.py, store_transport.py; checks: verify.py; records: records.py.
Design: docs/downloads.md

Imported only when needed: nanochat.data.fetch.store_transport (a store's file; fsspec with it).

May import: nanochat.data.base.checks, nanochat.data.base.files, nanochat.data.fetch.address,
nanochat.data.fetch.errors, nanochat.data.fetch.http_transport, nanochat.data.fetch.install,
nanochat.data.fetch.limits, nanochat.data.fetch.records, nanochat.data.fetch.sources,
nanochat.data.fetch.store_transport, nanochat.data.fetch.verify, requests, urllib3, filelock.
"""

import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import requests
import urllib3
from filelock import FileLock

from nanochat.data.base.checks import check_int, is_int
from nanochat.data.base.files import disk_full, progress_bar
from nanochat.data.fetch.address import check_address, is_http, is_local, path_in_store
from nanochat.data.fetch.errors import (BadFileError, DownloadError, GiveUp, NotThere, RetryLater,
                                        Stopped, StoreError, reason_of, unresolved_host)
from nanochat.data.fetch.http_transport import fetch_to_tmp, probe_bytes
from nanochat.data.fetch.install import install
from nanochat.data.fetch.limits import REQUEST_TIMEOUT, Limits
from nanochat.data.fetch.records import (discard, lock_path, open_nofollow, record_or_none,
                                         record_path, resumable, size_on_disk, tmp_path,
                                         write_json)
from nanochat.data.fetch.sources import (SOURCE_FIX, adopt_source, changed_at_source,
                                         check_file_source, check_sources)
from nanochat.data.fetch.verify import pages_vouched, problem_with

logger = logging.getLogger(__name__)

# An attempt that stored at least this many bytes made progress: the attempt count starts again. A
# link that drops every 200 KB then still completes, one that delivers a few bytes per attempt does
# not.
PROGRESS_BYTES = 64 * 1024

# Used for the disk check when the server gives no Content-Length: FineWeb-Edu and ClimbMix shards
# are ~90-100MB (zstd), so 100MB errs on the side of asking for too much.
SHARD_BYTES_ESTIMATE = 100 * 1024**2
DISK_MARGIN = 1.1  # shards differ in size by a few percent; keep 10% headroom over the estimate
# what a full disk under a download asks of its user
DOWNLOAD_DISK_FIX = ("free some space, pass --data-dir on a bigger disk, or fetch fewer shards "
                     "(-n); a streaming loader: pass a smaller cache_limit")


# -----------------------------------------------------------------------------
# One file: a verified copy under its name, fetched only when what is there is not sound


def download_file(url: str, path: str, limits: Limits | None = None, *,
                  progress: bool | None = None, stop: threading.Event | None = None,
                  streamed: bool = False, recheck: bool = True) -> str | None:
    """Make path a verified copy of the parquet file at url (an http(s) URL or a store's address,
    check_address). Returns None when it was already there and passed check_file; else it was
    fetched, and the return value says what was wrong with the file that was there ("" when there
    was none). Raises DownloadError when it could not be fetched (a bad file that was there stays),
    HostNotFoundError when no file from that host can be, StoreError when the store finds
    no credentials, MissingExtra when the store's package is missing, OtherSourceError when
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
    record = record_or_none(path)
    changed = changed_at_source(url, path, limits) if recheck and record is not None else None
    # without the lock first: a sound file waits for nobody (unless its record is to say that its
    # pages were read, or where it came from: records are written under the lock)
    if (changed is None and (record is None or (pages_vouched(record) and "source" in record))
            and problem_with(path) is None):
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lock = lock_path(path)
    # a symlink there is an error, never followed
    open_nofollow(lock, os.O_RDWR | os.O_CREAT, "rb").close()
    with FileLock(lock):
        # another thread or process may have fetched it while we waited
        check_file_source(url, path)  # (as the last holder left it)
        problem = problem_with(path)
        if problem is None and changed is not None and record_or_none(path) == record:
            problem = changed  # (unless the last holder fetched it anew)
        if problem is None:
            record = record_or_none(path)
            if record is not None and not pages_vouched(record):  # check_file read every page
                write_json(record_path(path), record | {"pages_checked": True})
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
    if is_http(url) or not is_local(url):
        return
    source = os.path.dirname(os.path.realpath(path_in_store(url)))
    if source == os.path.dirname(os.path.realpath(path)):
        raise ValueError(f"{path} would be written into the directory it is copied from "
                         f"({source}), which is never written to; pass another --data-dir")


def _download_locked(url: str, path: str, limits: Limits, progress: bool | None, stop, *,
                     streamed: bool) -> None:
    """The retry loop; the caller holds the file's lock, so the temp names are ours alone."""
    name, tmp = os.path.basename(path), tmp_path(path)
    deadline = time.monotonic() + limits.deadline
    attempt = 1  # attempts in a row without progress, this one included
    if is_http(url):
        fetch = fetch_to_tmp
    else:  # (late: a loader that never reads a store never loads its transport)
        from nanochat.data.fetch.store_transport import fetch_object_to_tmp as fetch
    while True:
        before = resumable(tmp)
        try:
            record = fetch(url, tmp, limits, deadline, progress, stop)
            install(tmp, path, record | {"streamed": True} if streamed else record)
            logger.info("downloaded %s (%.1f MB)", name, os.path.getsize(path) / 1e6)
            return
        except GiveUp as e:
            kept = resumable(tmp)  # tmp keeps what it holds: the next run resumes it
            raise type(e)(e.reason, f"{name}: {e}; not retrying"
                          + (f" ({kept} bytes kept in {tmp})" if kept else "")) from None
        except StoreError:  # (missing credentials: no file of that store can be fetched)
            raise
        except (DownloadError, requests.RequestException, urllib3.exceptions.HTTPError,
                OSError) as e:
            error, wait = _retryable(e, url, path)
        # without a validator nothing can be resumed, so nothing counts as progress
        kept = resumable(tmp)
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
            raise Stopped()
        attempt += 1


def _retryable(error: Exception, url: str, path: str) -> tuple[DownloadError, float | None]:
    """The error of a failed attempt that a retry may heal, and the wait it asks for (None: the
    backoff's). Raises what no retry can heal: a full disk, a host that does not resolve."""
    if isinstance(error, RetryLater):
        return error, error.seconds
    if isinstance(error, BadFileError):
        discard(tmp_path(path))  # a wrong body cannot be resumed; start over
        return error, None
    if isinstance(error, DownloadError):
        return error, None
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # no retry can help
        raise _full_disk(os.path.basename(path), path, getattr(error, "size", None)) from None
    host = unresolved_host(error, url)  # (after a redirect, the target's host)
    if host is not None:
        raise host from None
    return DownloadError(reason_of(error), str(error)), None


def _full_disk(name: str, path: str, stated: int | None) -> OSError:
    """The error for a download that found the disk full (no retry can help): the directory, the
    bytes still needed (a block at least: what is left may be only a record) and those free, and
    the fix. An empty partial file goes; one that holds bytes stays for a rerun to resume."""
    tmp, directory = tmp_path(path), os.path.dirname(os.path.abspath(path))
    have = size_on_disk(tmp)
    if not is_int(stated):
        stated = (record_or_none(tmp) or {}).get("size")
    estimated = "" if is_int(stated) else ", its size estimated (none was stated)"
    stated = stated if is_int(stated) else max(have, SHARD_BYTES_ESTIMATE)
    if have:
        kept = f"{have} bytes kept in {tmp}" + (": a rerun resumes" if resumable(tmp) else "")
    else:
        discard(tmp)
        kept = "nothing kept"
    return disk_full(directory, max(stated - have, os.statvfs(directory).f_bsize),
                     f"fetching {name} ({kept}{estimated})", DOWNLOAD_DISK_FIX)


# -----------------------------------------------------------------------------
# Many files: the disk check, the pool, the report and its summary


@dataclass
class Report:
    """What a run did, by file name."""
    total: int
    # name -> what was wrong with the file that was there
    replaced: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it could not be fetched
    # those of failed that a rerun cannot fetch: the source has no such file, or refuses it
    final: set[str] = field(default_factory=set)

    def note(self, path: str, replaced: str | None, error: DownloadError | None) -> None:
        """What became of one file: fetched (replacing what was wrong, or nothing), or failed."""
        if error is not None:
            self.failed[os.path.basename(path)] = error.reason
            if isinstance(error, NotThere):
                self.final.add(os.path.basename(path))
        elif replaced:  # "" means the file was missing, nothing was replaced
            self.replaced[os.path.basename(path)] = replaced


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
    _prepare_directory(files, limits, check_disk)
    report, stop = Report(total=len(files)), threading.Event()

    def fetch(url: str, path: str) -> tuple[str, str | None, DownloadError | None]:
        return _fetch_one(url, path, limits, progress, stop)

    with progress_bar(progress=progress, total=len(files), unit="file", desc="files") as bar:
        def done(path: str, replaced: str | None, error: DownloadError | None) -> None:
            report.note(path, replaced, error)
            bar.update(1)

        _run(files, num_workers, fetch, done, stop)
    return report


def _prepare_directory(files: list[tuple[str, str]], limits: Limits, check_disk: bool) -> None:
    """Say how many files are there already; make the directory and, when asked, check that the
    missing ones fit."""
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


def _fetch_one(url: str, path: str, limits: Limits, progress: bool | None,
               stop: threading.Event) -> tuple[str, str | None, DownloadError | None]:
    """(path, what download_file returned, the DownloadError it raised): a file that fails lets the
    others go on; any other error sets stop and is raised."""
    if stop.is_set():  # the run is stopping: a file not yet started never starts
        return path, None, None
    try:
        return path, download_file(url, path, limits, progress=progress, stop=stop), None
    except DownloadError as e:  # this file failed; the others go on
        logger.error("%s", e)
        return path, None, e
    except Stopped:
        return path, None, None  # the error that stopped the run is raised by its own thread
    except BaseException:
        stop.set()  # the others stop at their next read or wait
        raise


def _run(files: list[tuple[str, str]], num_workers: int, fetch, done, stop) -> None:
    """done(*fetch(url, path)) for each file, in this thread (num_workers 0 or 1) or a pool."""
    if num_workers <= 1:
        for url, path in files:
            done(*fetch(url, path))
        return
    # The pool is driven from a thread of its own, and this thread only waits for it: Ctrl-C raises
    # here alone, so it never lands inside a lock the workers share (tqdm's, while done() draws the
    # bar), which would stay held and leave the workers, and the wait for them, stuck for good.
    raised: list[BaseException] = []
    finished = threading.Event()

    def drive() -> None:
        try:
            _drive(files, num_workers, fetch, done, stop)
        except BaseException as e:  # raised in this thread, below
            raised.append(e)
        finally:
            finished.set()

    threading.Thread(target=drive, name="download-driver").start()
    try:
        _wait_for(finished)
    except BaseException:  # Ctrl-C: the workers stop at their next read or wait
        stop.set()
        _wait_for(finished)
        raise
    if raised:
        raise raised[0]


def _wait_for(finished: threading.Event) -> None:
    """Sleep until finished is set, holding no lock: not Event.wait (a Condition's lock), nor
    Thread.join (Python 3.11: one that Ctrl-C interrupted returns at once from then on)."""
    while not finished.is_set():
        time.sleep(0.05)


def _drive(files: list[tuple[str, str]], num_workers: int, fetch, done, stop) -> None:
    """_run's pool. Once stop is set (a file's error, or Ctrl-C), files not yet started never
    start; the error of a file that stopped the run is raised."""
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        futures = [pool.submit(fetch, url, path) for url, path in files]
        try:
            for future in as_completed(futures):
                done(*future.result())  # a file's error that stops the run raises here
                if stop.is_set():  # Ctrl-C, or an error whose file is still to come
                    break
        except BaseException:
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
        # files not yet started never start (out of the loop: as_completed would wait for them)
        pool.shutdown(cancel_futures=True)
    for future in futures:  # the error of a file that came after the break
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()


def check_disk_space(data_dir: str, num_shards: int, probe_url: str | None = None, *,
                     timeout: float = REQUEST_TIMEOUT) -> None:
    """Raise OSError(ENOSPC) if num_shards more shards would not fit in data_dir.
    Shard size comes from a HEAD of probe_url (a store: its stat; shards of one dataset are within
    a few percent of each other), else SHARD_BYTES_ESTIMATE; 10% headroom is added either way. An
    unresolvable host raises HostNotFoundError here, before any download (a store without
    credentials, StoreError)."""
    if num_shards <= 0:
        return
    if probe_url and is_http(probe_url):
        probe = probe_bytes
    else:  # (late, as in _download_locked)
        from nanochat.data.fetch.store_transport import probe_object_bytes as probe
    shard_bytes = probe(probe_url, timeout) if probe_url else None
    asked = "from a HEAD request" if is_http(probe_url or "http:") else "from the store"
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
