"""
The machine-wide state of a streaming cache: one table in DATA_DIR/.stream/ledger.json.
It is changed only under one lock, DATA_DIR/.stream/lock. It says which live loader needs which
shard and why, which shards the streaming loaders fetched or evicted, which loader owns each kept
copy of buffered documents, and whether a loader has had to evict. A loader of this host whose
process is gone (no such pid, or a pid that now names a process started at another time) is dropped
whenever the table is read. A damaged or missing file is rebuilt from the disk: the shards whose
download records say a streaming loader fetched them, and the kept copies. Reading it costs one
small JSON parse (a rebuild, once per damaged version: a listing of the directory). Design:
docs/streaming.md.

May import: nanochat.data.base.checks, nanochat.data.fetch.records, nanochat.data.base.files.
"""

import json
import logging
import os
import socket
from dataclasses import dataclass, field, replace

from filelock import FileLock

from nanochat.data.base.checks import is_int
from nanochat.data.fetch.records import record_path
from nanochat.data.base.files import file_stamp, warn_once, write_atomic

logger = logging.getLogger(__name__)

STREAM_DIR = ".stream"  # in the data directory: the ledger, its lock, the catalog, the kept copies
LEDGER = "ledger.json"
LOCK = "lock"
KEPT_DIR = "kept"  # in STREAM_DIR: a directory per loader, a file of kept documents per shard
KEPT_SUFFIX = ".json.gz"  # {"sha256": ..., "docs": [[rg_idx, doc_index, text], ...]} (kept.py)

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


# why an entry's liveness cannot be told from here: such an entry pins its shards for one bounded
# wait of a reader (ShardCache), then counts as stale
UNKNOWN = {
    "another host": "an entry of another host: its process cannot be checked from here",
    "no start time": "no start time recorded (an older writer): a reused pid would pass for it",
    "no /proc": "its process's start time cannot be read (no /proc)",
}


def liveness(loader: "Loader", host: str) -> str:
    """Whether the process that wrote an entry lives: "alive", "gone" (no process has its pid, or
    one started at another time: a pid is reused once its process is gone), or a key of UNKNOWN."""
    if loader.host != host:
        return "another host"
    if not is_int(loader.pid) or loader.pid <= 0:
        return "gone"
    try:
        os.kill(loader.pid, 0)  # signal 0: only the check that the process exists
    except ProcessLookupError:
        return "gone"
    except PermissionError:  # another user's process: its start time says whether it is the entry's
        pass
    if loader.started is None:
        return "no start time"
    now = start_time(loader.pid)
    return "no /proc" if now is None else "alive" if now == loader.started else "gone"


def unknown_entries(table: "Table") -> dict[str, str]:
    """owner -> why its liveness cannot be told (a key of UNKNOWN), for every such loader's
    entry."""
    host = socket.gethostname()
    return {owner: why for owner, entry in table.loaders.items()
            if (why := liveness(entry, host)) in UNKNOWN}


# -----------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Loader:
    """One live loader's entry: who it is and what it needs."""
    host: str
    pid: int
    cache_limit: int | None
    needs: dict[str, str]  # shard name -> reason (a key of REASONS)
    fetching: str | None = None  # the shard it downloads now: counted whole in the budget
    restoring: bool = False  # it reads a resumed buffer, maybe from gone loaders' copies: they stay
    # the shards it reads next, past those it needs, soonest first: eviction spares them longest
    later: tuple[str, ...] = ()
    started: int | None = None  # its process's start_time(pid); None: liveness unknown (UNKNOWN)


@dataclass(frozen=True)
class ShardEntry:
    """A shard a streaming loader fetched: FETCHED (listed before its download begins), or
    EVICTED since."""
    state: str
    evictions: int = 0


