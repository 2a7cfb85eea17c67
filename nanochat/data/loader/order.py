"""
The rank's walk: which documents rank r of W reads, in what order, and where a resumed walk starts.

Per epoch it reads units r, r+W, ... of every file (a unit is a parquet row group, or a chunk of a
pretokenized shard), cut into batches of `batch_size` documents; epochs count from 1. After an
elastic merge it first reads its plan, the work the merge dealt it. With shuffle, an epoch deals a
permutation of the units, and the entries of each window of units are read in a permuted order.
Every document batch carries where the walk goes on after it, so a state can name that place
exactly. ParquetReader reads parquet units; nanochat/data/pretokenized/token_reader.py reads
pretokenized ones. Cost: each file's footer (or index header) when first asked about; at most 16
units and 4 window tables held. Design: docs/ARCHITECTURE.md (the main path) and docs/resume.md
(states and plans).

May import: numpy, nanochat.data.base.state, nanochat.data.base.state_checks,
nanochat.data.base.shuffle, nanochat.data.base.datasets.
"""

import itertools
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from nanochat.data.base.datasets import open_parquet, read_row_group_column
from nanochat.data.base.shuffle import Shuffle, WindowTable
from nanochat.data.base.state import (Cursor, DocKey, PlanUnit, Position, Progress, UnitIndex,
                                      WindowCursor, WindowKey, decode_plan)
from nanochat.data.base.state_checks import check_resume

# a plan deals single documents from a few units in turn: keep the last 16 read
KEEP_UNITS = 16
KEEP_WINDOWS = 4  # window tables kept: the reading and the packing thread look at a few at once


def start_order(reader, rank: int, world_size: int, batch_size: int, state, config: dict, *,
                allow_state_mismatch: bool, epochs: int | None = None,
                state_name: str = "resume_state_dict", shuffle: Shuffle | None = None):
    """The walk a loader starts from: fresh, or resumed from a state that check_resume checks
    (against the data too). state_name: what messages call the state. Returns a Started."""
    walk = dict(epochs=epochs, shuffle=shuffle)
    if state is None:
        return Started(RankOrder(reader, rank, world_size, batch_size, **walk), None,
                       Position(0, 0, 1))
    resume = check_resume(reader, rank, world_size, state, config,
                          allow_state_mismatch=allow_state_mismatch, state_name=state_name,
                          shuffle=shuffle)
    if resume.resumed is None:  # approximately: from resume.cursor
        order = RankOrder(reader, rank, world_size, batch_size, cursor=resume.cursor, **walk)
        return Started(order, None, resume.position)
    plan = decode_plan(resume.resumed["plan"], reader.index)
    order = RankOrder(reader, rank, world_size, batch_size, plan=plan, cursor=resume.cursor,
                      state_name=resume.state_name, **walk)
    return Started(order, resume.resumed, resume.position)


class Started(NamedTuple):
    """Where a loader's walk starts: what start_order returns."""
    order: "RankOrder"
    resumed: dict | None  # the version-2 state it continues exactly, or None
    position: Position  # nanochat's keys of the last batch consumed before it


# -----------------------------------------------------------------------------
# The walk


