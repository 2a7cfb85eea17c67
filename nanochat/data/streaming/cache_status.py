"""
What a streaming cache holds, for a person: its shards, who needs them, what was evicted.
It counts the shards on disk and their bytes against cache_limit, says which live loader needs which
shard and why, and lists the copies kept for buffers and what was evicted. One record, CacheStatus,
read from the ledger and the directory under the lock (ShardCache.status(),
DataLoader.cache_status()), and its text (`python -m nanochat.shard_cache status [DATA_DIR]`).
Reading it costs a listing of the directory and one parse of the ledger.

May import: nanochat.data.streaming.ledger.
"""

import os
from dataclasses import dataclass
from typing import NamedTuple

from filelock import Timeout

from nanochat.data.streaming.ledger import EVICTED, FETCHED, REASONS, Ledger, ShardEntry, Table

LOCK_WAIT = 5.0  # seconds a status waits for the lock (held for milliseconds) before it reads as is


def size_words(nbytes: float) -> str:
    """A size in words: 20.00 GB, 95.3 MB, 8.6 KB, 612 bytes."""
    for unit, scale, digits in (("GB", 1e9, 2), ("MB", 1e6, 1), ("KB", 1e3, 1)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} bytes"


# -----------------------------------------------------------------------------
# The record


SHARD_KINDS = {
    "streamed": "fetched by a streaming loader; evicted once no live loader needs it",
    "partial": "a download under way or cut short; its next fetch resumes it",
    "yours": "not fetched by a streaming loader; never evicted",
}
# why a live loader needs a shard: its reason in the ledger, or its download in flight
NEED_REASONS = REASONS | {"fetching": "it is downloading it"}


class ShardFile(NamedTuple):
    name: str  # the shard's name (a partial download's too, without .tmp)
    bytes: int
    kind: str  # a key of SHARD_KINDS


class LiveLoader(NamedTuple):
    owner: str  # host-pid-n
    cache_limit: int | None
    restoring: bool  # it reads a resumed buffer: gone loaders' copies stay until it is done


class ShardNeed(NamedTuple):
    shard: str
    loader: str  # its owner, host-pid-n
    reason: str  # a key of NEED_REASONS


class KeptCopy(NamedTuple):
    shard: str
    loader: str  # who wrote it
    bytes: int
    live: bool  # False: its loader is gone; the copy stays for a resume until room is needed


@dataclass(frozen=True)
class CacheStatus:
    """A streaming cache's figures at one moment: ShardCache.status(), DataLoader.cache_status(),
    and `python -m nanochat.shard_cache status`. The last five fields are one loader's own (None
    from the command, which is no loader)."""
    data_dir: str
    cache_limit: int | None  # a loader's own; from the command the least of the live loaders'
    shards: tuple[ShardFile, ...]  # in the data directory, by name
    loaders: tuple[LiveLoader, ...]  # the live loaders of the ledger
    needs: tuple[ShardNeed, ...]  # by shard, then loader
    kept: tuple[KeptCopy, ...]  # the copies of buffered documents, by shard, then loader
    evicted: tuple[str, ...]  # shards evicted and not fetched again since
    evictions: int  # evictions in all, as the ledger counts them
    evicting: bool  # a loader has had to evict: every loader copies its buffers from then on
    owner: str | None  # the loader's name in the ledger
    peak_bytes: int | None  # the most its shards and copies took at once, as it measured them
    fetched_bytes: int | None  # what it downloaded
    copying: bool | None  # whether it copies its buffered documents
    own_evictions: int | None = None  # the shards it evicted (`evictions` counts every loader's)

    @property
    def shard_bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    @property
    def kept_bytes(self) -> int:
        return sum(copy.bytes for copy in self.kept)

    @property
    def used_bytes(self) -> int:
        """What cache_limit bounds: the shards, partial downloads included, and the copies."""
        return self.shard_bytes + self.kept_bytes


def _shard_files(data_dir: str, table: Table) -> tuple[ShardFile, ...]:
    """The shard files of the data directory, each with its kind."""
    files = []
    with os.scandir(data_dir) as entries:
        for entry in entries:
            name = entry.name.removesuffix(".tmp")
            if not name.endswith(".parquet"):
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # (evicted since it was listed)
                continue
            fetched = table.shards.get(name, ShardEntry(EVICTED)).state == FETCHED
            kind = "partial" if entry.name.endswith(".tmp") else "streamed" if fetched else "yours"
            files.append(ShardFile(name, size, kind))
    return tuple(sorted(files))


class Own(NamedTuple):
    """One loader's own figures: the last fields of CacheStatus, and its cache_limit."""
    owner: str | None
    cache_limit: int | None
    peak_bytes: int | None
    fetched_bytes: int | None
    copying: bool | None
    evictions: int | None = None