@dataclass
class Table:
    """The ledger's content. Change it only between `with ledger.lock:` and ledger.write(table)."""
    loaders: dict[str, Loader] = field(default_factory=dict)  # owner (host-pid-n) -> its entry
    shards: dict[str, ShardEntry] = field(default_factory=dict)
    kept: dict[str, dict[str, int]] = field(default_factory=dict)  # owner -> {shard: copy's bytes}
    evicting: bool = False  # a loader has had to evict: from then on every loader copies buffers
    # the JSON it was read from: write() skips a write that would change nothing
    text: str = field(default="", repr=False, compare=False)

    def fetched(self) -> list[str]:
        """The shards a streaming loader fetched and no loader has evicted since."""
        return sorted(name for name, entry in self.shards.items() if entry.state == FETCHED)

    def to_json(self) -> dict:
        loaders = {owner: vars(loader) | {"later": list(loader.later)}
                   for owner, loader in self.loaders.items()}
        shards = {name: vars(entry) for name, entry in self.shards.items()}
        kept = {owner: copies for owner, copies in self.kept.items() if copies}  # (none: no entry)
        return {"loaders": loaders, "shards": shards, "kept": kept, "evicting": self.evicting}


def _loader(value) -> Loader | None:
    """A loader's entry from its JSON, or None when it has the wrong shape."""
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


def _shard_entry(value) -> ShardEntry | None:
    try:
        entry = ShardEntry(**value)
    except TypeError:
        return None
    return entry if entry.state in (FETCHED, EVICTED) and type(entry.evictions) is int else None


def _copies(value) -> dict[str, int] | None:
    fine = isinstance(value, dict) and all(type(n) is int for n in value.values())
    return value if fine else None


PARTS = ("loaders", "shards", "kept", "evicting")


def _table(value) -> tuple[Table, list[str], set[str]]:
    """The table of a JSON value less its entries of the wrong shape; what was wrong (a part, or an
    entry's name), and the parts it lost, whole or in part: those the disk fills in (rebuild). A
    loader's entry of the wrong shape is dropped alone: no disk holds it."""
    if not isinstance(value, dict):
        return Table(), ["not a table"], set(PARTS)
    table, bad, lost = Table(evicting=value.get("evicting") is True), [], set()
    if type(value.get("evicting")) is not bool:
        bad.append("evicting")
        lost.add("evicting")
    parts = (("loaders", table.loaders, _loader), ("shards", table.shards, _shard_entry),
             ("kept", table.kept, _copies))
    for key, part, parse in parts:
        entries = value.get(key)
        if not isinstance(entries, dict):
            bad.append(key)
            lost.add(key)
            continue
        for name, raw in entries.items():
            entry = parse(raw)
            if entry is None:
                bad.append(name)
                lost.update([key] if key != "loaders" else [])
            else:
                part[name] = entry
    return table, bad, lost


def rebuild(data_dir: str) -> Table:
    """What the disk says of a data directory's table: a shard is FETCHED when its download record
    says a streaming loader fetched it ("streamed": true), each kept copy is its directory's
    loader's, and evicting is set when copies are kept (a loader copies its buffered documents
    only when shards are evicted, or its cache_limit cannot hold them all). No loader's entry: a
    live loader writes its own again at its next change."""
    table = Table()
    for name in listdir(data_dir):
        if name.endswith(".parquet") and _streamed(record_path(os.path.join(data_dir, name))):
            table.shards[name] = ShardEntry(FETCHED)
    root = os.path.join(data_dir, STREAM_DIR, KEPT_DIR)
    for owner in listdir(root):
        for name in listdir(os.path.join(root, owner)):
            if name.endswith(KEPT_SUFFIX):  # (not a killed writer's .tmp)
                try:
                    size = os.stat(os.path.join(root, owner, name)).st_size
                except FileNotFoundError:  # (removed by a loader since it was listed)
                    continue
                table.kept.setdefault(owner, {})[name.removesuffix(KEPT_SUFFIX)] = size
    table.evicting = bool(table.kept)
    return table


def _streamed(path: str) -> bool:
    """Whether the download record at path says a streaming loader fetched its shard."""
    try:
        record = json.loads(_read_bytes(path)[0])
    except (OSError, ValueError):  # (no record, or a bad one: not known to be streamed)
        return False
    return isinstance(record, dict) and record.get("streamed") is True