class RankOrder:
    """One rank's documents, in order: first its plan (work an elastic resume dealt to it), then
    the regular walk from `cursor`: per epoch, units rank, rank + world_size, ... of every file,
    each cut into batches of `batch_size` documents; with shuffle (a Shuffle), the epoch's
    permuted units, their entries permuted a window at a time."""

    def __init__(self, reader, rank: int, world_size: int, batch_size: int, *,
                 plan: list[PlanUnit] = (), cursor: Cursor | WindowCursor | None = None,
                 epochs: int | None = None, state_name: str = "resume_state_dict",
                 shuffle: Shuffle | None = None):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.state_name = state_name  # what messages call the state it resumed from
        self.epochs = epochs  # None: forever; 1: one pass (a mixture's bucket), then it ends
        self.paths, self.index = reader.paths, reader.index
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.plan = self._sorted_plan(list(plan)) if shuffle else list(plan)
        if cursor is None:  # fresh: epoch 1, from the first window, or from file 0's unit `rank`
            cursor = WindowCursor(1, 0, 0) if shuffle else Cursor(1, 0, rank, 0)
        self.cursor = cursor  # where the regular walk begins, after the plan
        # what a state taken before the first batch says the walk goes on from
        self.first_position = PlanPlace(0, 0, None) if self.plan else self.cursor
        self._units: OrderedDict = OrderedDict()  # the last units a plan read
        # shuffled: the last windows' tables, by (epoch, window); the reading thread and the
        # packing thread (which names documents by place: place()) both use them
        self._windows: OrderedDict = OrderedDict()
        self._windows_lock = threading.Lock()

    # -- the walk -------------------------------------------------------------------------------

    def document_batches(self):
        """Yield a DocBatch at a time, forever (or for `epochs`): the plan's, then the regular
        walk's (shuffled or in file order)."""
        size = self.batch_size
        for u, unit in enumerate(self.plan):
            state_name = f"{self.state_name}['plan']"
            read = self._unit(unit.pq_idx, unit.rg_idx, state_name)
            doc_indices = unit.doc_indices
            if doc_indices is None:  # a whole unit: every document, in the plan's order for it
                doc_indices = self._plan_doc_indices(unit, self.reader.size(read))
            starts = unit.starts or (None,) * len(doc_indices)  # None: a whole document
            self._check_doc_indices(doc_indices, read, (unit.pq_idx, unit.rg_idx), state_name)
            for i in range(0, len(doc_indices), size):
                chunk = doc_indices[i:i + size]
                keys = [DocKey(unit.epoch, unit.pq_idx, unit.rg_idx, r) for r in chunk]
                yield DocBatch(self.reader.pick(read, chunk), keys,
                               PlanPlace(u, i + len(chunk), len(doc_indices)), starts[i:i + size])
        self._units.clear()  # the regular walk reads each unit once and keeps none
        yield from self._shuffled() if self.shuffle else self._regular()

    def _regular(self):
        size, rank, world_size = self.batch_size, self.rank, self.world_size
        epoch, pq_idx, rg_idx, doc_index = self.cursor
        while self.epochs is None or epoch <= self.epochs:  # one epoch per pass
            docs_this_pass = 0
            # only a pass from the epoch's start can show that this rank receives nothing
            full_pass = (pq_idx, rg_idx, doc_index) == (0, rank, 0)
            while pq_idx < len(self.paths):
                while rg_idx < self.index.count(pq_idx):
                    unit = self.reader.read(pq_idx, rg_idx)  # not kept: read once an epoch
                    n = self.reader.size(unit)
                    if doc_index > n:
                        raise ValueError(f"{self.state_name}['next'] points at document "
                                         f"{doc_index} of "
                                         f"{self.paths[pq_idx]} {self.reader.unit_name} {rg_idx}, "
                                         f"which has {n} documents: the state does not match "
                                         "the data")
                    docs_this_pass += n
                    for i in range(doc_index, n, size):
                        j = min(i + size, n)
                        # where the walk goes on: the next batch of this unit, else the next unit
                        after = (Cursor(epoch, pq_idx, rg_idx, j) if j < n
                                 else Cursor(epoch, pq_idx, rg_idx + world_size, 0))
                        keys = [DocKey(epoch, pq_idx, rg_idx, r) for r in range(i, j)]
                        yield DocBatch(self.reader.take(unit, i, j), keys, after)
                    rg_idx += world_size  # the rank's next unit of this file
                    doc_index = 0
                pq_idx += 1
                rg_idx = rank
            # forever over no documents would hang the loader; a walk of `epochs` just ends
            if full_pass and docs_this_pass == 0 and self.epochs is None:
                raise self._no_documents()
            epoch, pq_idx, rg_idx, doc_index = epoch + 1, 0, rank, 0

    def _shuffled(self):
        """The regular walk, shuffled: per epoch this rank's share of the permuted units, `window`
        units at a time, their entries read in a permuted order."""
        size, window_units = self.batch_size, self.shuffle.window
        epoch, window, entry = self.cursor
        while self.epochs is None or epoch <= self.epochs:
            units = self.shuffle.units(epoch, self.index.total, self.rank, self.world_size)
            docs_this_pass, full_pass = 0, (window, entry) == (0, 0)
            for w in range(window, -(-len(units) // window_units)):  # ceil: the last may be short
                places, bounds, permutation = self._window(epoch, w)
                # every unit of the window at once: any batch may take entries from each of them
                read = [self.reader.read(pq_idx, rg_idx) for pq_idx, rg_idx in places]
                n = int(bounds[-1])  # the window's entries
                if entry > n:
                    raise ValueError(f"{self.state_name}['next'] points at entry {entry} of window "
                                     f"{w} of epoch {epoch}, which has {n}: the state does not "
                                     "match the data")
                docs_this_pass += n
                for i in range(entry, n, size):
                    j = min(i + size, n)
                    # the unit each entry of the order falls in, then its document's index there
                    which = np.searchsorted(bounds, permutation[i:j], side="right") - 1
                    doc_indices = permutation[i:j] - bounds[which]
                    after = WindowCursor(epoch, w, j) if j < n else WindowCursor(epoch, w + 1, 0)
                    keys = [WindowKey(epoch, w, k) for k in range(i, j)]
                    yield DocBatch(self._pick_scattered(read, which, doc_indices), keys, after)
                entry = 0
            if full_pass and docs_this_pass == 0 and self.epochs is None:
                raise self._no_documents()
            epoch, window, entry = epoch + 1, 0, 0

    def _no_documents(self) -> ValueError:
        # nanochat's loader loops here forever; a rank with nothing to read is a configuration error
        unit = self.reader.unit_name
        return ValueError(
            f"rank {self.rank} of world size {self.world_size} receives no documents: the split's "
            f"{len(self.paths)} file(s) have too few (non-empty) {unit}s for this many ranks (they "
            f"are dealt out rank, rank+{self.world_size}, ...); use fewer ranks or shards with "
            f"more, smaller {unit}s")

    def _pick_scattered(self, read: list, which: np.ndarray, doc_indices: np.ndarray) -> list:
        """The items at (read[which[k]], doc_indices[k]) for every k, in order, one pick per
        unit."""
        items = [None] * len(doc_indices)
        for u in np.unique(which):
            at = np.flatnonzero(which == u)
            for k, item in zip(at, self.reader.pick(read[u], doc_indices[at].tolist())):
                items[k] = item
        return items

    # -- reading --------------------------------------------------------------------------------

    def _unit(self, pq_idx: int, rg_idx: int, state_name: str, doc_indices=None):
        """One unit, checked to exist; doc_indices: only those of its documents are wanted (a
        buffer's), and the unit is not kept for later (a streaming reader may give just those, from
        copies)."""
        if not (0 <= pq_idx < len(self.paths) and 0 <= rg_idx < self.index.count(pq_idx)):
            raise ValueError(f"{state_name} refers to file {pq_idx}, {self.reader.unit_name} "
                             f"{rg_idx}, "
                             f"which this split does not have ({len(self.paths)} files): the state "
                             "does not match the data")
        if doc_indices is not None:
            return self.reader.read(pq_idx, rg_idx, doc_indices)
        if (pq_idx, rg_idx) not in self._units:
            self._units[pq_idx, rg_idx] = self.reader.read(pq_idx, rg_idx)
            if len(self._units) > KEEP_UNITS:
                self._units.popitem(last=False)  # the least recently used
        self._units.move_to_end((pq_idx, rg_idx))
        return self._units[pq_idx, rg_idx]

    def _check_doc_indices(self, doc_indices, unit, place: tuple[int, int],
                           state_name: str) -> None:
        n = self.reader.size(unit)
        # (min() of no indices would raise)
        if len(doc_indices) and not 0 <= min(doc_indices) <= max(doc_indices) < n:
            pq_idx, rg_idx = place
            raise ValueError(f"{state_name} refers to document {max(doc_indices)} of "
                             f"{self.paths[pq_idx]} {self.reader.unit_name} {rg_idx}, which has "
                             f"{n} documents: the state does not match the data")

    def _window(self, epoch: int, window: int) -> WindowTable:
        """One window of this rank's shuffled share, kept a while."""
        with self._windows_lock:
            table = self._windows.get((epoch, window))
        if table is None:  # built outside the lock; two threads that both miss build equal tables
            table = self.shuffle.window_table(self.index, epoch, self.rank, self.world_size, window)
            with self._windows_lock:
                self._windows[epoch, window] = table
                if len(self._windows) > KEEP_WINDOWS:
                    self._windows.popitem(last=False)
        return table

    def place(self, key: DocKey | WindowKey) -> DocKey:
        """Where a document is, from its key: a shuffled walk keys the documents of its windows by
        position (a WindowKey), which the window's order turns into a place."""
        if isinstance(key, WindowKey):
            return DocKey(key.epoch, *Shuffle.entry(self._window(key.epoch, key.window), key.i))
        return DocKey(key.epoch, key.pq_idx, key.rg_idx, key.doc_index)  # (a PieceKey's document)

    def read_documents(self, keys: list, state_name: str) -> list:
        """The items of the given documents (to rebuild a buffer), in order, each unit read once."""
        wanted_of: dict = {}  # (pq_idx, rg_idx) -> [(position in keys, doc_index)]
        for i, key in enumerate(keys):
            doc = self.place(key)
            wanted_of.setdefault((doc.pq_idx, doc.rg_idx), []).append((i, doc.doc_index))
        items = [None] * len(keys)
        for (pq_idx, rg_idx), wanted in wanted_of.items():  # a unit at a time: one pick for it
            at, unit_indices = zip(*wanted)
            unit = self._unit(pq_idx, rg_idx, state_name, unit_indices)
            self._check_doc_indices(unit_indices, unit, (pq_idx, rg_idx), state_name)
            for i, item in zip(at, self.reader.pick(unit, unit_indices)):
                items[i] = item
        self._units.clear()
        return items

    # -- the plan -------------------------------------------------------------------------------

    def _global(self, unit: PlanUnit) -> int:
        return self.index.base(unit.pq_idx) + unit.rg_idx

    def _sorted_plan(self, plan: list[PlanUnit]) -> list[PlanUnit]:
        """A shuffled walk reads its plan's single documents as dealt (in a shuffled order
        already), then its whole units sorted by a keyed order that does not depend on which
        others are left."""
        dealt = [unit for unit in plan if unit.doc_indices is not None]
        by_epoch: dict[int, list[PlanUnit]] = {}
        for unit in plan:
            if unit.doc_indices is None:
                by_epoch.setdefault(unit.epoch, []).append(unit)
        for epoch in sorted(by_epoch):
            whole = by_epoch[epoch]
            keys = self.shuffle.plan_key(epoch, np.array([self._global(u) for u in whole]),
                                           self.index.total)
            dealt += [whole[i] for i in np.argsort(keys)]
        return dealt

    def _plan_doc_indices(self, unit: PlanUnit, n: int):
        """The order a plan reads a whole unit's n entries in."""
        if self.shuffle is None:
            return range(n)
        return tuple(self.shuffle.plan_doc_indices(unit.epoch, self._global(unit), n).tolist())

    def progress(self, after, position: Position) -> Progress:
        """What a state records at an `after` that document_batches yielded: the plan's units not
        yet read and the regular walk's cursor; position: nanochat's keys of that batch."""
        if not isinstance(after, PlanPlace):
            return Progress([], after, position)
        units = self.plan[after.unit:]
        if after.offset:  # a unit begun: only its unread documents are left
            first = units[0]
            doc_indices = first.doc_indices
            if doc_indices is None:  # (a keyed order: the same n gives the same order again)
                doc_indices = self._plan_doc_indices(first, after.n)
            rest = tuple(doc_indices[after.offset:])
            starts = None if first.starts is None else first.starts[after.offset:]
            units = ([first._replace(doc_indices=rest, starts=starts)] if rest else []) + units[1:]
        if self.shuffle:  # whole units in file order: one bitmap an epoch, re-sorted on resume
            units = ([unit for unit in units if unit.doc_indices is not None] +
                     sorted((unit for unit in units if unit.doc_indices is None),
                            key=lambda unit: (unit.epoch, self._global(unit))))
        return Progress(units, self.cursor, position)

    # -- what a streaming loader fetches ahead ---------------------------------------------------

    def plan_files(self, docs: int, plan: list[PlanUnit] | None = None) -> list[int]:
        """The files (pq_idx) of its plan's units (or `plan`'s, another rank's of the same split)
        as far as the first `docs` documents: what a resumed walk reads, and holds, before its
        first state (a merge deals every old rank's buffered documents this way)."""
        files, count = [], 0
        for unit in self.plan if plan is None else plan:
            if count >= docs:
                break
            files.append(unit.pq_idx)
            count += (len(unit.doc_indices) if unit.doc_indices is not None
                      else self.index.docs(unit.pq_idx, unit.rg_idx))
        return list(dict.fromkeys(files))

    def file_visits(self):
        """The files this (unshuffled) walk reads, in order, once per visit, as (epoch, pq_idx):
        its plan's, then the regular walk's, epoch after epoch. What streaming fetches ahead."""
        # a plan's units of one file in a row are one visit
        for visit, _ in itertools.groupby((unit.epoch, unit.pq_idx) for unit in self.plan):
            yield visit
        epoch, pq_idx, rg_idx, _ = self.cursor
        while self.epochs is None or epoch <= self.epochs:
            visited = False
            for p in range(pq_idx, len(self.paths)):
                # does the file have a unit of this rank's at or after where the walk enters it?
                if (rg_idx if p == pq_idx else self.rank) < self.index.count(p):
                    visited = True
                    yield epoch, p
            if not visited and pq_idx == 0 and rg_idx == self.rank:
                return  # nothing for this rank in a whole pass (the walk raises _no_documents)
            epoch, pq_idx, rg_idx = epoch + 1, 0, self.rank


# -----------------------------------------------------------------------------
# The records that leave the walk


class PlanPlace(NamedTuple):
    """Where a walk still in its plan goes on: unit `unit`, after `offset` of its n documents."""
    unit: int  # an index into the walk's plan
    offset: int
    n: int | None  # None before the plan's first batch (RankOrder.first_position)


class DocBatch(NamedTuple):
    """One batch of documents, as the walk reads them."""
    items: list  # texts (parquet) or (tokens, overlap) entries (pretokenized)
    keys: list  # a DocKey per item (a WindowKey in a shuffled window)
    after: Cursor | WindowCursor | PlanPlace  # where the walk goes on after this batch
    starts: tuple | None = None  # a plan's pieces: per item, None or the token it starts at



# -----------------------------------------------------------------------------
# Parquet shards


class ParquetReader:
    """The walk's view of parquet shards: units are row groups, items are texts to tokenize.
    Streaming (nanochat/data/streaming/cache.py): `catalog` gives each shard's size and row-group
    counts before it is fetched, and `cache.need(pq_idx)` waits for a shard to be on disk before
    it is read; a resumed buffer's documents (doc_indices given) may come from the copies the
    cache kept of them, the other entries None."""

    unit_name = "row group"

    def __init__(self, paths: list[str], catalog: list[dict] | None = None, cache=None):
        self.paths, self.cache = paths, cache
        # None: the files on disk say their sizes and row groups
        self.sizes = [entry["size"] for entry in catalog] if catalog else None
        self.index = parquet_index(paths, [entry["rows"] for entry in catalog] if catalog else None)

    def read(self, pq_idx: int, rg_idx: int, doc_indices=None):
        if self.cache is None:
            path = self.paths[pq_idx]
        else:
            if doc_indices is not None:  # a resumed buffer's: its shard may be evicted, copies kept
                unit = self.cache.kept_unit(pq_idx, rg_idx, doc_indices,
                                            self.index.docs(pq_idx, rg_idx))
                if unit is not None:
                    return unit
            # a buffer's documents do not move the cache's place in the file order
            path = self.cache.need(pq_idx, in_order=doc_indices is None)
        return read_row_group_column(open_parquet(path), rg_idx, path)

    @staticmethod
    def size(unit) -> int:
        return len(unit)

    @staticmethod
    def take(unit, first: int, stop: int) -> list[str]:
        # a slice at a time: making Python strings holds the GIL (~5 ms per 1,024 FineWeb
        # documents), and the tokenizer threads run in between (see read_row_group_column)
        return unit.slice(first, stop - first).to_pylist()

    @staticmethod
    def pick(unit, doc_indices) -> list[str]:
        return unit.take(list(doc_indices)).to_pylist()



def parquet_index(paths: list[str], known_sizes: list[list[int]] | None = None) -> UnitIndex:
    """The row groups of parquet shards (known_sizes: each shard's, from a streaming catalog)."""
    return UnitIndex(paths, docs_per_group, known_sizes=known_sizes)


def docs_per_group(path: str) -> list[int]:
    """Documents in each row group of a parquet shard, from its footer: no document is read."""
    meta = open_parquet(path).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
