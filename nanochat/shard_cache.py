"""
Shards fetched just ahead of the reader (a loader's stream=True): training starts once the first shard is on
disk, not after all of them, and the data directory stays within a disk budget (cache_limit).

    catalog = read_catalog(data_dir, names, urls, limits)   # name -> (size, documents per row group)
    cache = ShardCache(data_dir, names, urls, sizes, prefetch_shards=2, cache_limit=20e9, limits=limits)
    cache.start(order)     # order: the shards the reader will read, in order (Stream.file_order)
    cache.need(pq_idx)     # its path, once it is on disk: waits, bounded
    cache.hold(keys)       # the documents a state just yielded still buffers
    cache.close()

The catalog. A stream needs each shard's row-group counts (its index) and size (the state's fingerprint of
the files) before it reads the shard. Both come from the shard's end, one HTTP Range request each, and are
kept in data_dir/.stream/catalog.json, so a restart reads nothing over the network for them.

Fetching. One background thread per loader fetches, through nanochat.download (the retries, time bounds,
verification and per-file lock of the CLI), the shard the reader needs now, then the next prefetch_shards
of its order. Every local rank reads the same shards in the same order (each its own row groups), so the
per-file lock makes one of them download a shard and the others find it there: once per machine. A shard
that arrives is checked against its catalog entry.

The budget. Before a download, shards are evicted until the data directory's shards, with every download
in flight counted whole, fit in cache_limit. Only complete shards a streaming loader fetched (listed in
.stream/fetched.json) are evicted, never the val shard, and never one that a loader of this machine reads,
waits for or has just been handed: each records them in .stream/needs-<host>-<pid>-<n>.json, with the next
prefetch_shards of its order (its plan's, after an elastic resume) and the shards its recent states' buffers
refer to. Those go after the shards no loader needs (a long document can stay buffered for many shards; a
resume from such a state fetches them again, first), and the shards fetched ahead go last, only for a shard
a reader waits for. A record whose process is gone is ignored. A budget below what must be held at once is a
ValueError at the start.

May import: nanochat.dataset, nanochat.download, nanochat.files, pyarrow, filelock, tqdm.
"""

import errno
import itertools
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock
from tqdm import tqdm

from nanochat.dataset import open_parquet, streamed_split
from nanochat.download import MAGIC, TAIL_BYTES, DownloadError, Limits, download_file, fetch_tail, record_path
from nanochat.files import remove_if_exists

logger = logging.getLogger("nanochat.dataloader.shard_cache")

STREAM_DIR = ".stream"  # in the data directory: the catalog, the fetched list, each loader's needs
LOOKAHEAD = 64  # distinct shards of the order searched for the one the reader asks for
HELD_STATES = 8  # recent states whose buffers' shards are evicted last (a DataLoader yields a few behind its packer)
NEED_MARGIN = 120.0  # seconds need() waits past the downloader's deadline (another rank's download, room)
ROOM_WAIT = 600.0  # seconds the shard the reader waits for may find no room before that is an error
def _gb(nbytes: float) -> str:
    """A size in words: 20.00 GB, 95.3 MB, 8.6 KB."""
    for unit, scale, digits in (("GB", 1e9, 2), ("MB", 1e6, 1), ("KB", 1e3, 1)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} bytes"


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _read_json(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        logger.warning("%s is unreadable (%s); starting it afresh", path, e)
        return default


# -----------------------------------------------------------------------------
# The catalog: sizes and row-group counts before the shards are fetched


def footer_rows(tail: bytes, url: str) -> list[int] | None:
    """Documents per row group from a parquet file's last bytes; None when they do not hold the whole footer."""
    if len(tail) < 12 or tail[-4:] != MAGIC:
        raise ValueError(f"{url} does not end with {MAGIC!r}: not a parquet file")
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 8 > len(tail):
        return None
    try:
        meta = pq.read_metadata(pa.BufferReader(MAGIC + tail[-(length + 8):]))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{url}: its parquet footer cannot be read ({e})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _entry(path: str, url: str, limits: Limits) -> dict:
    """One shard's catalog entry: from the file when it is on disk (complete: only verified files have final
    names), else from its footer on the server."""
    if os.path.exists(path):
        meta = open_parquet(path).metadata
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        return {"url": url, "size": os.path.getsize(path), "rows": rows}
    size, tail = fetch_tail(url, TAIL_BYTES, limits)
    rows = footer_rows(tail, url)
    if rows is None:  # a footer longer than one request: ask for exactly it
        size, tail = fetch_tail(url, int.from_bytes(tail[-8:-4], "little") + 8, limits)
        rows = footer_rows(tail, url)
    return {"url": url, "size": size, "rows": rows}


def read_catalog(data_dir: str, names: list[str], urls: list[str], limits: Limits, workers: int = 16) -> list[dict]:
    """The catalog entries {"url", "size", "rows"} of the given shards, in order: from .stream/catalog.json, or
    read (16 requests at a time, once: later starts read the file) and added to it. Raises ConnectionError
    naming the shard and URL when a footer cannot be fetched."""
    directory = os.path.join(data_dir, STREAM_DIR)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "catalog.json")
    known = _read_json(path, {})
    missing = [(name, url) for name, url in zip(names, urls) if known.get(name, {}).get("url") != url]
    if missing:
        logger.info("reading the footers of %d shards from %s (kept in %s)", len(missing),
                    missing[0][1].rsplit("/", 1)[0], path)

        def one(item):
            name, url = item
            try:
                return name, _entry(os.path.join(data_dir, name), url, limits)
            except DownloadError as e:
                raise ConnectionError(f"could not read the footer of shard {name} from {url}: {e}") from None

        with ThreadPoolExecutor(max(1, min(workers, len(missing)))) as pool:
            found = dict(tqdm(pool.map(one, missing), total=len(missing), unit="footer", desc="catalog",
                              disable=None, leave=False))  # (a bar on a terminal only)
        with FileLock(os.path.join(directory, "lock")):
            known = _read_json(path, {}) | found
            _write_json(path, known)
    return [known[name] for name in names]


