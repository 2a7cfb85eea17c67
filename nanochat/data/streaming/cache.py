"""
The shard cache's reader side: each shard's path once it is on disk, fetched just ahead.
`ShardCache` fetches one split's shards ahead of its reader (a loader's stream=True) within a disk
budget, cache_limit, and keeps this loader's entry of the machine's ledger (what it needs, and why).
Its parts: the budget check (budget.py), the fetching thread (fetcher.py), eviction (eviction.py),
the order of visits (visits.py), the catalog's sizes (catalog.py) and kept copies of buffered
documents (kept.py). A budget below what must be held at once is a ValueError at the start.
Design: docs/streaming.md.

    python -m nanochat.shard_cache status [DATA_DIR]   # what is on disk, who needs it and why

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.streaming.
"""

import itertools
import logging
import os
import socket
import threading
import time
from typing import NamedTuple

import pyarrow as pa

from nanochat.data.base.checks import local_ranks
from nanochat.data.base.state import decode_keys, decode_plan
from nanochat.data.fetch.limits import Limits
from nanochat.data.streaming.budget import Budget, Disk, ReadAhead, refusal, budget_check
from nanochat.data.streaming.cache_status import CacheStatus, Own, read_status
from nanochat.data.streaming.eviction import Room, shard_files
from nanochat.data.streaming.fetcher import Fetcher
from nanochat.data.streaming.kept import Keeper, kept_bytes
from nanochat.data.streaming.ledger import REASONS, Ledger, Loader, start_time
from nanochat.data.streaming.visits import LATER_MAX, Visits
from nanochat.data.fetch.address import shown

logger = logging.getLogger(__name__)

NEED_MARGIN = 120.0  # seconds need() waits past the downloader's deadline (another rank's download)
ROOM_WAIT = 600.0  # seconds the shard a reader waits for may find no room before that is an error
# seconds a reader waits for room before the ledger's entries of unknown liveness (ledger.UNKNOWN)
# count as stale: a live loader moves on within seconds, and writes its entry again if it was one
STALE_WAIT = 30.0


class PeerFirstReads(NamedTuple):
    """What another local rank reads first from a merged state (peer_first_reads)."""
    buffer: list  # its buffered documents, as the state encodes them
    plan: list  # its plan's items


