"""
How a rank walks its documents: DDP dealing, epochs, elastic plans, and where a resumed stream starts.

Rank r of W reads, per epoch, units r, r+W, ... of every file (the seeds' sharding: a unit is a parquet
row group, or a chunk of a pretokenized shard), each cut into batches of `batch_size` documents; epochs
count from 1. After an elastic merge (nanochat/elastic.py) a rank first reads its plan, the work the
merge dealt it, then the regular stream of the next epoch. Every batch comes with where the stream
continues after it, so a state can name the exact place (nanochat/state.py).

start_stream builds the stream a loader starts from: fresh; resumed exactly from a version-2 state;
or, from the seeds' {pq_idx, rg_idx, epoch} (or another stream's state, when allowed), approximately,
after the saved unit, as nanochat's loader resumes.

With shuffle (nanochat/shuffle.py), an epoch deals the units in a permuted order instead, positions rank,
rank + W, ... of the permutation, and the rank reads the entries of each `window` consecutive units of its
share in a permuted order; its cursor is then (epoch, window, row): the row-th entry of that order, and
its documents are keyed by position, (epoch, window, i), which place() turns into where they are. A plan
(after an elastic merge) is read in a shuffled order too: its single documents as dealt, then its whole
units in a keyed order, each unit's entries permuted.

Documents are read through a reader (nanochat/readers.py); nothing here tokenizes.

May import: numpy, nanochat.state, nanochat.state_checks, nanochat.shuffle.
"""

import itertools
import logging
import threading
from collections import OrderedDict

import numpy as np

from nanochat.shuffle import Shuffle
from nanochat.state import Key, Unit, decode_plan
from nanochat.state_checks import REQUIRED, STREAM_FIELDS, check_state, rank_state

logger = logging.getLogger("nanochat.dataloader.stream")  # child of its old logger

Position = tuple[int, int, int]  # (pq_idx, rg_idx, epoch): the seeds' state keys
Cursor = tuple[int, ...]  # (epoch, pq_idx, rg_idx, row), shuffled (epoch, window, row): where a document batch starts
SEEDS_KEYS = ("pq_idx", "rg_idx", "epoch")


