"""
The shard cache's fetching thread: one download at a time, the shard a reader needs first.
The order: a resumed buffer's shards, one a reader waits for, the current one, then
prefetch_shards ahead; each after room is made for it, and checked against the catalog once on
disk. Between downloads, the copies of buffered documents. A failure is handed to the reader that
needs the shard. Costs one thread and one download in flight per loader.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.streaming.cache_status,
nanochat.data.streaming.catalog, nanochat.data.streaming.kept, nanochat.data.streaming.ledger.
"""

import logging
import os
import threading
import time
from typing import NamedTuple

from nanochat.data.fetch.errors import DownloadError
from nanochat.data.fetch.download import download_file
from nanochat.data.streaming.cache_status import size_words
from nanochat.data.streaming.catalog import catalog_path, read_catalog
from nanochat.data.streaming.kept import encode
from nanochat.data.streaming.ledger import FETCHED, ShardEntry
from nanochat.data.base.datasets import open_parquet
from nanochat.data.fetch.address import shown

logger = logging.getLogger(__name__)


class Failure(NamedTuple):
    """Why a shard's fetch failed, for the reader that needs it."""
    error: BaseException
    waited: bool  # a reader waited for it (else it was fetched ahead: tried again when needed)


class Fetcher:
    """The thread of one ShardCache (`cache`: its lock, its visits, what its readers wait for).
    `ready` and `failed` say how each shard's fetch went; change them holding cache.cond."""

    def __init__(self, cache):
        self.cache = cache
        self.ready: set[int] = set()
        self.failed: dict[int, Failure] = {}  # pq_idx -> why its fetch failed
        self.fetching: str | None = None  # the shard downloading now
        self.broken: BaseException | None = None  # why the thread stopped, if it did
        self.short_since: float | None = None  # since when a shard a reader waits for has no room
        self.fetched_bytes = 0  # what this cache downloaded
        self.thread: threading.Thread | None = None

    def begin(self) -> None:
        self.thread = threading.Thread(target=self.run, name="nanochat-shards", daemon=True)
        self.thread.start()

    def run(self) -> None:
        cache = self.cache
        while not cache.stop.is_set():
            try:
                self.keep_documents()
            except BaseException as e:  # (a full disk): the reader raises it at its next shard
                with cache.cond:
                    self.broken = e
                    cache.cond.notify_all()
                return
            with cache.cond:
                target = self.next_target()
                if target is None:
                    cache.cond.wait(1.0)
                    continue
                now = (target == cache.visits.current() or target in cache.waiting
                       or target in cache.first)
            try:
                if self.fetch(target, now):
                    with cache.cond:
                        self.ready.add(target)
                        cache.cond.notify_all()
                else:
                    with cache.cond:
                        cache.cond.wait(0.5)  # no room yet: other loaders still hold it
            except BaseException as e:  # handed to the reader, which raises it
                if cache.stop.is_set():
                    return
                with cache.cond:
                    self.failed[target] = Failure(e, now)
                    cache.cond.notify_all()

    def next_target(self) -> int | None:
        """The buffer's shards, what readers wait for (earliest in the order first), the current
        shard, then the next prefetch_shards."""
        cache, visits = self.cache, self.cache.visits
        waiting = sorted(cache.waiting, key=visits.first_visit)
        wanted = cache.first + waiting
        wanted += ([] if visits.at is None else [visits.current()]) + visits.ahead()
        for p in wanted:
            if p in self.ready and not os.path.exists(os.path.join(cache.data_dir,
                                                                   cache.names[p])):
                self.ready.discard(p)  # evicted since (by any loader): fetch it again, ahead
            if p not in self.ready and p not in self.failed:
                return p
        return None

    def set_fetching(self, name: str | None) -> None:
        with self.cache.cond:  # (lock order: cond, then the ledger's lock; never the other way)
            self.fetching = name
            self.cache.publish()

    def fetch(self, p: int, now: bool) -> bool:
        """Make room for shard p and download it; False when there is no room yet. `now`: a
        reader needs it now (past room_wait without room, that is an error)."""
        cache = self.cache
        name = cache.names[p]
        path = os.path.join(cache.data_dir, name)
        self.set_fetching(name)
        with cache.ledger.lock:
            table = cache.ledger.read()
            waited = 0.0 if self.short_since is None else time.monotonic() - self.short_since
            if waited > cache.stale_wait:
                cache.room.drop_unknown(table, waited)
            # (the last resort only for a reader waiting)
            room = cache.room.make(table, name, now=p in cache.waiting)
            if room and not os.path.exists(path):  # listed before it exists: a kill mid-way
                # leaves nothing unlisted
                evictions = table.shards.get(name, ShardEntry(FETCHED)).evictions
                table.shards[name] = ShardEntry(FETCHED, evictions)
            cache.ledger.write(table)
        if not room:
            self.set_fetching(None)
            if now:
                self.check_wait(name)
            return False
        self.short_since = None
        try:
            replaced = self.download(p, path)
        finally:
            self.set_fetching(None)
        self.verify(p, path)
        if replaced is not None:
            self.fetched_bytes += os.path.getsize(path)
        return True

    def check_wait(self, name: str) -> None:
        """The shard the reader waits for has no room: the other loaders of this machine may still
        be reading what fills the budget, and move on within seconds (ranks train in step); past
        room_wait (at most the download deadline) they will not: a ValueError."""
        cache = self.cache
        self.short_since = self.short_since or time.monotonic()
        if time.monotonic() - self.short_since > cache.room_wait:
            raise ValueError(
                f"cache_limit={size_words(cache.limit)} has had no room for {name} for "
                f"{cache.room_wait:g}s: {cache.room.held()} fill it (the ledger "
                f"{cache.ledger.path}; python -m nanochat.shard_cache status {cache.data_dir} "
                "lists them); raise cache_limit, or lower prefetch_shards or buffer_size")

    def download(self, p: int, path: str):
        """Download shard p to path; download_file's answer (None: it was on disk already)."""
        name, url = self.cache.names[p], self.cache.urls[p]
        try:
            # (recheck=False: the loader's start asked the source about the shards on disk)
            return download_file(url, path, self.cache.limits, stop=self.cache.stop,
                                 streamed=True, recheck=False)
        except DownloadError as e:
            raise ConnectionError(f"could not fetch shard {name} from {shown(url)}: "
                                  f"{shown(str(e))}") from None

    def verify(self, p: int, path: str) -> None:
        """A ValueError unless shard p on disk is the shard the walk was planned on."""
        cache = self.cache
        name, url = cache.names[p], cache.urls[p]
        meta = open_parquet(path).metadata
        docs_per_group = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        # the size the walk was planned on, and the documents per row group of its catalog entry
        size, planned = cache.sizes[p], read_catalog(cache.data_dir, [name], [url],
                                                     cache.limits)[0]["rows"]
        if (os.path.getsize(path), docs_per_group) != (size, planned):
            raise ValueError(
                f"{path} ({shown(url)}) is not the shard the walk was planned on: "
                f"{os.path.getsize(path)} bytes and {len(docs_per_group)} row groups, the catalog "
                f"{catalog_path(cache.data_dir)} says {size} and {len(planned)}; the file changed "
                "at its source. Remove the catalog to start over (states taken on the old files "
                "will be refused)")

    # -- kept copies -------------------------------------------------------------------

    def keep_documents(self) -> None:
        """Copy the documents recent states buffer from shards this loader is done packing; drop
        the copies no recent state needs (nanochat/data/streaming/kept.py)."""
        cache, keeper = self.cache, self.cache.keeper
        if not cache.copying and cache.limit is not None and cache.ledger.evicting():
            cache.copying = True
        with cache.cond:
            if not keeper.pending or cache.stop.is_set() or not cache.copying:
                return
            keeper.pending = False
            skip = cache.visits.packing() | {p for p, name in enumerate(cache.names)
                                             if name in cache.keep}
            plan = keeper.plan(skip)
        if plan.drop:
            with cache.ledger.lock:
                table = cache.ledger.read()
                for p in plan.drop:
                    keeper.remove(p, table)
                cache.ledger.write(table)
            with cache.cond:
                keeper.forget(plan.drop)
        for copy in plan.todo:
            self.keep_copy(copy.p, copy.docs)
        with cache.cond:
            keeper.settle()
            cache.publish()

    def keep_copy(self, p: int, docs: frozenset) -> None:
        """Write our copy of documents `docs` {(rg_idx, doc_index)} of shard p, once there is room
        for it."""
        cache, keeper = self.cache, self.cache.keeper
        texts = keeper.texts(p, docs)
        if texts is None:  # (only a shard read from copies that are gone since: refetched)
            logger.debug("the buffered documents of %s are neither on disk nor kept",
                         cache.names[p])
            return
        data = encode(texts)
        with cache.ledger.lock:  # room first, as for a download: the budget holds the copies
            table = cache.ledger.read()
            # (the old copy and the new, for a moment)
            room = cache.room.make(table, None, len(data), release=cache.names[p])
            if room:
                keeper.write(p, data, table)
            cache.ledger.write(table)
        with cache.cond:
            if room:
                keeper.kept[p] = docs
            else:  # once the other loaders of this machine move on (then this shard can go)
                keeper.pending = True