def listdir(path: str) -> list[str]:
    """The names in a directory; none when it is not there."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _rebuilt_words(disk: Table, lost: set[str]) -> str:
    """What a rebuild took from the disk, for its warning."""
    words = []
    if "shards" in lost:
        words.append(f"{len(disk.shards)} shard(s) whose download records say a streaming loader "
                     "fetched them (evictable)")
    if "kept" in lost:
        copies = sum(len(copies) for copies in disk.kept.values())
        words.append(f"{copies} kept cop(ies) of {len(disk.kept)} loader(s)")
    if "evicting" in lost:
        words.append("evicting: " + ("yes, as copies of buffered documents are kept" if
                                     disk.evicting else "no, as no copies are kept"))
    if "loaders" in lost:
        words.append("no loader entries (a live loader writes its own again at its next change)")
    return "; ".join(words)


class Ledger:
    """A data directory's ledger; `lock` is the directory's one lock (a FileLock: reentrant)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.directory = os.path.join(data_dir, STREAM_DIR)
        self.path = os.path.join(self.directory, LEDGER)
        # a wait polls every 5 ms (filelock's default: 50): the reader and the fetching thread take
        # it in turns, often
        self.lock = FileLock(os.path.join(self.directory, LOCK), poll_interval=0.005)
        self._seen: tuple | None = None  # (inode, mtime) of the file evicting() last read
        self._evicting = False
        # (the version of a damaged file, and the table rebuilt for it): rebuilt once, not at
        # every read until the next write replaces it
        self._rebuilt: tuple[tuple, dict] | None = None

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
        is a snapshot: the file is replaced whole, so it is never half written. A damaged file
        (not JSON, not a table, a part or entry of the wrong shape), or none beside shards streaming
        fetched, is rebuilt from the disk (rebuild) with one warning; the next write replaces it."""
        try:
            data, stamp = _read_bytes(self.path)
        except FileNotFoundError:
            data, stamp = None, None
        table = self._parse(data, stamp)
        host = socket.gethostname()
        # (another host's loaders, on a shared disk, cannot be checked from here: they stay)
        gone = [owner for owner, entry in table.loaders.items() if liveness(entry, host) == "gone"]
        for owner in gone:
            del table.loaders[owner]
        return table

    def _parse(self, data: bytes | None, stamp: tuple | None) -> Table:
        """The table of the file's bytes (None: there is no file), a damaged one's parts filled in
        from the disk."""
        if data is None:
            table, lost, problem = Table(), set(PARTS), " is missing"
        else:
            try:
                text = data.decode()
                value = json.loads(text)
                table, bad, lost = _table(value)
                problem = (f": dropped parts or entries of the wrong shape: {bad}"
                           if isinstance(value, dict) else " is not a table")
            except ValueError as e:  # (UnicodeDecodeError too)
                table, bad, lost, problem = Table(), [], set(PARTS), f" is unreadable ({e})"
            if not lost:  # (only loaders' entries dropped: a live loader writes its own again)
                if bad:
                    warn_once(logger, self.path, stamp,
                              "%s: dropped entries of the wrong shape: %s", self.path, bad)
                table.text = text
                return table
        if stamp is not None and self._rebuilt is not None and self._rebuilt[0] == stamp:
            return _table(self._rebuilt[1])[0]
        disk = rebuild(self.data_dir)
        if "shards" in lost:
            table.shards = disk.shards | table.shards  # (an entry read whole stands)
        if "kept" in lost:
            for owner, copies in disk.kept.items():
                table.kept[owner] = copies | table.kept.get(owner, {})
        if "evicting" in lost:
            table.evicting = table.evicting or disk.evicting
        if stamp is not None:  # (no file: listed at each read, until the first write, soon)
            self._rebuilt = (stamp, table.to_json())
        if data is not None or disk.shards or disk.kept:  # (else a new cache: nothing to say)
            version = ("missing",) if stamp is None else stamp  # (warn_once's None: none yet)
            warn_once(logger, self.path, version, "%s%s; rebuilt from what is on disk: %s",
                      self.path, problem, _rebuilt_words(disk, lost))
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