def streamed_files(split: str, data_dir: str | None, num_shards: int | None, base_url: str | None,
                   limits: Limits) -> tuple[str, list[str], list[str], dict[str, int], list[dict]]:
    """A streamed split (nanochat.dataset.streamed_split) with its catalog entries:
    (data_dir, paths, URLs, {the val shard's name: its size}, catalog entries)."""
    data_dir, paths, urls, val_name = streamed_split(split, data_dir, num_shards, base_url)
    _, _, val_urls, _ = streamed_split("val", data_dir, num_shards, base_url)
    names = [os.path.basename(p) for p in paths]
    entries = read_catalog(data_dir, list(dict.fromkeys(names + [val_name])), list(dict.fromkeys(urls + val_urls)),
                           limits)
    return data_dir, paths, urls, {val_name: entries[-1]["size"]}, entries[:len(names)]


# -----------------------------------------------------------------------------
# The cache


class ShardCache:
    """Fetches one split's shards just ahead of its reader, within a budget (see the module docstring)."""

    _count = itertools.count()

    def __init__(self, data_dir: str, names: list[str], urls: list[str], sizes: list[int], *, prefetch_shards: int,
                 cache_limit: int | None, limits: Limits, keep: dict[str, int] | None = None):
        self.data_dir, self.names, self.urls, self.sizes = data_dir, names, urls, sizes
        self.prefetch_shards, self.limit, self.limits = prefetch_shards, cache_limit, limits
        self.keep = dict(keep or {})  # name -> size: never evicted (the val shard)
        self.directory = os.path.join(data_dir, STREAM_DIR)
        self.lock_file = FileLock(os.path.join(self.directory, "lock"))
        self.me = f"needs-{socket.gethostname()}-{os.getpid()}-{next(self._count)}.json"
        self._cond = threading.Condition()
        self._order = iter(())
        self._current: int | None = None
        self._ahead: list[int] = []  # the next visits of the order after the current one (pq_idx)
        self._ready: set[int] = set()
        self._waiting: dict[int, int] = {}  # pq_idx -> readers waiting for it (the packing thread restores a buffer
        # while the reading thread starts the stream: two readers)
        self._first_seen: dict[int, int] = {}  # pq_idx -> where the order first names it (what waits goes in order)
        self._seen = 0
        self._first: list[int] = []  # shards to fetch before anything else, each until it is first read
        self._just_read: dict[int, int] = {}  # reading thread -> the shard need() last returned to it: it is opening it
        self._failed: dict[int, tuple[BaseException, bool]] = {}  # pq_idx -> (error, whether the reader waited)
        self._held: deque = deque(maxlen=HELD_STATES)
        self._fetching: str | None = None
        self._published = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.room_wait = ROOM_WAIT
        self._short_since: float | None = None
        self.fetched_bytes = 0  # what this cache downloaded (for the benchmark)
        self.peak_bytes = 0  # the most the data directory's shards took at once, as this cache measured it
        self._check_budget()

    # -- the budget ------------------------------------------------------------------

    def _shard_files(self, partial: bool = True) -> dict[str, int]:
        """name -> bytes of every shard in the data directory, partial downloads (.tmp) under the shard's name
        (unless partial=False: complete shards only)."""
        sizes: dict[str, int] = {}
        with os.scandir(self.data_dir) as entries:
            for entry in entries:
                if entry.name.endswith(".parquet") or (partial and entry.name.endswith(".parquet.tmp")):
                    try:
                        size = entry.stat().st_size
                    except FileNotFoundError:
                        continue
                    name = entry.name.removesuffix(".tmp")
                    sizes[name] = sizes.get(name, 0) + size
        return sizes

    def _check_budget(self) -> None:
        if self.limit is None:
            return
        fetched = set(_read_json(os.path.join(self.directory, "fetched.json"), []))
        # (a partial download is not fixed: it becomes a fetched shard, or this loader resumes it)
        on_disk = self._shard_files(partial=False)
        fixed = {name: size for name, size in on_disk.items() if name not in fetched or name in self.keep}
        largest = max(self.sizes)
        # the shard read now, prefetch_shards ahead and one for a local rank out of step (a split has no more), and
        # the val shard when a val loader (an eval during training) has yet to fetch it
        count = min(self.prefetch_shards + 2, len(self.names))
        later = sum(size for name, size in self.keep.items() if name not in on_disk and name not in self.names)
        least = sum(fixed.values()) + count * largest + later
        val = f" and the val shard ({_gb(later)})" if later else ""
        if self.limit < least:
            raise ValueError(
                f"cache_limit={_gb(self.limit)} is below what this streaming loader must hold at once, {_gb(least)}: "
                f"{count} x {_gb(largest)} (the largest shard) for the shard it reads, prefetch_shards="
                f"{self.prefetch_shards} ahead, one for a local rank out of step{val}, plus "
                f"{_gb(sum(fixed.values()))} of shards in {self.data_dir} that it may not evict ({len(fixed)}: the val "
                "shard and those it did not fetch); raise cache_limit, lower prefetch_shards, or use another data_dir")

    def _records(self) -> list[dict]:
        """The needs of every live loader of this machine (self included), dropping those of gone processes."""
        records = []
        host = socket.gethostname()
        for name in os.listdir(self.directory):
            if not (name.startswith("needs-") and name.endswith(".json")):
                continue
            record = _read_json(os.path.join(self.directory, name), None)
            if not isinstance(record, dict):
                continue
            if record.get("host") == host and not _alive(record.get("pid")):
                remove_if_exists(os.path.join(self.directory, name))
                continue
            records.append(record)
        return records

    def _make_room(self, name: str, now: bool) -> bool:
        """Evict until `name` fits (under the directory lock); False when it cannot yet. Never a shard a loader
        reads or waits for. Shards no loader reads or buffers go first, oldest first; then those a recent state's
        buffer still refers to (a resume from that state fetches them again, first): a long document can stay
        buffered for many shards, and holding every shard it came from would leave no room to fetch ahead; and
        for a shard a reader waits for (now), last, the shards loaders fetched ahead (local ranks can drift a
        few shards apart, and the reader that waits must not wait on another's read-ahead)."""
        fetched_path = os.path.join(self.directory, "fetched.json")
        fetched = _read_json(fetched_path, [])
        on_disk = self._shard_files()
        records = self._records()
        reading = set(self.keep).union(*(r.get("reading", []) for r in records))  # (and what readers just read)
        ahead = set().union(*(r.get("ahead", []) for r in records))
        buffered = set().union(*(r.get("buffered", []) for r in records))
        in_flight = {n for r in records for n in r.get("fetching", [])} | {name}
        # a download in flight counts whole: its size from the catalog (another split's loader's entries too)
        catalog = _read_json(os.path.join(self.directory, "catalog.json"), {})
        size_of = {n: entry.get("size", 0) for n, entry in catalog.items() if isinstance(entry, dict)}
        size_of |= dict(zip(self.names, self.sizes))
        used = sum(on_disk.values()) + sum(max(size_of.get(n, 0) - on_disk.get(n, 0), 0) for n in in_flight)
        if self.limit is not None:
            complete = self._shard_files(partial=False)  # (a partial download stays: its own fetch resumes it)
            victims = sorted((n for n in fetched if n in complete and n not in reading and n not in in_flight
                              and (now or n not in ahead)),
                             key=lambda n: (n in ahead, n in buffered, _mtime(os.path.join(self.data_dir, n))))
            while used > self.limit and victims:
                victim = victims.pop(0)
                path = os.path.join(self.data_dir, victim)
                remove_if_exists(path)
                remove_if_exists(record_path(path))
                used -= complete[victim]
                fetched.remove(victim)
                logger.debug("evicted %s", victim)
            _write_json(fetched_path, fetched)
            if used > self.limit:
                return False
        self.peak_bytes = max(self.peak_bytes, used)
        missing = size_of.get(name, 0) - on_disk.get(name, 0)
        free = shutil.disk_usage(self.data_dir).free
        if missing > free:
            raise OSError(errno.ENOSPC, f"{name} needs {_gb(missing)} more but {self.data_dir} has "
                                        f"{_gb(free)} free (the disk is full); free some space, pass a "
                                        "smaller cache_limit, or a data_dir on a bigger disk")
        return True

    # -- what this loader needs --------------------------------------------------------

    def _fill(self, count: int) -> None:
        """Extend _ahead to `count` visits (or the order's end)."""
        for p in itertools.islice(self._order, max(count - len(self._ahead), 0)):
            self._ahead.append(p)
            self._first_seen.setdefault(p, self._seen)
            self._seen += 1

    def _publish(self) -> None:
        """Write this loader's needs when they changed (the caller holds _cond); nothing once closed."""
        if self._stop.is_set():
            return
        reading = ([] if self._current is None else [self._current]) + list(self._waiting) + self._first
        reading += list(self._just_read.values())
        reading = sorted({self.names[p] for p in reading})
        ahead = sorted({self.names[p] for p in self._ahead[:self.prefetch_shards]})
        buffered = sorted({self.names[p] for p in set().union(*self._held)})
        fetching = [self._fetching] if self._fetching else []
        if (reading, ahead, buffered, fetching) == self._published:
            return
        with self.lock_file:
            _write_json(os.path.join(self.directory, self.me), {"host": socket.gethostname(), "pid": os.getpid(),
                                                                 "reading": reading, "ahead": ahead,
                                                                 "buffered": buffered, "fetching": fetching})
        self._published = (reading, ahead, buffered, fetching)

    def hold(self, keys) -> None:
        """The documents a state just built still buffers, by key (epoch, pq_idx, ...): their shards go last."""
        held = {key[1] for key in keys}
        with self._cond:
            if not self._held or held != self._held[-1]:
                self._held.append(held)
                self._publish()
            else:
                self._held.append(held)

    # -- the fetching thread -------------------------------------------------------------

    def start(self, order, first=()) -> None:
        """Begin fetching: the shards `first` (a resumed state's buffered documents', which the loader reads before
        anything else), then along `order`, the shards the stream will read (pq_idx, in order)."""
        with self._cond:
            self._first = list(dict.fromkeys(first))
            self._order = iter(order)
            self._fill(max(self.prefetch_shards, 1) + 1)
            if self._ahead:
                self._current = self._ahead.pop(0)
            self._publish()
        self._thread = threading.Thread(target=self._run, name="nanochat-shards", daemon=True)
        self._thread.start()

    def _next_target(self) -> int | None:
        """The buffer's shards, what readers wait for (earliest in the order first), the current shard, then the
        next prefetch_shards."""
        wanted = self._first + sorted(self._waiting, key=lambda p: self._first_seen.get(p, self._seen))
        wanted += ([] if self._current is None else [self._current]) + self._ahead[:self.prefetch_shards]
        for p in wanted:
            if p in self._ready and not os.path.exists(os.path.join(self.data_dir, self.names[p])):
                self._ready.discard(p)  # evicted since (by any loader of the machine): fetch it again, ahead
            if p not in self._ready and p not in self._failed:
                return p
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                target = self._next_target()
                if target is None:
                    self._cond.wait(1.0)
                    continue
                now = target == self._current or target in self._waiting or target in self._first
            try:
                if self._fetch(target, now):
                    with self._cond:
                        self._ready.add(target)
                        self._cond.notify_all()
                else:
                    with self._cond:
                        self._cond.wait(0.5)  # no room yet: other loaders of this machine still hold it
            except BaseException as e:  # handed to the reader, which raises it
                if self._stop.is_set():
                    return
                with self._cond:
                    self._failed[target] = (e, now)
                    self._cond.notify_all()

    def _fetch(self, p: int, now: bool) -> bool:
        name, url = self.names[p], self.urls[p]
        path = os.path.join(self.data_dir, name)
        with self._cond:  # (lock order: _cond, then the directory lock; never the other way round)
            self._fetching = name
            self._publish()
        with self.lock_file:
            room = self._make_room(name, now)
            if room and not os.path.exists(path):  # listed before it exists: a kill mid-way leaves nothing unlisted
                fetched_path = os.path.join(self.directory, "fetched.json")
                _write_json(fetched_path, sorted(set(_read_json(fetched_path, [])) | {name}))
        if not room:
            with self._cond:
                self._fetching = None
                self._publish()
            if not now:
                return False
            # the shard the reader waits for: the other loaders of this machine may still be reading what fills the
            # budget, and move on within seconds (ranks train in step); past ROOM_WAIT they will not
            self._short_since = self._short_since or time.monotonic()
            if time.monotonic() - self._short_since > self.room_wait:
                raise ValueError(f"cache_limit={_gb(self.limit)} has had no room for {name} for {self.room_wait:g}s: "
                                 "the shards that the loaders of this machine still need fill it "
                                 f"(.stream/needs-*.json in {self.data_dir}); raise cache_limit or lower prefetch_shards")
            return False
        self._short_since = None
        try:
            replaced = download_file(url, path, self.limits, stop=self._stop)
        except DownloadError as e:
            raise ConnectionError(f"could not fetch shard {name} from {url}: {e}") from None
        finally:
            with self._cond:
                self._fetching = None
                self._publish()
        meta = open_parquet(path).metadata
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        expected = read_catalog(self.data_dir, [name], [url], self.limits)[0]
        if (os.path.getsize(path), rows) != (expected["size"], expected["rows"]):
            catalog = os.path.join(self.directory, "catalog.json")
            raise ValueError(f"{path} ({url}) is not the shard the stream was planned on: {os.path.getsize(path)} "
                             f"bytes and {len(rows)} row groups, the catalog {catalog} "
                             f"says {expected['size']} and {len(expected['rows'])}; the file changed on the server. "
                             "Remove the catalog to start over (states taken on the old files will be refused)")
        if replaced is not None:
            self.fetched_bytes += os.path.getsize(path)
        return True

    # -- the reader's side ---------------------------------------------------------------

    def need(self, p: int) -> str:
        """The path of shard p once it is on disk. Moves this loader's place in its order to p when p is among its
        next visits (else it is fetched all the same). Waits at most the downloader's deadline plus ROOM_WAIT and
        NEED_MARGIN, then raises; a fetch that failed while the reader waited raises its error."""
        with self._cond:
            if p in self._first:
                self._first.remove(p)
            elif p != self._current:
                self._fill(LOOKAHEAD)
                if p in self._ahead:
                    del self._ahead[:self._ahead.index(p) + 1]
                    self._current = p
                    self._fill(self.prefetch_shards)
                else:  # not where the order said (a buffer restored while the stream starts): fetched all the same
                    logger.debug("shard %s read out of the expected order", self.names[p])
            self._waiting[p] = self._waiting.get(p, 0) + 1
            self._publish()
            self._cond.notify_all()
            try:
                self._wait_ready(p)
                self._just_read[threading.get_ident()] = p  # kept until this thread asks for another shard
            finally:
                self._waiting[p] -= 1
                if not self._waiting[p]:
                    del self._waiting[p]
                self._publish()
        path = os.path.join(self.data_dir, self.names[p])
        if not os.path.exists(path):  # evicted by another loader between two visits: fetch it again
            with self._cond:
                self._ready.discard(p)
                self._cond.notify_all()
            return self.need(p)
        return path

    def _wait_ready(self, p: int) -> None:
        deadline = time.monotonic() + self.limits.deadline + self.room_wait + NEED_MARGIN
        while p not in self._ready:
            if p in self._failed:
                error, waited = self._failed.pop(p)
                if waited:
                    raise error
                self._cond.notify_all()  # a fetch ahead failed (an outage since?): once more, now it is needed
            if self._stop.is_set():
                raise RuntimeError("the shard cache is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shard {self.names[p]} ({self.urls[p]}) is not on disk after "
                                   f"{self.limits.deadline + self.room_wait + NEED_MARGIN:g}s")
            self._cond.wait(min(left, 1.0))

    def close(self) -> None:
        """Stop fetching (a download in flight stops at its next read) and withdraw this loader's needs."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a download blocked in a read ends at its timeout, on a daemon thread
        with self.lock_file:
            remove_if_exists(os.path.join(self.directory, self.me))


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return 0.0
