"""
Shards fetched just ahead of the reader (a loader's stream=True): training starts once the first
shard is on disk, and the data directory stays within a disk budget, cache_limit. One background
thread per loader fetches the shard the reader needs, then the next prefetch_shards; before each
download, shards that no live loader of the machine needs are evicted: first those none reads soon,
oldest first, then those read latest. What every loader needs, and why, is in the ledger
(nanochat/data/streaming/ledger.py); the catalog (nanochat/data/streaming/catalog.py) gives the
sizes, and buffered documents are kept as copies (nanochat/data/streaming/kept.py). A budget below
what must be held at once is a ValueError at the start. Design: docs/streaming.md.

    python -m nanochat.shard_cache status [DATA_DIR]   # what is on disk, who needs it and why

May import: nanochat.data.streaming.cache_status, nanochat.data.streaming.catalog,
nanochat.data.base.checks, nanochat.data.base.cli, nanochat.dataset, nanochat.data.fetch.download,
nanochat.data.base.files, nanochat.data.streaming.kept, nanochat.data.streaming.ledger,
nanochat.data.base.state.
"""

import argparse
import itertools
import logging
import math
import os
import shutil
import socket
import sys
import threading
import time
from typing import NamedTuple

import pyarrow as pa

from nanochat.data.streaming.cache_status import CacheStatus, Own, describe, read_status, size_words
from nanochat.data.streaming.catalog import ReadAhead, catalog_path, catalog_sizes, read_catalog
from nanochat.data.base.checks import check_int
from nanochat.dataset import find_data_dir, open_parquet, shown
from nanochat.data.fetch.download import DownloadError, Limits, download_file, record_path
from nanochat.data.base.files import disk_full, remove_if_exists
from nanochat.data.streaming.kept import (Keeper, drop_oldest, encode, file_mtime, kept_bytes,
                                          remove_gone)
from nanochat.data.streaming.ledger import (EVICTED, FETCHED, REASONS, UNKNOWN, Ledger, Loader,
                                            ShardRow, Table, start_time, unknown_rows)
from nanochat.data.base.state import decode_keys, decode_plan

logger = logging.getLogger(__name__)

LOOKAHEAD = 64  # distinct shards of the order searched for the one the reader asks for
NEED_MARGIN = 120.0  # seconds need() waits past the downloader's deadline (another rank's download)
ROOM_WAIT = 600.0  # seconds the shard a reader waits for may find no room before that is an error
# seconds a reader waits for room before the ledger's rows of unknown liveness (ledger.UNKNOWN)
# count as stale: a live loader moves on within seconds, and writes its row again if it was one
STALE_WAIT = 30.0
LATER_MAX = 256  # the most shards a loader lists as read soon (Loader.later)


class Term(NamedTuple):
    """One term of the least cache_limit (the start check)."""
    what: str
    how: str  # how it is counted
    nbytes: int


def size_up(nbytes: int) -> str:
    """A size in words rounded up, to 3 significant digits: never shown below what it is."""
    if nbytes < 1e3:
        return f"{nbytes} bytes"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        digits = 2 if nbytes < 10 * scale else 1 if nbytes < 100 * scale else 0
        step = scale / 10 ** digits
        up = math.ceil(nbytes / step) * step / scale
        if up < 1000 or unit == "GB":  # 999.9 MB rounded up is 1.00 GB, not "1000 MB"
            return f"{up:.{digits}f} {unit}"


def shard_files(data_dir: str, partial: bool = True) -> dict[str, int]:
    """name -> bytes of every shard in the data directory, partial downloads (.tmp) under the
    shard's name (unless partial=False: complete shards only)."""
    sizes: dict[str, int] = {}
    with os.scandir(data_dir) as entries:
        for entry in entries:
            if entry.name.endswith(".parquet") or (partial and entry.name.endswith(".parquet.tmp")):
                try:
                    size = entry.stat().st_size
                except FileNotFoundError:  # (evicted since it was listed)
                    continue
                name = entry.name.removesuffix(".tmp")
                sizes[name] = sizes.get(name, 0) + size
    return sizes


# -----------------------------------------------------------------------------
# The cache


