"""
Kept copies of buffered documents, so that a shard may go while a buffer still holds its text.
A best-fit buffer can hold a long document for many shards, so once a loader has packed every
document of a shard it copies the few its recent states still buffer to
DATA_DIR/.stream/kept/<loader>/<shard>.json.gz, and the shard may go. A copy is gzipped JSON,
{"sha256": ..., "docs": [[rg_idx, doc_index, text], ...]}, the checksum that of the docs' JSON: a
damaged or edited copy is removed with a warning, and its shard fetched again. A resume reads a
buffer's documents from any loader's copies. The copies are files (they are data); which loader owns
which is in the ledger. A copy costs a gzip of a few documents. Design: docs/streaming.md.

May import: nanochat.data.base.datasets, nanochat.data.base.files,
nanochat.data.streaming.ledger.
"""

import errno
import gzip
import hashlib
import json
import logging
import os
import shutil
import zlib
from collections import deque
from typing import NamedTuple

from nanochat.data.base.datasets import open_parquet, read_row_group_column
from nanochat.data.base.files import disk_full, remove_if_exists, write_atomic
from nanochat.data.streaming.ledger import KEPT_DIR, KEPT_SUFFIX, STREAM_DIR, Ledger, Table, listdir

logger = logging.getLogger(__name__)

# what reading a damaged copy raises: a bad gzip header or CRC (BadGzipFile), a cut-off file
# (EOFError), a bad deflate block (zlib.error), bad JSON, shape or checksum (ValueError); not any
# OSError: a copy is not removed for a passing read error
DAMAGED = (gzip.BadGzipFile, EOFError, zlib.error, ValueError)
HELD_STATES = 4  # states whose buffered documents are kept, past 2 x prefetch (Keeper.held)


def kept_root(data_dir: str) -> str:
    return os.path.join(data_dir, STREAM_DIR, KEPT_DIR)


class KeptFile(NamedTuple):
    """A file in the kept directory: whose copy of which shard, and where."""
    owner: str  # the loader that wrote it (host-pid-n)
    name: str  # the shard's name
    path: str


class Copy(NamedTuple):
    """A copy to write: documents `docs` {(rg_idx, doc_index)} of shard p."""
    p: int
    docs: frozenset


class CopyPlan(NamedTuple):
    """Keeper.plan's answer: the copies to write, and the shards whose copies may go."""
    todo: list[Copy]
    drop: list[int]


def kept_files(root: str) -> list[KeptFile]:
    """Every file in the kept directory (a killed writer's .tmp too)."""
    return [KeptFile(owner, name.removesuffix(KEPT_SUFFIX), os.path.join(root, owner, name))
            for owner in listdir(root) for name in listdir(os.path.join(root, owner))]


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:  # (removed by another loader since it was listed)
        return 0


def file_mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:  # (removed by another loader since it was listed)
        return 0.0


def kept_bytes(root: str) -> int:
    """What every copy takes on disk: the budget counts it."""
    return sum(file_size(kept.path) for kept in kept_files(root))


def remove_gone(root: str, table: Table, live: set[str]) -> None:
    """Remove the copies of every loader not in `live`, and their entries in the table."""
    for owner in set(listdir(root)) | set(table.kept):
        if owner not in live:
            shutil.rmtree(os.path.join(root, owner), ignore_errors=True)
            table.kept.pop(owner, None)


def drop_oldest(root: str, table: Table, enough) -> int:
    """Remove copies, any loader's, oldest first, until enough(bytes dropped) is true; the bytes
    dropped. Their entries in the table go too."""
    spare = sorted((file_mtime(kept.path), kept) for kept in kept_files(root))
    dropped = 0
    for _, kept in spare:
        if enough(dropped):
            break
        size = file_size(kept.path)
        remove_if_exists(kept.path)
        table.kept.get(kept.owner, {}).pop(kept.name, None)
        dropped += size
    return dropped


