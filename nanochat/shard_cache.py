"""
Shards fetched just ahead of the reader (a loader's stream=True): training starts once the first shard is on
disk, not after all of them, and the data directory stays within a disk budget (cache_limit).

    catalog = read_catalog(data_dir, names, urls, limits)   # name -> (size, documents per row group)
    cache = ShardCache(data_dir, names, urls, sizes, prefetch_shards=2, cache_limit=20e9, limits=limits, prefetch=4,
                       copies=copies_estimate(catalog, buffer_docs),
                       packing=packing_shards(catalog, rank, world_size, read_ahead_docs))
    cache.start(order, buffered=keys)   # order: the visits (epoch, pq_idx) the reader will make (Stream.file_order);
                                        # keys: a resumed state's buffered documents
    cache.need(pq_idx)     # its path, once it is on disk: waits, bounded
    cache.hold(keys, at)   # the documents a state just built still buffers, and the file its stream goes on in
    cache.kept_unit(pq_idx, rg_idx, rows, n)   # a resumed buffer's documents, from kept copies (or None)
    cache.close()

The catalog. A stream needs each shard's row-group counts (its index) and size (the state's fingerprint of
the files) before it reads the shard. Both come from the shard's end, one HTTP Range request each, and are
kept in data_dir/.stream/catalog.json, so a restart reads nothing over the network for them.

Fetching. One background thread per loader fetches, through nanochat.download (the retries, time bounds,
verification and per-file lock of the CLI), the shard the reader needs now, then the next prefetch_shards
of its order. Every local rank reads the same shards in the same order (each its own row groups), so the
per-file lock makes one of them download a shard and the others find it there: once per machine. A shard
that arrives is checked against its catalog entry.

The budget. Before a download, shards are evicted until the data directory's shards (with every download in
flight counted whole) and the documents kept for buffers fit in cache_limit. Only complete shards a streaming
loader fetched (listed in .stream/fetched.json) are evicted, oldest first, and never one that a loader of this
machine still needs: each records in .stream/needs-<host>-<pid>-<n>.json the shards it reads, waits for or was
just handed, those whose documents it is still packing, its next prefetch_shards (its plan's, after an elastic
resume), and those its recent states' buffers refer to. Never the val shard either, nor one it did not fetch. A
record whose process is gone is ignored. A budget below what must be held at once is a ValueError at the start:
the shards from the one packed to the one read (packing_shards), prefetch_shards more, one for a local rank out
of step, the val shard, and an estimate of the copies below for each local rank (copies_estimate).

Kept documents. A long document can stay in the best-fit buffer for many shards, and a resume from a state
re-reads its buffered documents: holding every shard they came from would let the buffer, not cache_limit,
decide the disk used. So once a shard's documents are all packed (the states have moved past it), a loader
copies the few its recent states still buffer into .stream/kept/<host>-<pid>-<n>/<shard>.json.gz ([[row group,
row, text], ...]), in the shard's place when no other loader needs it, and from then on the buffers no longer
need the shard. A resume on this machine reads its buffered documents from there (any loader's copies: they
are the same texts) and fetches first only the shards it still lacks. A loader drops a copy when no recent
state buffers its documents (and writes it again, smaller, once they hold less than half of it); a gone
loader's copies stay for a resume until a live loader makes room while none is resuming. A loader whose
cache_limit holds its split, the val shard and the other shards in the directory copies nothing, until a
loader of the machine has to evict (.stream/evicting; it stays, and later loaders there copy and budget copies). The copies' room in the budget is an estimate: if they
outgrow it so that the shard a reader waits for has no room, the oldest copies go, with a warning (_last_resort).

May import: nanochat.dataset, nanochat.download, nanochat.files, pyarrow, filelock, tqdm.
"""

import errno
import gzip
import itertools
import json
import logging
import math
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

from nanochat.dataset import open_parquet, read_row_group_column, streamed_split
from nanochat.download import MAGIC, TAIL_BYTES, DownloadError, Limits, download_file, fetch_tail, record_path
from nanochat.files import remove_if_exists

logger = logging.getLogger("nanochat.dataloader.shard_cache")