class ShardCache:
    """Fetches one split's shards just ahead of its reader, within a budget. `start` it along the
    reader's order, `need` a shard to read it, `hold` each state's buffer, `close` at the end."""

    _count = itertools.count()

    def __init__(self, data_dir: str, names: list[str], urls: list[str], sizes: list[int], *,
                 prefetch_shards: int, cache_limit: int | None, limits: Limits,
                 keep: dict[str, int] | None = None, prefetch: int = 4, copies: int = 0,
                 packing: ReadAhead = ReadAhead(0, 2, 0.0), read_ahead: int = 0):
        self.data_dir, self.names, self.urls, self.sizes = data_dir, names, urls, sizes
        self.prefetch_shards, self.limit, self.limits = prefetch_shards, cache_limit, limits
        self.keep = dict(keep or {})  # name -> size: never evicted (the val shard)
        self.copies_each = copies  # what copies of a buffer may take (copies_estimate)
        self.copies = copies  # the room the budget sets aside for them (_check_budget)
        self.copying = False  # whether this loader copies them: _check_budget, or once one evicts
        self.packing = packing  # what the shards from the one packed from to the one read hold
        self.read_ahead = read_ahead  # documents read and not yet packed, at most
        self.local_ranks = _local_ranks()
        self.ledger = Ledger(data_dir)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{next(self._count)}"
        self.keeper = Keeper(data_dir, names, self.owner, prefetch, self.ledger)
        self._cond = threading.Condition()
        self._order = iter(())
        self._visits: list[tuple[int, int]] = []  # (epoch, pq_idx) of the order, as far as looked
        self._at: int | None = None  # the visit the reader is at
        self._dealt = 0  # the visit the last state's walk goes on in: all before it is packed
        self._ready: set[int] = set()
        # pq_idx -> readers waiting for it (the packing thread restores a buffer while the reading
        # thread starts the walk: two readers)
        self._waiting: dict[int, int] = {}
        self._first_seen: dict[int, int] = {}  # pq_idx -> where the order first names it
        self._first: list[int] = []  # shards to fetch before anything else, until first read
        self._just_read: dict[int, int] = {}  # thread -> the shard need() last gave it: it opens it
        self._failed: dict[int, tuple[BaseException, bool]] = {}  # pq_idx -> (error, reader waited)
        self._fetching: str | None = None
        self._broken: BaseException | None = None  # why the fetching thread stopped, if it did
        self._warned = False  # (the last resort's warning, once)
        self._published = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # a reader waits this long for room the other loaders hold (they move on within seconds)
        self.room_wait = min(ROOM_WAIT, limits.deadline)
        self.stale_wait = min(STALE_WAIT, self.room_wait / 2)  # (well within room_wait)
        self._stale: set[str] = set()  # the rows of unknown liveness dropped (and warned about)
        # the shards past those it needs that this loader lists as read soon (_later): as many as
        # the budget holds, a few hundred at most (the ledger stays small)
        smallest = max(min(sizes), 1)
        self.later_count = 0 if cache_limit is None else min(cache_limit // smallest, LATER_MAX)
        self._short_since: float | None = None
        self.fetched_bytes = 0  # what this cache downloaded
        self.evictions = 0  # shards this cache evicted to stay within cache_limit
        self.peak_bytes = 0  # the most the shards and kept copies took at once, as measured here
        self._check_budget()

    def status(self) -> CacheStatus:
        """What the cache holds now, who needs it and why, and this loader's own figures."""
        own = Own(self.owner, self.limit, self.peak_bytes, self.fetched_bytes, self.copying,
                  self.evictions)
        return read_status(self.data_dir, own)

    # -- the budget ------------------------------------------------------------------

    def _check_budget(self, restore: list[int] = ()) -> None:
        """The start check: a ValueError when cache_limit is below what must be held at once
        (`restore`: the shards of resumed walks' first documents), naming each term in bytes. Also
        decides whether this loader copies its buffered documents."""
        if self.limit is None:
            self.copies = 0
            return
        table = self.ledger.read()  # (a snapshot: only what this loader may not evict matters)
        fetched = set(table.fetched())
        # (a partial download is not fixed: it becomes a fetched shard, or this loader resumes it)
        on_disk = shard_files(self.data_dir, partial=False)
        fixed = {n: size for n, size in on_disk.items() if n not in fetched or n in self.keep}
        # all of it at once: every shard the cache may hold and the copies already kept. At a limit
        # that holds it no shard is ever evicted, so no copies of buffered documents are made and
        # nothing can wait for room (unless this machine's loaders evict already)
        everything = (sum((dict(zip(self.names, self.sizes)) | self.keep | fixed).values())
                      + kept_bytes(self.keeper.root))
        self.copying = self.limit < everything or table.evicting
        keeps_all = not set(self.names) - set(self.keep)  # (a val loader: its shard never goes)
        copies = 0 if keeps_all else min(self.copies_each, sum(self.sizes))
        terms = self._walk_terms()
        restoring = self._restore_term(restore, sum(term.nbytes for term in terms))
        terms = [restoring] if restoring else terms
        val_bytes = sum(size for name, size in self.keep.items()
                        if name not in on_disk and name not in self.names)
        if val_bytes:  # (a val loader, an eval during training, has yet to fetch it)
            terms.append(Term("the val shard", "not on disk yet, never evicted", val_bytes))
        if copies:
            terms.append(Term("copies of buffered documents", (
                f"{copies:,} bytes (copies_estimate: twice buffer_size documents at the split's "
                f"most bytes per document) for each of {self.local_ranks} local rank(s)"),
                copies * self.local_ranks))
        own = sorted(n for n in fixed if n not in self.keep)  # (the user's, by the ledger)
        if fixed:
            kinds = ["the val shard"] if len(own) < len(fixed) else []
            if own:
                kinds.append(f"{len(own)} that the ledger {self.ledger.path} does not list as "
                             "fetched by a streaming loader")
            terms.append(Term("shards it may not evict", (
                f"{len(fixed)} in {self.data_dir}: " + " and ".join(kinds)), sum(fixed.values())))
        total = sum(term.nbytes for term in terms)
        least = total if table.evicting else min(total, everything)
        self.copies = copies if self.copying else 0
        if self.limit < least:
            raise ValueError(self._refusal(terms, least, everything, own,
                                           restoring=restoring is not None))

    def _refusal(self, terms: list[Term], least: int, everything: int, own: list[str], *,
                 restoring: bool) -> str:
        """The start check's message: the least, its terms, what lowers it, and last the one
        number to pass."""
        lines = [f"cache_limit={self.limit:,} bytes is below what this streaming loader must hold "
                 f"at once, {least:,} bytes ({size_up(least)}):"]
        lines += [f"  {term.what}: {term.how}: {term.nbytes:,} bytes" for term in terms]
        total = sum(term.nbytes for term in terms)
        if least < total:
            lines.append(f"  these add up to {total:,} bytes, more than all the shards it may hold "
                         f"and the copies kept, {everything:,} bytes: at that limit no shard is "
                         "ever evicted, so that is the least")
        elif everything < total:
            lines.append(f"  all the shards it may hold and the copies kept take {everything:,} "
                         f"bytes, less, but the ledger {self.ledger.path} says this machine's "
                         "loaders evict already: the least is the terms' sum")
        # a smaller read-ahead lowers the least (at all the data too: the sum may fall below it),
        # unless a resume's state decides what it holds
        fixes = [] if restoring else [
            "lower prefetch_shards, prefetch, tokenizer_batch_size or buffer_size"]
        kept = kept_bytes(self.keeper.root) if least < total else 0  # (in all of it)
        if own or kept:  # (another data_dir lowers the least only when this one holds something)
            held = [f"{len(own)} shard(s) no streaming loader fetched"] if own else []
            if kept:
                held.append(f"{kept:,} bytes of copies kept")
            fixes.append(f"use another data_dir: in {self.data_dir}, "
                         f"{' and '.join(held)} count against the limit")
        if fixes:
            lines.append("To need less: " + "; or ".join(fixes) + ".")
        lines.append(f"pass cache_limit={least} or more")
        return "\n".join(lines)

    def _walk_terms(self) -> list[Term]:
        """What a walk under way holds at once: the shards from the one packed from to the one
        read, those fetched ahead and one for a local rank out of step. Its terms count the split's
        largest shards, never more shards than the split has."""
        n, ahead = len(self.names), self.packing
        largest_first = sorted(self.sizes, reverse=True)
        # the shard packed from and the shard read are files on disk, whole (one when the reader
        # reads no more than the packer takes)
        ends = min(ahead.shards, 2)
        whole = min(ends + self.prefetch_shards + 1, n)
        terms = [Term("shards read, packed from and fetched ahead", (
            f"the {whole} largest whole: the one read, the one packed from, "
            f"prefetch_shards={self.prefetch_shards} ahead and one for a local rank out of step "
            f"(at most the split's {n})"), sum(largest_first[:whole]))]
        # the shards between those two: the reader has read all of them and the packer has yet to
        # pack them, so their documents (of this rank's) are among the `docs` read ahead
        middle = min(ahead.shards - ends, n - whole)
        if middle > 0:
            shards_bytes = sum(largest_first[whole:whole + middle])
            # (inf: a rank visits a shard with none of its documents; only whole shards bound it)
            docs_bytes = ahead.docs * ahead.doc_bytes if ahead.docs else 0
            if docs_bytes < shards_bytes:
                terms.append(Term("shards read between those two", (
                    f"{ahead.docs:,} documents read ahead at most, at the split's most "
                    f"{ahead.doc_bytes:,.1f} bytes of a shard per document a rank reads"),
                    math.ceil(docs_bytes)))
            else:
                terms.append(Term("shards read between those two", (
                    f"the next {middle} largest whole ({ahead.docs:,} documents read ahead span "
                    "them at most)"), shards_bytes))
        return terms

    def _restore_term(self, restore, walk: int) -> Term | None:
        """A resumed walk's first documents (a buffer's, a merged plan's), the local ranks'
        together, and the file the walk goes on in are held at once, with one for a local rank out
        of step when there are more (what is fetched ahead waits for room meanwhile): a term when
        that is more than a walk under way holds."""
        if not restore:
            return None
        largest = max(self.sizes)
        restoring = sum(self.sizes[p] for p in restore)
        step = largest * (self.local_ranks > 1 and len(restore) < len(self.names))
        if restoring + step <= walk:
            return None
        return Term("shards a resume reads first", (
            f"{len(restore)} holding the first documents of the resumed walks of this machine's "
            "ranks (their buffers, a merge's plans) and the files the walks go on in"
            + (f", and {step:,} bytes for a local rank out of step" if step else "")
            + f": more than the {walk:,} bytes a walk under way holds"), restoring + step)

    def _last_resort(self, table: Table, name: str, used: int) -> int:
        """The shard a reader waits for has no room, and the copies of buffered documents have
        outgrown the room the start check set aside (long documents can wait in a best-fit buffer
        for good). The oldest copies go, with a warning, rather than the reader waiting; a resume
        from the states of now fetches their shards again, first (still exact). Returns `used`
        less what went."""
        copies = kept_bytes(self.keeper.root)
        room = self.copies * self.local_ranks
        if used - copies > self.limit or copies <= room:  # (dropping would not help, or they fit)
            return used
        dropped = drop_oldest(self.keeper.root, table,
                              lambda gone: used - gone <= self.limit or copies - gone <= room)
        if dropped and not self._warned:
            self._warned = True
            logger.warning(
                "cache_limit=%s had no room for %s, which a reader waits for; the copies of "
                "buffered documents in %s took %s (the start check set aside %s for them): dropped "
                "%s of them, oldest first. A resume from the states of now fetches their shards "
                "again. Raise cache_limit by about %s to keep them", size_words(self.limit), name,
                self.keeper.root, size_words(copies), size_words(room), size_words(dropped),
                size_words(max(copies - room, dropped)))
        return used - dropped

    def _make_room(self, table: Table, name: str | None, extra: int = 0, *,
                   release: str | None = None, now: bool = False) -> bool:
        """Evict until shard `name` (or `extra` bytes of a copy) fits; False when it cannot yet.
        The caller holds the lock and writes `table` after. A shard goes only when no live loader
        of the machine needs it, oldest first. `release`: a shard our buffers need no more once its
        copy is written (it goes first). Gone loaders' copies go first, unless a loader is
        restoring; for a shard a reader waits for (now), the others last (_last_resort)."""
        on_disk = shard_files(self.data_dir)
        if not any(row.restoring for row in table.loaders.values()):
            # (its own copies stay while it runs, closed or not)
            remove_gone(self.keeper.root, table, set(table.loaders) | {self.owner})
        needed = set(self.keep)
        for owner, row in table.loaders.items():
            # buffered: documents not copied yet; `release` is being copied now
            needed.update(n for n, reason in row.needs.items()
                          if not (reason == "buffered" and owner == self.owner and n == release))
        in_flight = {row.fetching for row in table.loaders.values() if row.fetching}
        in_flight |= {name} if name else set()
        # a download in flight counts whole: its size from the catalog (any split's loader's)
        size_of = catalog_sizes(self.data_dir) | dict(zip(self.names, self.sizes))
        used = sum(on_disk.values()) + kept_bytes(self.keeper.root) + extra
        used += sum(max(size_of.get(n, 0) - on_disk.get(n, 0), 0) for n in in_flight)
        if self.limit is not None:
            # (a partial download stays: its own fetch resumes it)
            complete = shard_files(self.data_dir, partial=False)
            victims = [n for n in table.fetched()
                       if n in complete and n not in needed and n not in in_flight]
            # soonest: where a live loader reads a shard next, in distinct shards from now
            soonest: dict[str, int] = {}
            for row in table.loaders.values():
                for i, n in enumerate(row.later):
                    soonest[n] = min(soonest.get(n, i), i)
            # what no loader reads soon goes first (`release` before the rest, then the oldest);
            # then what is read latest
            victims.sort(key=lambda n: (n in soonest, -soonest.get(n, 0), n != release,
                                        file_mtime(os.path.join(self.data_dir, n))))
            if used > self.limit:
                table.evicting = True  # (every loader of the machine copies its buffers now)
            while used > self.limit and victims:
                victim = victims.pop(0)
                path = os.path.join(self.data_dir, victim)
                remove_if_exists(path)
                remove_if_exists(record_path(path))
                used -= complete[victim]
                table.shards[victim] = ShardRow(EVICTED, table.shards[victim].evictions + 1)
                self.evictions += 1
                logger.debug("evicted %s", victim)
            if used > self.limit and now:
                used = self._last_resort(table, name, used)
            if used > self.limit:
                return False
        self.peak_bytes = max(self.peak_bytes, used)
        missing = size_of.get(name, 0) - on_disk.get(name, 0) if name else extra
        if missing > shutil.disk_usage(self.data_dir).free:
            raise disk_full(self.data_dir, missing,
                            f"fetching {name}" if name else "a copy of buffered documents")
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
        """The shards from where the last state's walk goes on to the reader's: documents read
        and not yet packed come from them (so a later state's buffer may hold some)."""
        if self._at is None:
            return set()
        return {p for _, p in self._visits[min(self._dealt, self._at):self._at + 1]}

    def _later(self) -> tuple[str, ...]:
        """The shards this loader reads after those it needs, soonest first, as many as the budget
        could hold: the other local ranks' eviction keeps the soonest longest (a rank that lags,
        its row groups of a shard being more, finds them on disk, not fetched again)."""
        if self.limit is None or self._at is None:
            return ()
        self._fill(self.prefetch_shards + self.later_count)
        later = self._visits[self._at + 1 + self.prefetch_shards:]
        return tuple(dict.fromkeys(self.names[p] for _, p in later))[:self.later_count]

    def _needs(self) -> dict[str, str]:
        """shard name -> why this loader needs it: the first reason of REASONS that holds."""
        current = [] if self._at is None else [self._current()]
        shards = {
            "reading": current + list(self._just_read.values()),
            "waiting": list(self._waiting),
            "restoring": self._first,
            "packing": sorted(self._packing()),
            "ahead": self._ahead(),
            "buffered": sorted(self.keeper.unkept),
        }
        needs: dict[str, str] = {}
        for reason in REASONS:
            # (the val shard by name: a train split does not name it)
            names = list(self.keep) if reason == "val" else [self.names[p] for p in shards[reason]]
            for name in names:
                needs.setdefault(name, reason)  # (an earlier reason holds already: it stays)
        return needs

    def _publish(self) -> None:
        """Write this loader's row when it changed (the caller holds _cond); nothing once closed."""
        if self._stop.is_set():
            return
        record = (self._needs(), self._fetching, self.keeper.restoring, self._later())
        if record == self._published:
            return
        row = Loader(socket.gethostname(), os.getpid(), self.limit, *record,
                     started=start_time(os.getpid()))
        with self.ledger.lock:
            table = self.ledger.read()
            table.loaders[self.owner] = row
            self.ledger.write(table)
        self._published = record

    def hold(self, keys, at) -> None:
        """A state was just built: `keys` (epoch, pq_idx, rg_idx, row, ...) are the documents its
        buffer holds, and its walk goes on in file `at` (epoch, pq_idx). Their shards stay until
        those documents are kept."""
        with self._cond:
            for v in range(self._dealt, len(self._visits)):
                if self._visits[v] == tuple(at):
                    self._dealt = v
                    break
            self.keeper.hold(keys)
            if not self.copying:  # (the restored buffer is in a state now; no copies to write)
                self.keeper.restoring = False
            self._publish()
            self._cond.notify_all()

    # -- kept copies -------------------------------------------------------------------

    def _keep_documents(self) -> None:
        """Copy the documents recent states buffer from shards this loader is done packing; drop
        the copies no recent state needs (nanochat/data/streaming/kept.py)."""
        if not self.copying and self.limit is not None and self.ledger.evicting():
            self.copying = True
        with self._cond:
            if not self.keeper.pending or self._stop.is_set() or not self.copying:
                return
            self.keeper.pending = False
            skip = self._packing() | {p for p, name in enumerate(self.names) if name in self.keep}
            todo, drop = self.keeper.plan(skip)
        if drop:
            with self.ledger.lock:
                table = self.ledger.read()
                for p in drop:
                    self.keeper.remove(p, table)
                self.ledger.write(table)
            with self._cond:
                self.keeper.forget(drop)
        for p, rows in todo:
            texts = self.keeper.texts(p, rows)
            if texts is None:  # (only a shard read from copies that are gone since: refetched)
                logger.debug("the buffered documents of %s are neither on disk nor kept",
                             self.names[p])
                continue
            data = encode(texts)
            with self.ledger.lock:  # room first, as for a download: the budget holds the copies
                table = self.ledger.read()
                # (the old copy and the new, for a moment)
                room = self._make_room(table, None, len(data), release=self.names[p])
                if room:
                    self.keeper.write(p, data, table)
                self.ledger.write(table)
            with self._cond:
                if room:
                    self.keeper.kept[p] = rows
                else:  # once the other loaders of this machine move on (then this shard can go)
                    self.keeper.pending = True
        with self._cond:
            self.keeper.settle()
            self._publish()

    def kept_unit(self, p: int, rg_idx: int, rows, n: int):
        """Documents `rows` of shard p's row group rg_idx (n documents) as the reader's unit, the
        other entries None, from kept copies: when the shard is not on disk and the copies hold
        all of them; else None."""
        name = self.names[p]
        if os.path.exists(os.path.join(self.data_dir, name)):
            return None
        texts = self.keeper.restored(name)
        if any((rg_idx, row) not in texts for row in rows):
            return None
        with self._cond:
            if p in self._first:  # (it was on disk when the loader started)
                self._first.remove(p)
                self._publish()
        return pa.array([texts.get((rg_idx, row)) for row in range(n)], pa.large_string())

    # -- the fetching thread -------------------------------------------------------------

    def start(self, order, buffered=(), peers=()) -> None:
        """Begin fetching the files the walk `order` (a RankOrder) will read, visit by visit:
        first the shards of `buffered`, a resumed state's buffered documents (keys), unless
        copies kept on this machine hold them all. `peers`: what the other local ranks read first
        (peer_starts), at the same time: the start check counts it with this rank's plan."""
        first = self._to_fetch(buffered)
        starting = set(first) | set(order.plan_files(self.read_ahead))
        for buffer, plan in peers:
            try:
                keys, units = decode_keys(buffer), decode_plan(plan, order.index)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                continue  # (left to that rank's own checks of its state)
            starting.update(self._to_fetch(keys), order.plan_files(self.read_ahead, units))
        if starting:  # (with the file the walk goes on in: it is read at once too)
            self._check_budget(sorted(starting | {order.cursor[1]}))
        with self._cond:
            self._first = first
            self.keeper.restoring = bool(buffered)
            self._order = iter(order.file_visits())
            self._fill(1)
            if self._visits:
                self._at = 0
            self._fill(self.prefetch_shards)
            self._publish()
        self._thread = threading.Thread(target=self._run, name="nanochat-shards", daemon=True)
        self._thread.start()

    def _drop_unknown(self, table: Table, waited: float) -> None:
        """A reader has waited `waited` seconds for room: the rows whose liveness cannot be told
        (another host's, or one with no start time to check its pid by) count as stale, and go
        from the table (the caller holds the lock and writes it). One warning for each."""
        for owner, why in unknown_rows(table).items():
            row = table.loaders[owner]
            if owner == self.owner or not (row.needs or row.fetching or row.restoring):
                continue  # (a row that holds nothing stalls no one)
            del table.loaders[owner]
            if owner not in self._stale:
                self._stale.add(owner)
                logger.warning(
                    "%s: loader %s (host %s, pid %d) holds shards a reader has waited %.0fs for, "
                    "and whether it lives cannot be told (%s): its row is dropped as stale, and "
                    "what it held may be evicted", self.ledger.path, owner, row.host, row.pid,
                    waited, UNKNOWN[why])

    def _held(self) -> str:
        """What fills the budget, for an error: each live loader's shards and why, and the copies
        of buffered documents."""
        table = self.ledger.read()
        held = [f"{owner}{' (this loader)' if owner == self.owner else ''}: "
                + ", ".join(f"{n} ({why})" for n, why in sorted(row.needs.items()))
                for owner, row in sorted(table.loaders.items()) if row.needs]
        copies = kept_bytes(self.keeper.root)
        return "; ".join(held or ["no live loader's shards"]) + f"; {size_words(copies)} of copies"

    def _to_fetch(self, keys) -> list[int]:
        """The shards of a resumed buffer's documents (keys) to fetch first: all but those not on
        disk whose documents copies kept on this machine hold."""
        rows: dict[int, set] = {}
        for key in keys:
            rows.setdefault(key[1], set()).add((key[2], key[3]))
        return [p for p, wanted in rows.items()
                if os.path.exists(os.path.join(self.data_dir, self.names[p]))
                or not wanted <= self.keeper.restored(self.names[p]).keys()]

    def _next_target(self) -> int | None:
        """The buffer's shards, what readers wait for (earliest in the order first), the current
        shard, then the next prefetch_shards."""
        waiting = sorted(self._waiting, key=lambda p: self._first_seen.get(p, len(self._visits)))
        wanted = self._first + waiting
        wanted += ([] if self._at is None else [self._current()]) + self._ahead()
        for p in wanted:
            if p in self._ready and not os.path.exists(os.path.join(self.data_dir, self.names[p])):
                self._ready.discard(p)  # evicted since (by any loader): fetch it again, ahead
            if p not in self._ready and p not in self._failed:
                return p
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._keep_documents()
            except BaseException as e:  # (a full disk): the reader raises it at its next shard
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
                        self._cond.wait(0.5)  # no room yet: other loaders still hold it
            except BaseException as e:  # handed to the reader, which raises it
                if self._stop.is_set():
                    return
                with self._cond:
                    self._failed[target] = (e, now)
                    self._cond.notify_all()

    def _fetch(self, p: int, now: bool) -> bool:
        name, url = self.names[p], self.urls[p]
        path = os.path.join(self.data_dir, name)
        with self._cond:  # (lock order: _cond, then the ledger's lock; never the other way round)
            self._fetching = name
            self._publish()
        with self.ledger.lock:
            table = self.ledger.read()
            waited = 0.0 if self._short_since is None else time.monotonic() - self._short_since
            if waited > self.stale_wait:
                self._drop_unknown(table, waited)
            # (the last resort only for a reader waiting)
            room = self._make_room(table, name, now=p in self._waiting)
            if room and not os.path.exists(path):  # listed before it exists: a kill mid-way
                # leaves nothing unlisted
                evictions = table.shards.get(name, ShardRow(FETCHED)).evictions
                table.shards[name] = ShardRow(FETCHED, evictions)
            self.ledger.write(table)
        if not room:
            with self._cond:
                self._fetching = None
                self._publish()
            if not now:
                return False
            # the shard the reader waits for: the other loaders of this machine may still be reading
            # what fills the budget, and move on within seconds (ranks train in step); past
            # room_wait (at most the download deadline) they will not
            self._short_since = self._short_since or time.monotonic()
            if time.monotonic() - self._short_since > self.room_wait:
                raise ValueError(
                    f"cache_limit={size_words(self.limit)} has had no room for {name} for "
                    f"{self.room_wait:g}s: {self._held()} fill it (the ledger {self.ledger.path}; "
                    f"python -m nanochat.shard_cache status {self.data_dir} lists them); raise "
                    "cache_limit, or lower prefetch_shards or buffer_size")
            return False
        self._short_since = None
        try:
            # (recheck=False: the loader's start asked the source about the shards on disk)
            replaced = download_file(url, path, self.limits, stop=self._stop, streamed=True,
                                     recheck=False)
        except DownloadError as e:
            raise ConnectionError(f"could not fetch shard {name} from {shown(url)}: "
                                  f"{shown(str(e))}") from None
        finally:
            with self._cond:
                self._fetching = None
                self._publish()
        meta = open_parquet(path).metadata
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        # the size the walk was planned on, and the rows of the shard's catalog entry
        entry = read_catalog(self.data_dir, [name], [url], self.limits)[0]
        expected = {"size": self.sizes[p], "rows": entry["rows"]}
        if (os.path.getsize(path), rows) != (expected["size"], expected["rows"]):
            raise ValueError(
                f"{path} ({shown(url)}) is not the shard the walk was planned on: "
                f"{os.path.getsize(path)} bytes and {len(rows)} row groups, the catalog "
                f"{catalog_path(self.data_dir)} says {expected['size']} and "
                f"{len(expected['rows'])}; the file changed at its source. Remove the catalog to "
                "start over (states taken on the old files will be refused)")
        if replaced is not None:
            self.fetched_bytes += os.path.getsize(path)
        return True

    # -- the reader's side ---------------------------------------------------------------

    def need(self, p: int, in_order: bool = True) -> str:
        """The path of shard p once it is on disk. Moves this loader's place in its order to p when
        p is among its next visits and read in_order (not for a buffer's documents); else it is
        fetched all the same. Waits at most the downloader's deadline plus room_wait and
        NEED_MARGIN, then raises; a fetch that failed while the reader waited raises its error."""
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
                else:  # not where the order said (a buffer restored while the walk starts)
                    logger.debug("shard %s read out of the expected order", self.names[p])
            self._waiting[p] = self._waiting.get(p, 0) + 1
            self._publish()
            self._cond.notify_all()
            try:
                self._wait_ready(p)
                self._just_read[threading.get_ident()] = p  # until this thread asks for another
            finally:
                self._waiting[p] -= 1
                if not self._waiting[p]:
                    del self._waiting[p]
                self._publish()
        path = os.path.join(self.data_dir, self.names[p])
        if not os.path.exists(path):  # evicted by another loader between two visits: fetch again
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
                self._cond.notify_all()  # a fetch ahead failed (an outage since?): again, now
            if self._stop.is_set():
                raise RuntimeError("the shard cache is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shard {self.names[p]} ({shown(self.urls[p])}) is not on disk "
                                   "after "
                                   f"{self.limits.deadline + self.room_wait + NEED_MARGIN:g}s")
            self._cond.wait(min(left, 1.0))

    def close(self) -> None:
        """Stop fetching (a download in flight stops at its next read) and take this loader's row
        out of the ledger (its copies stay for a resume, until a live loader needs the room while
        none is restoring)."""
        if self._stop.is_set():  # (closed already: by the loader, then by its __del__)
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a download blocked in a read ends at its timeout
        if self._published is not None:  # (a row is written at start())
            try:
                with self.ledger.lock:
                    table = self.ledger.read()
                    table.loaders.pop(self.owner, None)
                    self.ledger.write(table)
            except OSError as e:  # (a full disk): the row goes at the next read, its process gone
                logger.debug("could not take %s out of the ledger: %s", self.owner, e)


def local_peers(rank: int, world_size: int) -> range:
    """The ranks of this machine, rank among them: torchrun numbers a node's ranks in a row
    (LOCAL_RANK, LOCAL_WORLD_SIZE); without torchrun's variables, rank alone."""
    local = os.environ.get("LOCAL_RANK", "")
    if not local.isdigit() or int(local) > rank:
        return range(rank, rank + 1)
    first = rank - int(local)
    return range(first, min(first + _local_ranks(), world_size))


def peer_starts(state, rank: int, world_size: int) -> list:
    """What the other local ranks read first from a merged state (every rank is given all of it):
    per rank, (its buffered documents' keys, its plan's items). Their shards are fetched at the
    same time as this rank's. [] for any other state (each rank has only its own)."""
    if not (isinstance(state, dict) and "merged" in state and isinstance(state.get("states"), list)
            and len(state["states"]) == world_size):
        return []
    parts = [state["states"][peer] for peer in local_peers(rank, world_size) if peer != rank]
    return [(part.get("buffer", []), part.get("plan", [])) for part in parts
            if isinstance(part, dict)]


def _local_ranks() -> int:
    """The ranks of this machine (torchrun's LOCAL_WORLD_SIZE; 1 without it): each keeps copies
    of its buffer."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return check_int("LOCAL_WORLD_SIZE", int(value) if value.isdigit() else value, 1,
                     hint=" (torchrun sets it)")


# -----------------------------------------------------------------------------
# The status command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat.shard_cache",
                                     description="What a streaming cache (stream=True) holds.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="what is on disk against cache_limit, which live "
                                 "loader needs which shard and why, the kept copies, the evicted",
                                 description="Print what a streaming cache holds: its bytes on "
                                 "disk against cache_limit, which live loader needs which shard "
                                 "and why, the kept copies of buffered documents, and the shards "
                                 "evicted.")
    status.add_argument("data_dir", nargs="?", help="the streaming cache: a loader's data_dir "
                        "(default: the dataset's directory, as the loaders find it)")
    args = parser.parse_args(argv)
    data_dir = find_data_dir() if args.data_dir is None else os.path.expanduser(args.data_dir)
    if not os.path.isdir(data_dir):
        print(f"{data_dir} is not a directory", file=sys.stderr)
        return 1
    print(describe(read_status(data_dir)))
    return 0