def read_status(data_dir: str, own: Own | None = None) -> CacheStatus:
    """What a streaming cache holds, who needs it and why: the ledger and the directory, read under
    the lock. `own`: the figures of the loader that asks (ShardCache.status())."""
    ledger = Ledger(data_dir)
    if not os.path.isdir(ledger.directory):  # never streamed into (and looking creates nothing)
        return _status(data_dir, Table(), own)
    try:  # under the lock: no eviction between reading the ledger and listing the files
        with ledger.lock.acquire(timeout=LOCK_WAIT):
            return _status(data_dir, ledger.read(), own)
    except Timeout:  # (a process stopped while it held the lock): the figures as they are
        return _status(data_dir, ledger.read(), own)


def _status(data_dir: str, table: Table, own: Own | None) -> CacheStatus:
    """The record of a table and the shard files of its directory."""
    live = tuple(LiveLoader(owner, entry.cache_limit, entry.restoring)
                 for owner, entry in sorted(table.loaders.items()))
    needs = [ShardNeed(name, owner, reason) for owner, entry in table.loaders.items()
             for name, reason in entry.needs.items()]
    needs += [ShardNeed(entry.fetching, owner, "fetching") for owner, entry in table.loaders.items()
              if entry.fetching]
    kept = [KeptCopy(name, owner, size, owner in table.loaders)
            for owner, copies in table.kept.items() for name, size in copies.items()]
    if own is None:  # the command, no loader: the least cache_limit of the live loaders
        limits = [entry.cache_limit for entry in live if entry.cache_limit is not None]
        own = Own(None, min(limits, default=None), None, None, None)
    return CacheStatus(
        data_dir=data_dir, cache_limit=own.cache_limit, shards=_shard_files(data_dir, table),
        loaders=live,
        needs=tuple(sorted(needs)), kept=tuple(sorted(kept)),
        evicted=tuple(sorted(n for n, entry in table.shards.items() if entry.state == EVICTED)),
        evictions=sum(entry.evictions for entry in table.shards.values()), evicting=table.evicting,
        owner=own.owner, peak_bytes=own.peak_bytes, fetched_bytes=own.fetched_bytes,
        copying=own.copying, own_evictions=own.evictions)


# -----------------------------------------------------------------------------
# For a person


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def describe(status: CacheStatus, most: int = 10) -> str:
    """The status for a person: sizes in words, one line per shard need with its reason. `most`:
    the evicted shards named (a long run evicts thousands)."""
    limit = status.cache_limit
    shards = _count(len(status.shards), "shard file", "shard files")
    copies = _count(len(status.kept), "kept copy", "kept copies")
    lines = [f"streaming cache in {status.data_dir}",
             f"on disk: {size_words(status.used_bytes)}: {shards}, "
             f"{size_words(status.shard_bytes)}, and {copies}, {size_words(status.kept_bytes)}",
             "cache_limit: none (no live loader has one)" if limit is None else
             f"cache_limit: {size_words(limit)}, {100 * status.used_bytes / limit:.0f}% used"]
    names = [s.name for s in status.shards] + [n.shard for n in status.needs]
    width = max(map(len, names + [k.shard for k in status.kept]), default=0)  # (columns line up)
    lines += [f"  {s.name:<{width}}  {size_words(s.bytes):>11}  {s.kind}" for s in status.shards]
    kinds = sorted({s.kind for s in status.shards})
    lines += [f"  ({kind}: {SHARD_KINDS[kind]})" for kind in kinds]  # (a legend)
    lines.append(f"live loaders: {len(status.loaders)}")
    for entry in status.loaders:
        cap = entry.cache_limit
        limit = "no cache_limit" if cap is None else f"cache_limit {size_words(cap)}"
        restoring = ", restoring a buffer" if entry.restoring else ""
        lines.append(f"  {entry.owner}: {limit}{restoring}")
    lines.append(f"needs of the live loaders: {len(status.needs)}")
    lines += [f"  {n.shard:<{width}}  {n.loader}  {n.reason}: {NEED_REASONS[n.reason]}"
              for n in status.needs]
    lines.append(f"kept for buffers (.stream/kept): {_count(len(status.kept), 'copy', 'copies')}")
    for k in status.kept:
        gone = "" if k.live else " (gone: kept for a resume)"
        lines.append(f"  {k.shard:<{width}}  {k.loader}{gone}  {size_words(k.bytes)}")
    evicted = ", ".join(status.evicted[:most]) or "none"
    if len(status.evicted) > most:
        evicted += f" and {len(status.evicted) - most} more"
    lines.append(f"evicted, not fetched since: {evicted} "
                 f"({_count(status.evictions, 'eviction', 'evictions')} in all)")
    return "\n".join(lines)
