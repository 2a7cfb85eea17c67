"""
Room in the cache for a download or a copy: the budget's evictions, carried out on disk.
The disk's and the ledger's figures go to the budget's decisions (budget.py), and the shards it
picks are removed. A shard goes only when no live loader of the machine needs it; for a shard a
reader waits for, the oldest copies of buffered documents go last, and entries of unknown liveness
count as stale after a bounded wait. Each call lists the data directory and the kept copies: a few
ms. Design: docs/streaming.md.

May import: nanochat.data.base.files, nanochat.data.fetch, nanochat.data.streaming.budget,
nanochat.data.streaming.cache_status, nanochat.data.streaming.catalog,
nanochat.data.streaming.kept, nanochat.data.streaming.ledger.
"""

import logging
import os
import shutil

from nanochat.data.base.files import disk_full, remove_if_exists
from nanochat.data.fetch.records import record_path
from nanochat.data.streaming.budget import Budget, eviction_order, evictions, needed
from nanochat.data.streaming.cache_status import size_words
from nanochat.data.streaming.catalog import catalog_sizes
from nanochat.data.streaming.kept import Keeper, drop_oldest, file_mtime, kept_bytes, remove_gone
from nanochat.data.streaming.ledger import (EVICTED, UNKNOWN, Ledger, ShardEntry, Table,
                                            unknown_entries)

logger = logging.getLogger(__name__)


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


