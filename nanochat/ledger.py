"""
The machine-wide state of a streaming cache: one table in DATA_DIR/.stream/ledger.json, changed only
under one lock, DATA_DIR/.stream/lock. It says which live loader needs which shard and why, which
shards the streaming loaders fetched or evicted, which loader owns each kept copy of buffered
documents, and whether a loader has had to evict. A loader of this host whose process is gone (no
such pid, or a pid that now names a process started at another time) is dropped whenever the table
is read. Reading it costs one small JSON parse. Design and an example: docs/streaming.md.

May import: nanochat.checks, nanochat.files.
"""

import json
import logging
import os
import socket
from dataclasses import dataclass, field, replace

from filelock import FileLock

from nanochat.checks import is_int
from nanochat.files import file_stamp, warn_once, write_atomic

logger = logging.getLogger(__name__)

STREAM_DIR = ".stream"  # in the data directory: the ledger, its lock, the catalog, the kept copies
LEDGER = "ledger.json"
LOCK = "lock"

# why a loader needs a shard, most pressing first: a shard is listed under the first that holds
REASONS = {
    "reading": "its reader is at it (reads it, or waits for it)",
    "waiting": "a reader waits for it out of order (a resumed buffer's)",
    "restoring": "a resumed buffer's documents are in it: fetched first",
    "packing": "documents read from it are not packed yet",
    "ahead": "fetched ahead (prefetch_shards)",
    "val": "the val shard, never evicted",
    "buffered": "recent states buffer documents of it, not copied yet",
}
FETCHED, EVICTED = "fetched", "evicted"  # a shard's state in the table


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot: field 22 of /proc/<pid>/stat (Linux).
    None where there is no /proc, or no such process."""
    try:
        data, _ = _read_bytes(f"/proc/{pid}/stat")
    except OSError:
        return None
    # field 2, the command's name, is in parentheses and may hold spaces and ')': the fields after
    # its last ')' are fields 3, 4, ..., so field 22 is the 20th of them
    fields = data[data.rfind(b")") + 1:].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _alive(pid, started) -> bool:
    """Whether the process that wrote a row of this host lives: a process has its pid and, where
    the row recorded one, its start time (a pid is reused once its process is gone)."""
    if not is_int(pid) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    # (no start time recorded, or none to read without /proc: the pid alone says it)
    now = start_time(pid) if started is not None else None
    return now is None or now == started


# -----------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Loader:
    """One live loader's row: who it is and what it needs."""
    host: str
    pid: int
    cache_limit: int | None
    needs: dict[str, str]  # shard name -> reason (a key of REASONS)
    fetching: str | None = None  # the shard it downloads now: counted whole in the budget
    restoring: bool = False  # it reads a resumed buffer, maybe from gone loaders' copies: they stay
    # the shards it reads next, past those it needs, soonest first: eviction spares them longest
    later: tuple[str, ...] = ()
    started: int | None = None  # its process's start_time(pid); None: the pid alone identifies it


@dataclass(frozen=True)
class ShardRow:
    """A shard a streaming loader fetched: FETCHED (listed before its download begins), or
    EVICTED since."""
    state: str
    evictions: int = 0


@dataclass
class Table:
    """The ledger's content. Change it only between `with ledger.lock:` and ledger.write(table)."""
    loaders: dict[str, Loader] = field(default_factory=dict)  # owner (host-pid-n) -> its row
    shards: dict[str, ShardRow] = field(default_factory=dict)
    kept: dict[str, dict[str, int]] = field(default_factory=dict)  # owner -> {shard: copy's bytes}
    evicting: bool = False  # a loader has had to evict: from then on every loader copies buffers
    # the JSON it was read from: write() skips a write that would change nothing
    text: str = field(default="", repr=False, compare=False)

    def fetched(self) -> list[str]:
        """The shards a streaming loader fetched and no loader has evicted since."""
        return sorted(name for name, row in self.shards.items() if row.state == FETCHED)

    def to_json(self) -> dict:
        loaders = {owner: vars(loader) | {"later": list(loader.later)}
                   for owner, loader in self.loaders.items()}
        shards = {name: vars(row) for name, row in self.shards.items()}
        kept = {owner: copies for owner, copies in self.kept.items() if copies}  # (none: no row)
        return {"loaders": loaders, "shards": shards, "kept": kept, "evicting": self.evicting}