class Stream:
    """One rank's documents, in order: first its plan (work an elastic resume dealt to it), then the
    regular stream from `start`: per epoch, units (row groups, or chunks of a pretokenized shard)
    rank, rank + world_size, ... of every file, each cut into batches of `batch_size` documents;
    with shuffle (a Shuffle), the epoch's permuted units, their entries permuted a window at a time."""

    def __init__(self, reader, rank: int, world_size: int, batch_size: int,
                 plan: list[Unit] = (), start: Cursor | None = None, epochs: int | None = None,
                 where: str = "resume_state_dict", shuffle: Shuffle | None = None):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.where = where  # what messages call the state it resumed from
        self.epochs = epochs  # None: forever; 1: one pass (a mixture's bucket), then the stream ends
        self.paths, self.index = reader.paths, reader.index
        self.tokenizer_batch_size = batch_size
        self.shuffle = shuffle
        self.plan = self._plan_order(list(plan)) if shuffle else list(plan)
        if start is None:
            start = (1, 0, 0) if shuffle else (1, 0, rank, 0)  # (epoch, window, row) / (epoch, pq_idx, rg_idx, row)
        self.start = start
        self.first_position = ("plan", 0, 0, None) if self.plan else ("regular", *self.start)
        self._units: OrderedDict = OrderedDict()  # the last units read for a plan or a buffer, by (pq_idx, rg_idx)
        # shuffled: the last windows' (places, bounds, order), by (epoch, window); the reading thread and the
        # packing thread (which names documents by place: place()) both use them
        self._windows: OrderedDict = OrderedDict()
        self._windows_lock = threading.Lock()

    def _unit(self, pq_idx: int, rg_idx: int, where: str, rows=None):
        """One unit, checked to exist; rows: only those of its documents are wanted (a buffer's), and the unit is
        not kept for later (a streaming reader may give just those, from copies: nanochat/shard_cache.py)."""
        if not (0 <= pq_idx < len(self.paths) and 0 <= rg_idx < self.index.count(pq_idx)):
            raise ValueError(f"{where} refers to file {pq_idx}, {self.reader.unit_name} {rg_idx}, which this "
                             f"split does not have ({len(self.paths)} files): the state does not match the data")
        if rows is not None:
            return self.reader.read(pq_idx, rg_idx, rows)
        # documents dealt one by one (a plan, a buffer) come from a few units in turn: keep the last 16 read
        if (pq_idx, rg_idx) not in self._units:
            self._units[pq_idx, rg_idx] = self.reader.read(pq_idx, rg_idx)
            if len(self._units) > 16:
                self._units.popitem(last=False)
        self._units.move_to_end((pq_idx, rg_idx))
        return self._units[pq_idx, rg_idx]

    def _check_rows(self, rows, unit, pq_idx: int, rg_idx: int, where: str) -> None:
        n = self.reader.size(unit)
        if len(rows) and not 0 <= min(rows) <= max(rows) < n:
            raise ValueError(f"{where} refers to row {max(rows)} of {self.paths[pq_idx]} {self.reader.unit_name} "
                             f"{rg_idx}, which has {n} rows: the state does not match the data")

    def _window(self, epoch: int, window: int):
        """(places, bounds, order) of one window of this rank's shuffled share (Shuffle.window_table), kept for a while."""
        with self._windows_lock:
            table = self._windows.get((epoch, window))
        if table is None:
            table = self.shuffle.window_table(self.index, epoch, self.rank, self.world_size, window)
            with self._windows_lock:
                self._windows[epoch, window] = table
                if len(self._windows) > 4:
                    self._windows.popitem(last=False)
        return table

    def place(self, key) -> Key:
        """Where a document is, (epoch, pq_idx, rg_idx, row), from its key: a shuffled stream keys the documents
        of its windows by position, (epoch, window, i), the i-th of the window's order; others are places."""
        if len(key) != 3:
            return tuple(key[:4])
        epoch, window, i = key
        return (epoch, *Shuffle.entry(self._window(epoch, window), i))

    def read_documents(self, keys: list[Key], where: str) -> list:
        """The items of the given documents (for rebuilding a buffer), in order, reading each unit once."""
        rows: dict = {}  # (pq_idx, rg_idx) -> [(position in keys, row)]
        for i, key in enumerate(keys):
            _, pq_idx, rg_idx, row = self.place(key)
            rows.setdefault((pq_idx, rg_idx), []).append((i, row))
        items = [None] * len(keys)
        for (pq_idx, rg_idx), wanted in rows.items():
            at, unit_rows = zip(*wanted)
            unit = self._unit(pq_idx, rg_idx, where, unit_rows)
            self._check_rows(unit_rows, unit, pq_idx, rg_idx, where)
            for i, item in zip(at, self.reader.pick(unit, unit_rows)):
                items[i] = item
        self._units.clear()
        return items

    def batches(self):
        """Yield (texts, keys, after): the keys (epoch, pq_idx, rg_idx, row) of the texts (a plan's
        pieces: (epoch, pq_idx, rg_idx, row, start); shuffled windows: (epoch, window, i)), and where the
        stream continues after them, ("plan", unit, offset, n) or ("regular", *cursor)."""
        tbs = self.tokenizer_batch_size
        for u, (epoch, pq_idx, rg_idx, rows, starts) in enumerate(self.plan):
            unit = self._unit(pq_idx, rg_idx, f"{self.where}['plan']")
            rows = self._plan_rows(epoch, pq_idx, rg_idx, self.reader.size(unit)) if rows is None else rows
            starts = starts or (None,) * len(rows)
            self._check_rows(rows, unit, pq_idx, rg_idx, f"{self.where}['plan']")
            for i in range(0, len(rows), tbs):
                chunk = rows[i:i + tbs]
                keys = [(epoch, pq_idx, rg_idx, r) if start is None else (epoch, pq_idx, rg_idx, r, start)
                        for r, start in zip(chunk, starts[i:i + tbs])]
                yield self.reader.pick(unit, chunk), keys, ("plan", u, i + len(chunk), len(rows))
        self._units.clear()
        yield from self._shuffled() if self.shuffle else self._regular()

    def file_order(self):
        """The files this (unshuffled) stream will read, in order, a file once per visit, as (epoch, pq_idx): its
        plan's, then its regular stream's, epoch after epoch. What a streaming loader fetches ahead
        (nanochat/shard_cache.py)."""
        for visit, _ in itertools.groupby((unit[0], unit[1]) for unit in self.plan):
            yield visit
        epoch, pq_idx, rg_idx, _ = self.start
        while self.epochs is None or epoch <= self.epochs:
            visited = False
            for p in range(pq_idx, len(self.paths)):
                if (rg_idx if p == pq_idx else self.rank) < self.index.count(p):
                    visited = True
                    yield epoch, p
            if not visited and pq_idx == 0 and rg_idx == self.rank:
                return  # nothing for this rank in a whole pass (the reader raises _no_documents)
            epoch, pq_idx, rg_idx = epoch + 1, 0, self.rank

    def _no_documents(self) -> ValueError:
        # the reference loops here forever; a rank with nothing to read is a configuration error
        return ValueError(
            f"rank {self.rank} of world size {self.world_size} receives no documents: the split's "
            f"{len(self.paths)} file(s) have too few (non-empty) {self.reader.unit_name}s for this many "
            f"ranks (they are dealt out rank, rank+{self.world_size}, ...); use fewer ranks or "
            f"shards with more, smaller {self.reader.unit_name}s")

    def _regular(self):
        tbs, rank, world_size = self.tokenizer_batch_size, self.rank, self.world_size
        epoch, pq_idx, rg_idx, row = self.start
        while self.epochs is None or epoch <= self.epochs:  # one epoch per pass
            docs_this_pass = 0
            full_pass = (pq_idx, rg_idx, row) == (0, rank, 0)
            while pq_idx < len(self.paths):
                while rg_idx < self.index.count(pq_idx):
                    unit = self.reader.read(pq_idx, rg_idx)
                    n = self.reader.size(unit)
                    if row > n:
                        raise ValueError(f"{self.where}['next'] points at row {row} of {self.paths[pq_idx]} "
                                         f"{self.reader.unit_name} {rg_idx}, which has {n} rows: the state does "
                                         "not match the data")
                    docs_this_pass += n
                    for i in range(row, n, tbs):
                        j = min(i + tbs, n)
                        # where the stream continues: the next batch of this unit, else the next unit
                        after = (epoch, pq_idx, rg_idx, j) if j < n else (epoch, pq_idx, rg_idx + world_size, 0)
                        yield (self.reader.take(unit, i, j), [(epoch, pq_idx, rg_idx, r) for r in range(i, j)],
                               ("regular", *after))
                    rg_idx += world_size
                    row = 0
                pq_idx += 1
                rg_idx = rank
            if full_pass and docs_this_pass == 0 and self.epochs is None:
                raise self._no_documents()
            epoch, pq_idx, rg_idx, row = epoch + 1, 0, rank, 0

    def _shuffled(self):
        """The regular stream, shuffled: per epoch this rank's share of the permuted units, `window` units
        at a time, their entries read in a permuted order."""
        tbs, size = self.tokenizer_batch_size, self.shuffle.window
        epoch, window, row = self.start
        while self.epochs is None or epoch <= self.epochs:
            units = self.shuffle.units(epoch, self.index.total, self.rank, self.world_size)
            docs_this_pass, full_pass = 0, (window, row) == (0, 0)
            for w in range(window, -(-len(units) // size)):
                places, bounds, order = self._window(epoch, w)
                read = [self.reader.read(pq_idx, rg_idx) for pq_idx, rg_idx in places]
                n = int(bounds[-1])
                if row > n:
                    raise ValueError(f"{self.where}['next'] points at entry {row} of window {w} of epoch {epoch}, "
                                     f"which has {n}: the state does not match the data")
                docs_this_pass += n
                for i in range(row, n, tbs):
                    j = min(i + tbs, n)
                    which = np.searchsorted(bounds, order[i:j], side="right") - 1
                    rows = order[i:j] - bounds[which]
                    after = (epoch, w, j) if j < n else (epoch, w + 1, 0)
                    yield (self._pick_scattered(read, which, rows), [(epoch, w, k) for k in range(i, j)],
                           ("regular", *after))
                row = 0
            if full_pass and docs_this_pass == 0 and self.epochs is None:
                raise self._no_documents()
            epoch, window, row = epoch + 1, 0, 0

    def _pick_scattered(self, read: list, which: np.ndarray, rows: np.ndarray) -> list:
        """The items at (read[which[k]], rows[k]) for every k, in that order, picking from each unit once."""
        items = [None] * len(rows)
        for u in np.unique(which):
            at = np.flatnonzero(which == u)
            for k, item in zip(at, self.reader.pick(read[u], rows[at].tolist())):
                items[k] = item
        return items

    def _global(self, pq_idx: int, rg_idx: int) -> int:
        return self.index.base(pq_idx) + rg_idx

    def _plan_order(self, plan: list[Unit]) -> list[Unit]:
        """A shuffled stream reads its plan's single documents as dealt (already in a shuffled order), then its
        whole units sorted by a keyed order that does not depend on which others are left."""
        dealt = [unit for unit in plan if unit[3] is not None]
        by_epoch: dict[int, list[Unit]] = {}
        for unit in plan:
            if unit[3] is None:
                by_epoch.setdefault(unit[0], []).append(unit)
        for epoch in sorted(by_epoch):
            whole = by_epoch[epoch]
            keys = self.shuffle.plan_order(epoch, np.array([self._global(u[1], u[2]) for u in whole]),
                                           self.index.total)
            dealt += [whole[i] for i in np.argsort(keys)]
        return dealt

    def _plan_rows(self, epoch: int, pq_idx: int, rg_idx: int, n: int):
        """The order a plan reads a whole unit's n entries in."""
        if self.shuffle is None:
            return range(n)
        return tuple(self.shuffle.plan_rows(epoch, self._global(pq_idx, rg_idx), n).tolist())

    def remaining_plan(self, position) -> tuple[list[Unit], Cursor]:
        """(plan units not yet read, regular cursor) at a position yielded by batches()."""
        if position[0] == "regular":
            return [], tuple(position[1:])
        _, u, offset, n = position
        units = self.plan[u:]
        if offset:
            epoch, pq_idx, rg_idx, rows, starts = units[0]
            rows = self._plan_rows(epoch, pq_idx, rg_idx, n) if rows is None else rows
            rest = tuple(rows[offset:])
            starts = None if starts is None else starts[offset:]
            units = ([(epoch, pq_idx, rg_idx, rest, starts)] if rest else []) + units[1:]
        if self.shuffle:  # whole units in file order: they encode as one bitmap an epoch, and re-sort on resume
            units = ([unit for unit in units if unit[3] is not None] +
                     sorted((unit for unit in units if unit[3] is None),
                            key=lambda unit: (unit[0], self._global(unit[1], unit[2]))))
        return units, self.start


def check_legacy_state(state: dict, paths: list[str], reader, where: str = "resume_state_dict") -> Position:
    """Validate a seeds-form state {pq_idx, rg_idx[, epoch]}; returns where the stream continues:
    the row group after the saved one (approximate, as the seeds' resume)."""
    missing = {"pq_idx", "rg_idx"} - state.keys()
    if missing:
        raise ValueError(f"{where} is missing {sorted(missing)}")
    # "epoch" is optional: the older concatenating loader's states do not carry it
    values = {"pq_idx": state["pq_idx"], "rg_idx": state["rg_idx"], "epoch": state.get("epoch", 1)}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}[{key!r}] must be an int, got {value!r}")
    pq_idx, rg_idx, epoch = values["pq_idx"], values["rg_idx"], values["epoch"]
    if epoch < 1:
        raise ValueError(f"{where}['epoch'] must be >= 1 (epochs count from 1), got {epoch}")
    if not 0 <= pq_idx < len(paths):
        raise ValueError(f"{where}['pq_idx']={pq_idx} points past the data: "
                         f"the split has {len(paths)} file(s)")
    num_units = reader.index.count(pq_idx)
    if not 0 <= rg_idx < num_units:
        raise ValueError(f"{where}['rg_idx']={rg_idx} points past the data: "
                         f"{paths[pq_idx]} has {num_units} {reader.unit_name}(s)")
    return pq_idx, rg_idx, epoch


def start_stream(reader, rank, world_size, batch_size, state, config, allow_state_mismatch, epochs=None,
                 where: str = "resume_state_dict", shuffle: Shuffle | None = None):
    """The stream a loader starts from: fresh, or resumed from a state (version 2: exactly; the seeds'
    form, or another stream accepted with allow_state_mismatch: after the saved unit, as nanochat).
    A shuffled stream resumes approximately only from another rank's state of its own run: after that
    rank's window. where: what messages call the state.
    Returns (stream, version-2 start state or None, seeds position)."""
    paths = reader.paths
    if state is None:
        return Stream(reader, rank, world_size, batch_size, epochs=epochs, shuffle=shuffle), None, (0, 0, 1)
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
    if "merged" in state:  # elastic resume: every rank gets the merge, and takes its own part
        state, where = rank_state(state, rank, world_size, where)
    elif "states" in state:
        raise ValueError(f"{where} has 'states' but no 'merged': not a whole merge_states result (a truncated "
                         "state?); pass what merge_states returned")
    if "version" not in state and state.keys() & set(REQUIRED) - set(SEEDS_KEYS):
        raise ValueError(f"{where} is missing 'version' but has this loader's other keys "
                         f"({sorted(state.keys() & set(REQUIRED))}): a truncated state?")
    if "version" in state and check_state(state, config, reader.index, allow_mismatch=allow_state_mismatch,
                                          where=where):
        plan = decode_plan(state["plan"], reader.index)
        stream = Stream(reader, rank, world_size, batch_size, plan, tuple(state["next"]), epochs=epochs, where=where,
                        shuffle=shuffle)
        return stream, state, (state["pq_idx"], state["rg_idx"], state["epoch"])
    position = (state.get("pq_idx"), state.get("rg_idx"), state.get("epoch"))
    if shuffle:
        # another rank's state of this run (nanochat's base_train) is all a shuffled stream can resume approximately
        other = ["the seeds' form"] if "version" not in state else [
            f"{k}: state {state['config'].get(k)!r}, loader {config.get(k)!r}" for k in STREAM_FIELDS
            if k not in ("rank", "world_size") and state["config"].get(k) != config.get(k)]
        if other:
            raise ValueError(f"{where} is not a state of this shuffled stream ({'; '.join(other)}), and a shuffled "
                             "loader cannot tell which documents were read under another order or on other data; "
                             "resume with the data and settings the state was taken with, or start afresh")
        epoch, window, _ = state["next"]
        logger.warning("%s is another rank's state: resuming approximately, after its window %d of epoch %d",
                       where, window, epoch)
        stream = Stream(reader, rank, world_size, batch_size, start=(epoch, window + 1, 0), epochs=epochs,
                        shuffle=shuffle)
        return stream, None, position
    if "version" in state and allow_state_mismatch:  # (another rank's state has said so already)
        logger.warning("%s is from another document stream; resuming approximately after its file %s, %s %s",
                       where, state.get("pq_idx"), reader.unit_name, state.get("rg_idx"))
    # the seeds' form: approximate, after the saved unit
    pq_idx, rg_idx, epoch = check_legacy_state(state, paths, reader, where)
    cursor = (epoch, pq_idx, (rg_idx // world_size + 1) * world_size + rank, 0)
    return Stream(reader, rank, world_size, batch_size, start=cursor, epochs=epochs), None, (pq_idx, rg_idx, epoch)