class Room:
    """One loader's evictions: `make` room under the ledger's lock, and its figures (evictions,
    peak_bytes)."""

    def __init__(self, data_dir: str, budget: Budget, owner: str, keeper: Keeper, ledger: Ledger):
        self.data_dir, self.budget, self.owner = data_dir, budget, owner
        self.keeper, self.ledger = keeper, ledger
        self.copies = 0  # the room the budget check set aside for one rank's copies
        self.evictions = 0  # shards this cache evicted to stay within cache_limit
        self.peak_bytes = 0  # the most the shards and kept copies took at once, as measured here
        self.warned = False  # (the last resort's warning, once)
        self.stale: set[str] = set()  # the entries of unknown liveness dropped (and warned about)

    def make(self, table: Table, name: str | None, extra: int = 0, *,
             release: str | None = None, now: bool = False) -> bool:
        """Evict until shard `name` (or `extra` bytes of a copy) fits; False when it cannot yet.
        The caller holds the lock and writes `table` after. A shard goes only when no live loader
        of the machine needs it, oldest first. `release`: a shard our buffers need no more once its
        copy is written (it goes first). Gone loaders' copies go first, unless a loader is
        restoring; for a shard a reader waits for (now), the others last (last_resort)."""
        on_disk = shard_files(self.data_dir)
        if not any(entry.restoring for entry in table.loaders.values()):
            # (its own copies stay while it runs, closed or not)
            remove_gone(self.keeper.root, table, set(table.loaders) | {self.owner})
        in_flight = {entry.fetching for entry in table.loaders.values() if entry.fetching}
        in_flight |= {name} if name else set()
        # a download in flight counts whole: its size from the catalog (any split's loader's)
        size_of = catalog_sizes(self.data_dir) | dict(zip(self.budget.names, self.budget.sizes))
        used = sum(on_disk.values()) + kept_bytes(self.keeper.root) + extra
        used += sum(max(size_of.get(n, 0) - on_disk.get(n, 0), 0) for n in in_flight)
        limit = self.budget.limit
        if limit is not None:
            used = self.evict(table, used, release, in_flight)
            if used > limit and now:
                used = self.last_resort(table, name, used)
            if used > limit:
                return False
        self.peak_bytes = max(self.peak_bytes, used)
        missing = size_of.get(name, 0) - on_disk.get(name, 0) if name else extra
        if missing > shutil.disk_usage(self.data_dir).free:
            raise disk_full(self.data_dir, missing,
                            f"fetching {name}" if name else "a copy of buffered documents")
        return True

    def evict(self, table: Table, used: int, release: str | None, in_flight: set[str]) -> int:
        """Remove the shards the budget picks until `used` bytes fit the limit, if they can (none
        needed or in flight); returns `used` less what went."""
        held = needed(table.loaders, self.budget.keep, self.owner, release)
        # (a partial download stays: its own fetch resumes it)
        complete = shard_files(self.data_dir, partial=False)
        victims = [n for n in table.fetched()
                   if n in complete and n not in held and n not in in_flight]
        mtimes = {n: file_mtime(os.path.join(self.data_dir, n)) for n in victims}
        candidates = eviction_order(victims, table.loaders, release, mtimes)
        if used > self.budget.limit:
            table.evicting = True  # (every loader of the machine copies its buffers now)
        for victim in evictions(used, self.budget.limit, candidates, complete):
            path = os.path.join(self.data_dir, victim)
            remove_if_exists(path)
            remove_if_exists(record_path(path))
            used -= complete[victim]
            table.shards[victim] = ShardEntry(EVICTED, table.shards[victim].evictions + 1)
            self.evictions += 1
            logger.debug("evicted %s", victim)
        return used

    def last_resort(self, table: Table, name: str, used: int) -> int:
        """The shard a reader waits for has no room, and the copies of buffered documents have
        outgrown the room the budget check set aside (long documents can wait in a best-fit buffer
        for good). The oldest copies go, with a warning, rather than the reader waiting; a resume
        from the states of now fetches their shards again, first (still exact). Returns `used`
        less what went."""
        limit = self.budget.limit
        copies = kept_bytes(self.keeper.root)
        room = self.copies * self.budget.local_ranks
        if used - copies > limit or copies <= room:  # (dropping would not help, or they fit)
            return used
        dropped = drop_oldest(self.keeper.root, table,
                              lambda gone: used - gone <= limit or copies - gone <= room)
        if dropped and not self.warned:
            self.warned = True
            logger.warning(
                "cache_limit=%s had no room for %s, which a reader waits for; the copies of "
                "buffered documents in %s took %s (the budget check set aside %s for them): "
                "dropped %s of them, oldest first. A resume from the states of now fetches their "
                "shards again. Raise cache_limit by about %s to keep them", size_words(limit), name,
                self.keeper.root, size_words(copies), size_words(room), size_words(dropped),
                size_words(max(copies - room, dropped)))
        return used - dropped

    def drop_unknown(self, table: Table, waited: float) -> None:
        """A reader has waited `waited` seconds for room: the entries whose liveness cannot be told
        (another host's, or one with no start time to check its pid by) count as stale, and go
        from the table (the caller holds the lock and writes it). One warning for each."""
        for owner, why in unknown_entries(table).items():
            entry = table.loaders[owner]
            if owner == self.owner or not (entry.needs or entry.fetching or entry.restoring):
                continue  # (an entry that holds nothing stalls no one)
            del table.loaders[owner]
            if owner not in self.stale:
                self.stale.add(owner)
                logger.warning(
                    "%s: loader %s (host %s, pid %d) holds shards a reader has waited %.0fs for, "
                    "and whether it lives cannot be told (%s): its entry is dropped as stale, and "
                    "what it held may be evicted", self.ledger.path, owner, entry.host, entry.pid,
                    waited, UNKNOWN[why])

    def held(self) -> str:
        """What fills the budget, for an error: each live loader's shards and why, and the copies
        of buffered documents."""
        table = self.ledger.read()
        held = [f"{owner}{' (this loader)' if owner == self.owner else ''}: "
                + ", ".join(f"{n} ({why})" for n, why in sorted(entry.needs.items()))
                for owner, entry in sorted(table.loaders.items()) if entry.needs]
        copies = kept_bytes(self.keeper.root)
        return "; ".join(held or ["no live loader's shards"]) + f"; {size_words(copies)} of copies"