def _loader(value) -> Loader | None:
    """A loader row from its JSON, or None when it has the wrong shape."""
    try:
        loader = Loader(**value)
    except TypeError:  # (not a dict, or other fields)
        return None
    fine = isinstance(loader.host, str) and type(loader.pid) is int  # (type: a bool is no pid)
    fine = fine and isinstance(loader.needs, dict) and isinstance(loader.later, (list, tuple))
    fine = fine and all(isinstance(name, str) for name in loader.later)
    fine = fine and (loader.started is None or type(loader.started) is int)
    fine = fine and all(r in REASONS for r in loader.needs.values())
    return replace(loader, later=tuple(loader.later)) if fine else None


def _shard_row(value) -> ShardRow | None:
    try:
        row = ShardRow(**value)
    except TypeError:
        return None
    return row if row.state in (FETCHED, EVICTED) and type(row.evictions) is int else None


def _copies(value) -> dict[str, int] | None:
    fine = isinstance(value, dict) and all(type(n) is int for n in value.values())
    return value if fine else None


def _table(value, path: str, stamp: tuple) -> Table:
    """The table of a JSON value; a row of the wrong shape is dropped, with a warning (once for
    this version of the file: the next write replaces it)."""
    if not isinstance(value, dict):
        warn_once(logger, path, stamp, "%s is not a table; starting it afresh", path)
        return Table()
    table, bad = Table(evicting=value.get("evicting") is True), []
    parts = (("loaders", table.loaders, _loader), ("shards", table.shards, _shard_row),
             ("kept", table.kept, _copies))
    for key, part, parse in parts:
        rows = value.get(key, {})
        if not isinstance(rows, dict):
            bad.append(key)
            continue
        for name, raw in rows.items():
            row = parse(raw)
            if row is None:
                bad.append(name)
            else:
                part[name] = row
    if bad:
        warn_once(logger, path, stamp, "%s: dropped rows of the wrong shape: %s", path, bad)
    return table


class Ledger:
    """A data directory's ledger; `lock` is the directory's one lock (a FileLock: reentrant)."""

    def __init__(self, data_dir: str):
        self.directory = os.path.join(data_dir, STREAM_DIR)
        self.path = os.path.join(self.directory, LEDGER)
        # a wait polls every 5 ms (filelock's default: 50): the reader and the fetching thread take
        # it in turns, often
        self.lock = FileLock(os.path.join(self.directory, LOCK), poll_interval=0.005)
        self._seen: tuple | None = None  # (inode, mtime) of the file evicting() last read
        self._evicting = False

    def evicting(self) -> bool:
        """read().evicting, parsed again only when the file changed: a loader asks at every state,
        and a long run's table lists thousands of shards."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        seen = (stat.st_ino, stat.st_mtime_ns)  # (a write replaces the file: a new inode)
        if seen != self._seen:
            self._seen, self._evicting = seen, self.read().evicting
        return self._evicting

    def read(self) -> Table:
        """The table, less the loaders of this host whose process is gone. Without the lock held it
        is a snapshot: the file is replaced whole, so it is never half written. A bad file is
        warned about once, read as an empty table, and replaced by the next write."""
        try:
            data, stamp = _read_bytes(self.path)
        except FileNotFoundError:
            return Table()
        try:
            text = data.decode()
            table = _table(json.loads(text), self.path, stamp)
        except ValueError as e:  # (UnicodeDecodeError too)
            warn_once(logger, self.path, stamp, "%s is unreadable (%s); starting it afresh",
                      self.path, e)
            return Table()
        table.text = text
        host = socket.gethostname()
        # (another host's loaders, on a shared disk, cannot be checked from here: they stay)
        gone = [owner for owner, loader in table.loaders.items()
                if loader.host == host and not _alive(loader.pid, loader.started)]
        for owner in gone:
            del table.loaders[owner]
        return table

    def write(self, table: Table) -> None:
        """Write the table (the caller holds the lock), unless it is what was read."""
        text = json.dumps(table.to_json(), sort_keys=True)
        if text != table.text:
            # (whole or not at all: readers take no lock; one writer at a time: the lock's holder)
            write_atomic(self.path, text.encode())
            table.text = text


# os.open and os.read, not open(): a loader closed by its __del__ at interpreter exit reaches here
# when the builtins may be gone already


def _read_bytes(path: str) -> tuple[bytes, tuple]:
    """A file's bytes and which version of it this is (file_stamp)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        stamp = file_stamp(fd)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), stamp