STREAM_DIR = ".stream"  # in the data directory: the catalog, the fetched list, each loader's needs
LOOKAHEAD = 64  # distinct shards of the order searched for the one the reader asks for
HELD_STATES = 4  # states whose buffered documents are kept, past 2 x prefetch (those yielded last, and a few more)
KEPT_DIR = "kept"  # in STREAM_DIR: a directory per loader, a file of kept documents per shard
KEPT_SUFFIX = ".json.gz"  # [[rg_idx, row, text], ...]
EVICTING = "evicting"  # in STREAM_DIR: written the first time a loader of the machine must evict
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


def packing_shards(entries: list[dict], rank: int, world_size: int, read_ahead: int) -> int:
    """The most shards that `read_ahead` documents (read and not yet packed) and the one the reader has just opened
    can span for this rank: one more than its fewest documents of a shard (its row groups of it) divide them into."""
    shares = [sum(entry["rows"][rank::world_size]) for entry in entries]
    return 1 + math.ceil(read_ahead / max(min((n for n in shares if n), default=1), 1))


def copies_estimate(entries: list[dict], buffer_docs: int) -> int:
    """What the copies of `buffer_docs` buffered documents may take, an estimate: twice their bytes at the split's
    most bytes per document of a shard (best-fit keeps long documents waiting)."""
    return int(2 * buffer_docs * max(entry["size"] / max(sum(entry["rows"]), 1) for entry in entries))


# -----------------------------------------------------------------------------
# The cache