def _docs_sum(docs: list) -> str:
    return hashlib.sha256(json.dumps(docs).encode()).hexdigest()


def read_copy(path: str) -> dict[tuple[int, int], str]:
    """{(rg_idx, doc_index): text} of one copy. Raises FileNotFoundError when it is not there, and
    one of DAMAGED, saying what is wrong, when it is not a copy as encode() writes them."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict) or not isinstance(value.get("docs"), list):
        raise ValueError("not an object with a list of docs")
    docs = value["docs"]
    if value.get("sha256") != _docs_sum(docs):  # (an edited text, or a bit flipped on disk)
        raise ValueError("its documents do not match its sha256")
    if not all(isinstance(doc, list) and len(doc) == 3 and type(doc[0]) is int
               and type(doc[1]) is int and isinstance(doc[2], str) for doc in docs):
        raise ValueError("its docs are not [row group, document index, text] entries")
    return {(rg_idx, doc_index): text for rg_idx, doc_index, text in docs}


# -----------------------------------------------------------------------------
# One loader's copies


class Keeper:
    """What one loader's recent states buffer, and the copies it keeps of them. Not thread-safe:
    the shard cache calls it holding its own lock (its condition). It reads the ledger; it changes
    entries only in a table the cache passes in, under the ledger's lock."""

    def __init__(self, data_dir: str, names: list[str], owner: str, prefetch: int, ledger: Ledger):
        self.data_dir, self.names, self.owner, self.ledger = data_dir, names, owner, ledger
        self.root = kept_root(data_dir)
        self.directory = os.path.join(self.root, owner)
        # the buffered documents {pq_idx: {(rg_idx, doc_index)}} of the states built last: a
        # DataLoader yields a state about prefetch + 1 states after it is built, and a resume may
        # start from any of the last few yielded
        self.held: deque = deque(maxlen=2 * prefetch + HELD_STATES)
        # pq_idx -> the (rg_idx, doc_index) of it our copy holds
        self.kept: dict[int, frozenset] = {}
        self.unkept: set[int] = set()  # shards recent states buffer that no copy of ours holds yet
        self.pending = False  # a state arrived, or a copy found no room: look again
        self.restoring = False  # a resumed buffer is read (perhaps from other loaders' copies)
        # shard name -> {(rg_idx, doc_index): text}, while restoring
        self.restore_texts: dict[str, dict] = {}

    def hold(self, keys) -> None:
        """A state was just built: `keys` (DocKeys, PieceKeys) are its buffer."""
        held: dict[int, set] = {}
        for key in keys:
            held.setdefault(key.pq_idx, set()).add((key.rg_idx, key.doc_index))
        self.held.append({p: frozenset(docs) for p, docs in held.items()})
        self.unkept = self.find_unkept()
        self.pending = True

    def find_unkept(self) -> set[int]:
        kept = self.kept
        return {p for held in self.held for p, docs in held.items()
                if not docs <= kept.get(p, frozenset())}

    def plan(self, skip: set[int]) -> CopyPlan:
        """The copies to write, and the shards whose copies no recent state needs. `skip`:
        shards not to copy from (still packed from, or never evicted)."""
        wanted: dict[int, set] = {}
        for held in self.held:
            for p, docs in held.items():
                wanted.setdefault(p, set()).update(docs)
        todo = [Copy(p, frozenset(wanted[p])) for p in sorted(self.unkept) if p not in skip]
        # a copy whose documents the buffers hold less than half of is written again, smaller
        todo += [Copy(p, frozenset(wanted[p])) for p, docs in self.kept.items()
                 if p in wanted and p not in self.unkept and 2 * len(wanted[p]) <= len(docs)]
        drop = [p for p in self.kept if p not in wanted]
        return CopyPlan(todo, drop)

    def path(self, p: int) -> str:
        return os.path.join(self.directory, self.names[p] + KEPT_SUFFIX)

    def copy_texts(self, name: str) -> dict[tuple[int, int], str]:
        """{(rg_idx, doc_index): text} of every loader's copies of shard `name` (the ledger says
        whose).
        A damaged copy is removed, with a warning: its documents are absent (fetched again)."""
        table = self.ledger.read()
        owners = sorted(owner for owner, copies in table.kept.items() if name in copies)
        texts = {}
        for owner in owners:
            path = os.path.join(self.root, owner, name + KEPT_SUFFIX)
            try:
                texts.update(read_copy(path))
            except FileNotFoundError:  # (dropped by its owner since the ledger was read)
                continue
            except DAMAGED:
                self.discard(owner, name, path)
        return texts

    def discard(self, owner: str, name: str, path: str) -> None:
        """Remove a damaged copy and its entry in the ledger, if it is still damaged under the lock
        (its owner writes copies whole, under the lock: it may have written it again)."""
        with self.ledger.lock:
            try:
                read_copy(path)
                return
            except FileNotFoundError:
                pass
            except DAMAGED as e:
                logger.warning("kept documents %s are damaged (%s): removed; the documents are "
                               "read from shard %s again", path, e, name)
                remove_if_exists(path)
            table = self.ledger.read()
            table.kept.get(owner, {}).pop(name, None)
            self.ledger.write(table)

    def restored(self, name: str) -> dict[tuple[int, int], str]:
        """copy_texts(name), read once while restoring a resumed buffer."""
        if name not in self.restore_texts:
            self.restore_texts[name] = self.copy_texts(name)
        return self.restore_texts[name]

    def texts(self, p: int, docs: frozenset) -> dict | None:
        """{(rg_idx, doc_index): text} for the given documents of shard p: from the shard when it
        is on disk, else from copies; None when some cannot be found."""
        path = os.path.join(self.data_dir, self.names[p])
        try:
            pf = open_parquet(path)
        except FileNotFoundError:
            texts = self.copy_texts(self.names[p])
            return {key: texts[key] for key in docs} if docs <= texts.keys() else None
        texts = {}
        for rg_idx in sorted({rg for rg, _ in docs}):
            wanted = sorted(doc_index for rg, doc_index in docs if rg == rg_idx)
            column = read_row_group_column(pf, rg_idx, path)
            texts.update(zip(((rg_idx, i) for i in wanted), column.take(wanted).to_pylist()))
        return texts

    def write(self, p: int, data: bytes, table: Table) -> None:
        """Write our copy of shard p's documents whole, then rename (a resume never reads half of
        one), and its entry in the table (the caller holds the ledger's lock)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:  # (a directory takes a block on most file systems)
            if e.errno != errno.ENOSPC:
                raise
            what = f"a copy of {self.names[p]}'s documents"
            raise disk_full(self.root, len(data), what) from None
        write_atomic(self.path(p), data)
        table.kept.setdefault(self.owner, {})[self.names[p]] = len(data)

    def remove(self, p: int, table: Table) -> None:
        """Remove our copy of shard p, and its entry in the table (the caller holds the lock)."""
        remove_if_exists(self.path(p))
        table.kept.get(self.owner, {}).pop(self.names[p], None)

    def forget(self, drop: list[int]) -> None:
        for p in drop:
            del self.kept[p]

    def settle(self) -> None:
        """After a round of copies: the shards whose buffered documents no copy holds yet; and a
        restored buffer, once a state holds it and its copies are written, ends the restore (the
        other loaders' copies may go)."""
        self.unkept = self.find_unkept()
        if self.held and not self.pending:
            self.restoring = False
            self.restore_texts.clear()


def encode(texts: dict[tuple[int, int], str]) -> bytes:
    """A copy's bytes, with the checksum of its documents; mtime=0: the same documents give the
    same bytes."""
    docs = [[*key, texts[key]] for key in sorted(texts)]
    value = {"sha256": _docs_sum(docs), "docs": docs}
    return gzip.compress(json.dumps(value).encode(), mtime=0)