class ShardCache:
    """Fetches one split's shards just ahead of its reader, within a budget. `begin` it along the
    reader's order, `need` a shard to read it, `hold` each state's buffer, `close` at the end."""

    _count = itertools.count()

    def __init__(self, data_dir: str, names: list[str], urls: list[str], sizes: list[int], *,
                 prefetch_shards: int, cache_limit: int | None, limits: Limits,
                 keep: dict[str, int] | None = None, prefetch: int = 4, copies: int = 0,
                 packing: ReadAhead = ReadAhead(0, 2, 0.0), read_ahead: int = 0):
        self.data_dir, self.names, self.urls, self.sizes = data_dir, names, urls, sizes
        self.limit, self.limits = cache_limit, limits
        self.keep = dict(keep or {})  # name -> size: never evicted (the val shard)
        self.budget = Budget(cache_limit, names, sizes, self.keep, prefetch_shards, packing,
                             copies, local_ranks())
        self.read_ahead = read_ahead  # documents read and not yet packed, at most
        self.copying = False  # whether this loader copies them: budget check, or once one evicts
        self.ledger = Ledger(data_dir)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{next(self._count)}"
        self.keeper = Keeper(data_dir, names, self.owner, prefetch, self.ledger)
        self.room = Room(data_dir, self.budget, self.owner, self.keeper, self.ledger)
        # the shards past those it needs that this loader lists as read soon (Visits.later): as
        # many as the budget holds, a few hundred at most (the ledger stays small)
        smallest = max(min(sizes), 1)
        later_count = 0 if cache_limit is None else min(cache_limit // smallest, LATER_MAX)
        self.visits = Visits(names, prefetch_shards, later_count)
        self.cond = threading.Condition()  # guards what follows, the visits and the fetcher's
        # pq_idx -> readers waiting for it (the packing thread restores a buffer while the reading
        # thread starts the walk: two readers)
        self.waiting: dict[int, int] = {}
        self.first: list[int] = []  # shards to fetch before anything else, until first read
        self.just_read: dict[int, int] = {}  # thread -> the shard need() last gave it: it opens it
        self.published = None  # the entry last written to the ledger
        self.stop = threading.Event()
        # a reader waits this long for room the other loaders hold (they move on within seconds)
        self.room_wait = min(ROOM_WAIT, limits.deadline)
        self.stale_wait = min(STALE_WAIT, self.room_wait / 2)  # (well within room_wait)
        self.fetcher = Fetcher(self)
        self.check_budget()

    def status(self) -> CacheStatus:
        """What the cache holds now, who needs it and why, and this loader's own figures."""
        own = Own(self.owner, self.limit, self.room.peak_bytes, self.fetcher.fetched_bytes,
                  self.copying, self.room.evictions)
        return read_status(self.data_dir, own)

    def check_budget(self, restore: list[int] = ()) -> None:
        """The budget check (budget.budget_check) on the disk and ledger of now: a ValueError when
        cache_limit is below what must be held at once (`restore`: the shards of resumed walks'
        first documents), naming each term in bytes. Also decides whether this loader copies its
        buffered documents."""
        disk = None
        if self.limit is not None:
            table = self.ledger.read()  # (a snapshot: only what this loader may not evict matters)
            disk = Disk(self.data_dir, self.ledger.path, shard_files(self.data_dir, partial=False),
                        set(table.fetched()), kept_bytes(self.keeper.root), table.evicting)
        verdict = budget_check(self.budget, disk, restore)
        self.copying = self.copying if self.limit is None else verdict.copying
        self.room.copies = verdict.copies
        if self.limit is not None and self.limit < verdict.least:
            raise ValueError(refusal(self.budget, disk, verdict))

    # -- the start -----------------------------------------------------------------------

    def begin(self, order, buffered=(), peers: list[PeerFirstReads] = ()) -> None:
        """Begin fetching the files the walk `order` (a RankOrder) will read, visit by visit:
        first the shards of `buffered`, a resumed state's buffered documents (keys), unless
        copies kept on this machine hold them all. `peers`: what the other local ranks read first
        (peer_first_reads), at the same time: the budget check counts it with this rank's plan."""
        first = self.to_fetch(buffered)
        starting = set(first) | set(order.plan_files(self.read_ahead))
        for peer in peers:
            try:
                keys, units = decode_keys(peer.buffer), decode_plan(peer.plan, order.index)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                continue  # (left to that rank's own checks of its state)
            starting.update(self.to_fetch(keys), order.plan_files(self.read_ahead, units))
        if starting:  # (with the file the walk goes on in: it is read at once too)
            self.check_budget(sorted(starting | {order.cursor[1]}))
        with self.cond:
            self.first = first
            self.keeper.restoring = bool(buffered)
            self.visits.begin(iter(order.file_visits()))
            self.publish()
        self.fetcher.begin()

    def to_fetch(self, keys) -> list[int]:
        """The shards of a resumed buffer's documents (keys) to fetch first: all but those not on
        disk whose documents copies kept on this machine hold."""
        docs: dict[int, set] = {}  # pq_idx -> {(rg_idx, doc_index)}
        for key in keys:
            docs.setdefault(key.pq_idx, set()).add((key.rg_idx, key.doc_index))
        return [p for p, wanted in docs.items()
                if os.path.exists(os.path.join(self.data_dir, self.names[p]))
                or not wanted <= self.keeper.restored(self.names[p]).keys()]

    # -- the reader's side ---------------------------------------------------------------

    def need(self, p: int, in_order: bool = True) -> str:
        """The path of shard p once it is on disk. Moves this loader's place in its order to p when
        p is among its next visits and read in_order (not for a buffer's documents); else it is
        fetched all the same. Waits at most the downloader's deadline plus room_wait and
        NEED_MARGIN, then raises; a fetch that failed while the reader waited raises its error."""
        with self.cond:
            if p in self.first:
                self.first.remove(p)
            elif in_order and p != self.visits.current() and not self.visits.move_to(p):
                # not where the order said (a buffer restored while the walk starts)
                logger.debug("shard %s read out of the expected order", self.names[p])
            self.waiting[p] = self.waiting.get(p, 0) + 1
            self.publish()
            self.cond.notify_all()
            try:
                self.wait_ready(p)
                self.just_read[threading.get_ident()] = p  # until this thread asks for another
            finally:
                self.waiting[p] -= 1
                if not self.waiting[p]:
                    del self.waiting[p]
                self.publish()
        path = os.path.join(self.data_dir, self.names[p])
        if not os.path.exists(path):  # evicted by another loader between two visits: fetch again
            with self.cond:
                self.fetcher.ready.discard(p)
                self.cond.notify_all()
            return self.need(p, in_order)
        return path

    def wait_ready(self, p: int) -> None:
        """Wait (holding cond) until the fetcher has shard p on disk; raise its failure."""
        fetcher = self.fetcher
        deadline = time.monotonic() + self.limits.deadline + self.room_wait + NEED_MARGIN
        while p not in fetcher.ready:
            if fetcher.broken is not None:  # keeping documents failed: fetching has stopped
                raise fetcher.broken
            if p in fetcher.failed:
                failure = fetcher.failed.pop(p)
                if failure.waited:
                    raise failure.error
                self.cond.notify_all()  # a fetch ahead failed (an outage since?): again, now
            if self.stop.is_set():
                raise RuntimeError("the shard cache is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shard {self.names[p]} ({shown(self.urls[p])}) is not on disk "
                                   "after "
                                   f"{self.limits.deadline + self.room_wait + NEED_MARGIN:g}s")
            self.cond.wait(min(left, 1.0))

    def hold(self, keys, at) -> None:
        """A state was just built: `keys` (DocKeys, PieceKeys) are the documents its buffer holds,
        and its walk goes on in file `at` (epoch, pq_idx). Their shards stay until those documents
        are kept."""
        with self.cond:
            self.visits.deal(at)
            self.keeper.hold(keys)
            if not self.copying:  # (the restored buffer is in a state now; no copies to write)
                self.keeper.restoring = False
            self.publish()
            self.cond.notify_all()

    def kept_unit(self, p: int, rg_idx: int, doc_indices, n: int):
        """Documents `doc_indices` of shard p's row group rg_idx (n documents) as the reader's unit,
        the other entries None, from kept copies: when the shard is not on disk and the copies hold
        all of them; else None."""
        name = self.names[p]
        if os.path.exists(os.path.join(self.data_dir, name)):
            return None
        texts = self.keeper.restored(name)
        if any((rg_idx, i) not in texts for i in doc_indices):
            return None
        with self.cond:
            if p in self.first:  # (it was on disk when the loader started)
                self.first.remove(p)
                self.publish()
        return pa.array([texts.get((rg_idx, i)) for i in range(n)], pa.large_string())

    def close(self) -> None:
        """Stop fetching (a download in flight stops at its next read) and take this loader's entry
        out of the ledger (its copies stay for a resume, until a live loader needs the room while
        none is restoring)."""
        if self.stop.is_set():  # (closed already: by the loader, then by its __del__)
            return
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        if self.fetcher.thread is not None:
            # (a download blocked in a read ends at its timeout)
            self.fetcher.thread.join(timeout=1.0)
        if self.published is not None:  # (an entry is written at begin())
            try:
                with self.ledger.lock:
                    table = self.ledger.read()
                    table.loaders.pop(self.owner, None)
                    self.ledger.write(table)
            except OSError as e:  # (a full disk): the entry goes at the next read, its process gone
                logger.debug("could not take %s out of the ledger: %s", self.owner, e)

    # -- this loader's entry of the ledger ---------------------------------------------------

    def needs(self) -> dict[str, str]:
        """shard name -> why this loader needs it: the first reason of REASONS that holds."""
        current = [] if self.visits.at is None else [self.visits.current()]
        shards = {
            "reading": current + list(self.just_read.values()),
            "waiting": list(self.waiting),
            "restoring": self.first,
            "packing": sorted(self.visits.packing()),
            "ahead": self.visits.ahead(),
            "buffered": sorted(self.keeper.unkept),
        }
        needs: dict[str, str] = {}
        for reason in REASONS:
            # (the val shard by name: a train split does not name it)
            names = list(self.keep) if reason == "val" else [self.names[p] for p in shards[reason]]
            for name in names:
                needs.setdefault(name, reason)  # (an earlier reason holds already: it stays)
        return needs

    def publish(self) -> None:
        """Write this loader's entry when it changed (the caller holds cond); nothing once
        closed."""
        if self.stop.is_set():
            return
        record = (self.needs(), self.fetcher.fetching, self.keeper.restoring, self.visits.later())
        if record == self.published:
            return
        entry = Loader(socket.gethostname(), os.getpid(), self.limit, *record,
                     started=start_time(os.getpid()))
        with self.ledger.lock:
            table = self.ledger.read()
            table.loaders[self.owner] = entry
            self.ledger.write(table)
        self.published = record


def local_peers(rank: int, world_size: int) -> range:
    """The ranks of this machine, rank among them: torchrun numbers a node's ranks in a row
    (LOCAL_RANK, LOCAL_WORLD_SIZE); without torchrun's variables, rank alone."""
    local = os.environ.get("LOCAL_RANK", "")
    if not local.isdigit() or int(local) > rank:
        return range(rank, rank + 1)
    first = rank - int(local)
    return range(first, min(first + local_ranks(), world_size))


def peer_first_reads(state, rank: int, world_size: int) -> list[PeerFirstReads]:
    """What the other local ranks read first from a merged state (every rank is given all of it):
    per rank, its buffered documents and its plan's items. Their shards are fetched at the same
    time as this rank's. [] for any other state (each rank has only its own)."""
    if not (isinstance(state, dict) and "merged" in state and isinstance(state.get("states"), list)
            and len(state["states"]) == world_size):
        return []
    parts = [state["states"][peer] for peer in local_peers(rank, world_size) if peer != rank]
    return [PeerFirstReads(part.get("buffer", []), part.get("plan", [])) for part in parts
            if isinstance(part, dict)]