class ShardCache:
    """Fetches one split's shards just ahead of its reader, within a budget (see the module docstring)."""

    _count = itertools.count()

    def __init__(self, data_dir: str, names: list[str], urls: list[str], sizes: list[int], *, prefetch_shards: int,
                 cache_limit: int | None, limits: Limits, keep: dict[str, int] | None = None, prefetch: int = 4,
                 copies: int = 0, packing: int = 2):
        self.data_dir, self.names, self.urls, self.sizes = data_dir, names, urls, sizes
        self.prefetch_shards, self.limit, self.limits = prefetch_shards, cache_limit, limits
        self.keep = dict(keep or {})  # name -> size: never evicted (the val shard)
        self.copies = copies  # what copies of a buffer's documents may take (copies_estimate), for the budget
        self.copying = False  # whether this loader copies them: set by _check_budget, or once a loader must evict
        self.packing = packing  # the most shards from the one the packer takes documents from to the one read
        self.local_ranks = _local_ranks()
        self.directory = os.path.join(data_dir, STREAM_DIR)
        self.lock_file = FileLock(os.path.join(self.directory, "lock"))
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{next(self._count)}"
        self.me = f"needs-{self.owner}.json"
        self.kept_root = os.path.join(self.directory, KEPT_DIR)
        self._cond = threading.Condition()
        self._order = iter(())
        self._visits: list[tuple[int, int]] = []  # (epoch, pq_idx) of each visit of the order looked at so far
        self._at: int | None = None  # the visit the reader is at
        self._dealt = 0  # the visit the last state's stream goes on in: the packer has every document before it
        self._ready: set[int] = set()
        self._waiting: dict[int, int] = {}  # pq_idx -> readers waiting for it (the packing thread restores a buffer
        # while the reading thread starts the stream: two readers)
        self._first_seen: dict[int, int] = {}  # pq_idx -> where the order first names it (what waits goes in order)
        self._first: list[int] = []  # shards to fetch before anything else, each until it is first read
        self._just_read: dict[int, int] = {}  # reading thread -> the shard need() last returned to it: it is opening it
        self._failed: dict[int, tuple[BaseException, bool]] = {}  # pq_idx -> (error, whether the reader waited)
        # the buffered documents {pq_idx: {(rg_idx, row)}} of the states built last: a DataLoader yields a state
        # about prefetch + 1 states after it is built, and a resume may start from any of the last few yielded
        self._held: deque = deque(maxlen=2 * prefetch + HELD_STATES)
        self._kept: dict[int, frozenset] = {}  # pq_idx -> the (rg_idx, row) of it this loader's copy holds
        self._unkept: set[int] = set()  # shards recent states buffer documents of that no copy of ours holds yet
        self._keep_pending = False
        self._restoring = False  # a resumed buffer is read (perhaps from other loaders' copies): they stay till then
        self._restore_texts: dict[str, dict] = {}  # shard name -> {(rg_idx, row): text} of the copies, while restoring
        self._fetching: str | None = None
        self._broken: BaseException | None = None  # why the fetching thread stopped, if it did
        self._warned = False  # (the last resort's warning, once)
        self._published = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.room_wait = ROOM_WAIT
        self._short_since: float | None = None
        self.fetched_bytes = 0  # what this cache downloaded (for the benchmark)
        self.peak_bytes = 0  # the most the data directory's shards and kept documents took at once, as measured here
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

    def _kept_bytes(self) -> int:
        total = 0
        for owner in _listdir(self.kept_root):
            for name in _listdir(os.path.join(self.kept_root, owner)):
                try:
                    total += os.path.getsize(os.path.join(self.kept_root, owner, name))
                except FileNotFoundError:
                    continue
        return total

    def _check_budget(self) -> None:
        if self.limit is None:
            self.copies = 0
            return
        fetched = set(_read_json(os.path.join(self.directory, "fetched.json"), []))
        # (a partial download is not fixed: it becomes a fetched shard, or this loader resumes it)
        on_disk = self._shard_files(partial=False)
        fixed = {name: size for name, size in on_disk.items() if name not in fetched or name in self.keep}
        largest = max(self.sizes)
        # copies of buffered documents are made only when the shards may not all fit (else none is ever evicted:
        # until a loader of the machine has to, see _make_room); their room is at most the shards' own bytes
        fits = sum(self.sizes) + sum(size for name, size in self.keep.items() if name not in fixed) + sum(fixed.values())
        self.copying = self.limit < fits or os.path.exists(os.path.join(self.directory, EVICTING))
        self.copies = min(self.copies, sum(self.sizes)) if self.copying and set(self.names) - set(self.keep) else 0
        # the shards from the one it packs to the one it reads (packing_shards), prefetch_shards ahead and one for
        # a local rank out of step (a split has no more); the val shard when a val loader (an eval during training)
        # has yet to fetch it; the copies of every local rank's buffered documents
        count = min(self.packing + self.prefetch_shards + 1, len(self.names))
        later = sum(size for name, size in self.keep.items() if name not in on_disk and name not in self.names)
        copies = self.copies * self.local_ranks
        least = sum(fixed.values()) + count * largest + later + copies
        val = f" and the val shard ({_gb(later)})" if later else ""
        if self.limit < least:
            raise ValueError(
                f"cache_limit={_gb(self.limit)} is below what this streaming loader must hold at once, {_gb(least)}: "
                f"{count} x {_gb(largest)} (the largest shard) for the shards from the one it packs to the one it reads "
                f"({self.packing}: its read-ahead against its documents per shard), prefetch_shards="
                f"{self.prefetch_shards} ahead and one for a local rank out of step (at most the split's "
                f"{len(self.names)}){val}, about {_gb(copies)} for copies of buffered documents ({self.local_ranks} "
                "local rank(s)), plus "
                f"{_gb(sum(fixed.values()))} of shards in {self.data_dir} that it may not evict ({len(fixed)}: the val "
                "shard and those it did not fetch); raise cache_limit, lower prefetch_shards, prefetch, "
                "tokenizer_batch_size or buffer_size, or use another data_dir")

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

    def _last_resort(self, name: str, used: int) -> int:
        """The shard a reader waits for has no room, and the copies of the buffers' documents have outgrown the room
        the start check set aside for them (copies_estimate: long documents can wait in a best-fit buffer for good).
        The oldest copies go, with a warning, rather than the reader waiting (no shard: those a buffer still needs
        stay until their copies are written): a resume from the states of now fetches their shards again, first
        (still exact)."""
        kept_bytes = self._kept_bytes()
        room = self.copies * self.local_ranks
        if used - kept_bytes > self.limit or kept_bytes <= room:  # (dropping copies would not help, or they fit)
            return used
        spare = []
        for owner in _listdir(self.kept_root):
            for kept in _listdir(os.path.join(self.kept_root, owner)):
                path = os.path.join(self.kept_root, owner, kept)
                spare.append((_mtime(path), path, _size(path)))
        dropped = 0
        for _, path, size in sorted(spare):
            if used <= self.limit or kept_bytes - dropped <= room:
                break
            remove_if_exists(path)
            used, dropped = used - size, dropped + size
        if dropped and not self._warned:
            self._warned = True
            kept = self._kept_bytes() + dropped
            logger.warning("cache_limit=%s had no room for %s, which a reader waits for; the copies of buffered "
                           "documents in %s took %s (the start check set aside %s for them): dropped %s of them, "
                           "oldest first. A resume from the states of now fetches their shards again. Raise "
                           "cache_limit by about %s to keep them", _gb(self.limit), name, self.kept_root, _gb(kept),
                           _gb(self.copies * self.local_ranks), _gb(dropped),
                           _gb(max(kept - self.copies * self.local_ranks, dropped)))
        return used

    def _make_room(self, name: str | None, extra: int = 0, release: str | None = None, now: bool = False) -> bool:
        """Evict until shard `name` (or `extra` bytes of kept documents) fits (under the directory lock); False
        when it cannot yet. `release`: a shard this loader's buffers no longer need once the copy is written (it
        goes first, if no one else needs it: its copy takes its place). Shards no loader needs
        go, oldest first; never one that a loader reads, waits for, was just handed, still packs documents of,
        fetched ahead, or whose buffered documents it has not kept yet. Kept documents of loaders that are gone
        go first, unless a loader is resuming (it may read them); for a shard a reader waits for (now), the other
        copies last (_last_resort)."""
        fetched_path = os.path.join(self.directory, "fetched.json")
        fetched = _read_json(fetched_path, [])
        on_disk = self._shard_files()
        records = self._records()
        if not any(r.get("restoring") for r in records):
            live = {r.get("owner") for r in records} | {self.owner}  # (its own stay while it runs, closed or not)
            for owner in _listdir(self.kept_root):
                if owner not in live:
                    shutil.rmtree(os.path.join(self.kept_root, owner), ignore_errors=True)
        needed = set(self.keep)
        for r in records:
            needed.update(r.get("reading", []), r.get("ahead", []))
            # (buffered: shards whose buffered documents are not copied yet; `release` is being copied now)
            needed.update(n for n in r.get("buffered", []) if not (r.get("owner") == self.owner and n == release))
        in_flight = {n for r in records for n in r.get("fetching", [])} | ({name} if name else set())
        # a download in flight counts whole: its size from the catalog (another split's loader's entries too)
        catalog = _read_json(os.path.join(self.directory, "catalog.json"), {})
        size_of = {n: entry.get("size", 0) for n, entry in catalog.items() if isinstance(entry, dict)}
        size_of |= dict(zip(self.names, self.sizes))
        used = sum(on_disk.values()) + sum(max(size_of.get(n, 0) - on_disk.get(n, 0), 0) for n in in_flight)
        used += self._kept_bytes() + extra
        if self.limit is not None:
            complete = self._shard_files(partial=False)  # (a partial download stays: its own fetch resumes it)
            victims = sorted((n for n in fetched if n in complete and n not in needed and n not in in_flight),
                             key=lambda n: (n != release, _mtime(os.path.join(self.data_dir, n))))
            if used > self.limit and not os.path.exists(os.path.join(self.directory, EVICTING)):
                _write_json(os.path.join(self.directory, EVICTING), True)  # (every loader of the machine copies now)
            while used > self.limit and victims:
                victim = victims.pop(0)
                path = os.path.join(self.data_dir, victim)
                remove_if_exists(path)
                remove_if_exists(record_path(path))
                used -= complete[victim]
                fetched.remove(victim)
                logger.debug("evicted %s", victim)
            if used > self.limit and now:
                used = self._last_resort(name, used)
            _write_json(fetched_path, fetched)
            if used > self.limit:
                return False
        self.peak_bytes = max(self.peak_bytes, used)
        missing = size_of.get(name, 0) - on_disk.get(name, 0) if name else extra
        free = shutil.disk_usage(self.data_dir).free
        if missing > free:
            what = f"{name} needs" if name else "a copy of buffered documents needs"
            raise OSError(errno.ENOSPC, f"{what} {_gb(missing)} more but {self.data_dir} has "
                                        f"{_gb(free)} free (the disk is full); free some space, pass a "
                                        "smaller cache_limit, or a data_dir on a bigger disk")
        return True

    # -- what this loader needs --------------------------------------------------------

    def _fill(self, count: int) -> None:
        """Look `count` visits past the reader's (or to the order's end)."""
        wanted = (-1 if self._at is None else self._at) + 1 + count - len(self._visits)
        for visit in itertools.islice(self._order, max(wanted, 0)):
            self._first_seen.setdefault(visit[1], len(self._visits))
            self._visits.append(visit)

    def _current(self) -> int | None:
        return None if self._at is None else self._visits[self._at][1]

    def _ahead(self) -> list[int]:
        """The next prefetch_shards visits' shards."""
        if self._at is None:
            return []
        return [p for _, p in self._visits[self._at + 1:self._at + 1 + self.prefetch_shards]]

    def _packing(self) -> set[int]:
        """The shards from where the last state's stream goes on to the reader's: documents read and not yet
        packed come from them (so a later state's buffer may hold some)."""
        if self._at is None:
            return set()
        return {p for _, p in self._visits[min(self._dealt, self._at):self._at + 1]}

    def _publish(self) -> None:
        """Write this loader's needs when they changed (the caller holds _cond); nothing once closed."""
        if self._stop.is_set():
            return
        reading = ([] if self._at is None else [self._current()]) + list(self._waiting) + self._first
        reading += list(self._just_read.values()) + sorted(self._packing())
        reading = sorted({self.names[p] for p in reading})
        ahead = sorted({self.names[p] for p in self._ahead()})
        buffered = sorted({self.names[p] for p in self._unkept})
        fetching = [self._fetching] if self._fetching else []
        record = (reading, ahead, buffered, fetching, self._restoring)
        if record == self._published:
            return
        with self.lock_file:
            _write_json(os.path.join(self.directory, self.me), {
                "host": socket.gethostname(), "pid": os.getpid(), "owner": self.owner, "reading": reading,
                "ahead": ahead, "buffered": buffered, "fetching": fetching, "restoring": self._restoring})
        self._published = record

    def hold(self, keys, at) -> None:
        """A state was just built: `keys` (epoch, pq_idx, rg_idx, row, ...) are the documents its buffer holds,
        and its stream goes on in file `at` (epoch, pq_idx). Their shards stay until those documents are kept."""
        held: dict[int, set] = {}
        for key in keys:
            held.setdefault(key[1], set()).add((key[2], key[3]))
        with self._cond:
            for v in range(self._dealt, len(self._visits)):
                if self._visits[v] == tuple(at):
                    self._dealt = v
                    break
            self._held.append({p: frozenset(rows) for p, rows in held.items()})
            self._unkept = self._find_unkept()
            self._keep_pending = True
            if not self.copying:  # (the restored buffer is in a state now; no copies of its own to write first)
                self._restoring = False
            self._publish()
            self._cond.notify_all()

    def _find_unkept(self) -> set[int]:
        kept = self._kept
        return {p for held in self._held for p, rows in held.items() if not rows <= kept.get(p, frozenset())}

    # -- kept documents --------------------------------------------------------------------

    def _kept_texts(self, name: str) -> dict[tuple[int, int], str]:
        """{(rg_idx, row): text} of every loader's kept copies of one shard's documents."""
        texts = {}
        for owner in _listdir(self.kept_root):
            path = os.path.join(self.kept_root, owner, name + KEPT_SUFFIX)
            try:
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    kept = json.load(f)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:  # (written whole and renamed: only a damaged disk gets here)
                logger.warning("kept documents %s are unreadable (%s); not used", path, e)
                continue
            texts.update(((rg_idx, row), text) for rg_idx, row, text in kept)
        return texts

    def _texts(self, p: int, rows: frozenset) -> dict | None:
        """{(rg_idx, row): text} for the given documents of shard p, from the shard when it is on disk, else from
        kept copies; None when some cannot be found."""
        path = os.path.join(self.data_dir, self.names[p])
        try:
            pf = open_parquet(path)
        except FileNotFoundError:
            texts = self._kept_texts(self.names[p])
            return {key: texts[key] for key in rows} if rows <= texts.keys() else None
        texts = {}
        for rg_idx in sorted({rg for rg, _ in rows}):
            wanted = sorted(row for rg, row in rows if rg == rg_idx)
            texts.update(zip(((rg_idx, row) for row in wanted),
                             read_row_group_column(pf, rg_idx, path).take(wanted).to_pylist()))
        return texts

    def _keep_documents(self) -> None:
        """Copy the documents recent states buffer from shards this loader is done packing (the module docstring);
        drop the copies no recent state needs."""
        if not self.copying and self.limit is not None and os.path.exists(os.path.join(self.directory, EVICTING)):
            self.copying = True
        with self._cond:
            if not self._keep_pending or self._stop.is_set() or not self.copying:
                return
            self._keep_pending = False
            wanted: dict[int, set] = {}
            for held in self._held:
                for p, rows in held.items():
                    wanted.setdefault(p, set()).update(rows)
            packing = self._packing()
            todo = [(p, frozenset(wanted[p])) for p in sorted(self._unkept)
                    if p not in packing and self.names[p] not in self.keep]
            # a copy whose documents the buffers hold less than half of is written again, smaller
            todo += [(p, frozenset(wanted[p])) for p, rows in self._kept.items()
                     if p in wanted and p not in self._unkept and 2 * len(wanted[p]) <= len(rows)]
            drop = [p for p in self._kept if p not in wanted]
        directory = os.path.join(self.kept_root, self.owner)
        for p in drop:
            remove_if_exists(os.path.join(directory, self.names[p] + KEPT_SUFFIX))
            with self._cond:
                del self._kept[p]
        for p, rows in todo:
            texts = self._texts(p, rows)
            if texts is None:  # (only a shard read from copies that are gone since: a resume fetches it)
                logger.debug("the buffered documents of %s are neither on disk nor kept", self.names[p])
                continue
            data = gzip.compress(json.dumps([[*key, texts[key]] for key in sorted(texts)]).encode(), mtime=0)
            path = os.path.join(directory, self.names[p] + KEPT_SUFFIX)
            with self.lock_file:  # room first, as for a download: the budget holds the copies too
                room = self._make_room(None, len(data), release=self.names[p])  # (old copy and new, for a moment)
                if room:
                    os.makedirs(directory, exist_ok=True)
                    with open(f"{path}.tmp", "wb") as f:
                        f.write(data)
                    os.replace(f"{path}.tmp", path)
            with self._cond:
                if room:
                    self._kept[p] = rows
                else:  # once the other loaders of this machine move on (then this shard can go)
                    self._keep_pending = True
        with self._cond:
            self._unkept = self._find_unkept()
            if self._held and not self._keep_pending:  # the restored buffer is in a state now, and kept: other
                # loaders' copies may go
                self._restoring = False
                self._restore_texts.clear()
            self._publish()

    def kept_unit(self, p: int, rg_idx: int, rows, n: int):
        """Documents `rows` of shard p's row group rg_idx (n documents) as the reader's unit, the other entries
        None, from kept copies: when the shard is not on disk and the copies hold all of them; else None."""
        name = self.names[p]
        if os.path.exists(os.path.join(self.data_dir, name)):
            return None
        if name not in self._restore_texts:
            self._restore_texts[name] = self._kept_texts(name)
        texts = self._restore_texts[name]
        if any((rg_idx, row) not in texts for row in rows):
            return None
        with self._cond:
            if p in self._first:  # (it was on disk when the loader started)
                self._first.remove(p)
                self._publish()
        return pa.array([texts.get((rg_idx, row)) for row in range(n)], pa.large_string())

    # -- the fetching thread -------------------------------------------------------------

    def start(self, order, buffered=()) -> None:
        """Begin fetching, along `order`, the visits (epoch, pq_idx) of the files the stream will read: first the
        shards of `buffered`, a resumed state's buffered documents (keys), unless copies kept on this machine
        hold them all."""
        rows: dict[int, set] = {}
        for key in buffered:
            rows.setdefault(key[1], set()).add((key[2], key[3]))
        first = []
        for p, wanted in rows.items():
            name = self.names[p]
            if not os.path.exists(os.path.join(self.data_dir, name)):
                self._restore_texts[name] = self._kept_texts(name)
                if wanted <= self._restore_texts[name].keys():
                    continue
            first.append(p)
        with self._cond:
            self._first = first
            self._restoring = bool(rows)
            self._order = iter(order)
            self._fill(1)
            if self._visits:
                self._at = 0
            self._fill(self.prefetch_shards)
            self._publish()
        self._thread = threading.Thread(target=self._run, name="nanochat-shards", daemon=True)
        self._thread.start()

    def _next_target(self) -> int | None:
        """The buffer's shards, what readers wait for (earliest in the order first), the current shard, then the
        next prefetch_shards."""
        wanted = self._first + sorted(self._waiting, key=lambda p: self._first_seen.get(p, len(self._visits)))
        wanted += ([] if self._at is None else [self._current()]) + self._ahead()
        for p in wanted:
            if p in self._ready and not os.path.exists(os.path.join(self.data_dir, self.names[p])):
                self._ready.discard(p)  # evicted since (by any loader of the machine): fetch it again, ahead
            if p not in self._ready and p not in self._failed:
                return p
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._keep_documents()
            except BaseException as e:  # (a full disk): handed to the reader, which raises it at its next shard
                with self._cond:
                    self._broken = e
                    self._cond.notify_all()
                return
            with self._cond:
                target = self._next_target()
                if target is None:
                    self._cond.wait(1.0)
                    continue
                now = target == self._current() or target in self._waiting or target in self._first
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
            room = self._make_room(name, now=p in self._waiting)  # (the last resort only for a reader waiting)
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
                                 "the shards that the loaders of this machine still need and the copies of their "
                                 f"buffered documents ({_gb(self._kept_bytes())}) fill it (.stream/needs-*.json and "
                                 f".stream/kept in {self.data_dir}); raise cache_limit, or lower prefetch_shards or "
                                 "buffer_size")
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

    def need(self, p: int, in_order: bool = True) -> str:
        """The path of shard p once it is on disk. Moves this loader's place in its order to p when p is among its
        next visits and read in_order (not for a buffer's documents); else it is fetched all the same. Waits at
        most the downloader's deadline plus ROOM_WAIT and NEED_MARGIN, then raises; a fetch that failed while the
        reader waited raises its error."""
        with self._cond:
            if p in self._first:
                self._first.remove(p)
            elif in_order and p != self._current():
                self._fill(LOOKAHEAD)
                base = 0 if self._at is None else self._at + 1
                later = [q for _, q in self._visits[base:base + LOOKAHEAD]]
                if p in later:
                    self._at = base + later.index(p)
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
            return self.need(p, in_order)
        return path

    def _wait_ready(self, p: int) -> None:
        deadline = time.monotonic() + self.limits.deadline + self.room_wait + NEED_MARGIN
        while p not in self._ready:
            if self._broken is not None:  # keeping documents failed: fetching has stopped
                raise self._broken
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
        """Stop fetching (a download in flight stops at its next read) and withdraw this loader's needs (its kept
        documents stay for a resume, until a live loader makes room while none is resuming)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a download blocked in a read ends at its timeout, on a daemon thread
        with self.lock_file:
            remove_if_exists(os.path.join(self.directory, self.me))


def _local_ranks() -> int:
    """The ranks of this machine (torchrun's LOCAL_WORLD_SIZE; 1 without it): each keeps copies of its buffer."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} must be a positive integer (torchrun sets it)")
    return int(value)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


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


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return 0.0
