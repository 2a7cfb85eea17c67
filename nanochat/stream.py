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

Documents are read through a reader (nanochat/readers.py); nothing here tokenizes.

May import: nanochat.state, nanochat.state_checks.
"""

import itertools
import logging

from nanochat.state import Key, Unit, decode_plan
from nanochat.state_checks import REQUIRED, check_state, rank_state

logger = logging.getLogger("nanochat.dataloader.stream")  # child of its old logger

Position = tuple[int, int, int]  # (pq_idx, rg_idx, epoch): the seeds' state keys
Cursor = tuple[int, int, int, int]  # (epoch, pq_idx, rg_idx, row): where a document batch starts
SEEDS_KEYS = ("pq_idx", "rg_idx", "epoch")


class Stream:
    """One rank's documents, in order: first its plan (work an elastic resume dealt to it), then the
    regular stream from `start`: per epoch, units (row groups, or chunks of a pretokenized shard)
    rank, rank + world_size, ... of every file, each cut into batches of `batch_size` documents."""

    def __init__(self, reader, rank: int, world_size: int, batch_size: int,
                 plan: list[Unit] = (), start: Cursor | None = None, epochs: int | None = None,
                 where: str = "resume_state_dict"):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.where = where  # what messages call the state it resumed from
        self.epochs = epochs  # None: forever; 1: one pass (a mixture's bucket), then the stream ends
        self.paths, self.index = reader.paths, reader.index
        self.tokenizer_batch_size = batch_size
        self.plan = list(plan)
        self.start = start if start is not None else (1, 0, rank, 0)  # (epoch, pq_idx, rg_idx, row)
        self.first_position = ("plan", 0, 0, None) if self.plan else ("regular", *self.start)

    def _unit(self, pq_idx: int, rg_idx: int, where: str):
        if not (0 <= pq_idx < len(self.paths) and 0 <= rg_idx < self.index.count(pq_idx)):
            raise ValueError(f"{where} refers to file {pq_idx}, {self.reader.unit_name} {rg_idx}, which this "
                             f"split does not have ({len(self.paths)} files): the state does not match the data")
        return self.reader.read(pq_idx, rg_idx)

    def _check_rows(self, rows, unit, pq_idx: int, rg_idx: int, where: str) -> None:
        n = self.reader.size(unit)
        if rows and not 0 <= min(rows) <= max(rows) < n:
            raise ValueError(f"{where} refers to row {max(rows)} of {self.paths[pq_idx]} {self.reader.unit_name} "
                             f"{rg_idx}, which has {n} rows: the state does not match the data")

    def read_documents(self, keys: list[Key], where: str) -> list:
        """The items of the given documents (for rebuilding a buffer), reading each unit once."""
        items = []
        for (pq_idx, rg_idx), group in itertools.groupby(keys, key=lambda k: (k[1], k[2])):
            rows = [key[3] for key in group]
            unit = self._unit(pq_idx, rg_idx, where)
            self._check_rows(rows, unit, pq_idx, rg_idx, where)
            items += self.reader.pick(unit, rows)
        return items

    def batches(self):
        """Yield (texts, keys, after): the keys (epoch, pq_idx, rg_idx, row) of the texts (a plan's
        pieces: (epoch, pq_idx, rg_idx, row, start)), and where the stream continues after them,
        ("plan", unit, offset, n) or ("regular", *cursor)."""
        tbs = self.tokenizer_batch_size
        for u, (epoch, pq_idx, rg_idx, rows, starts) in enumerate(self.plan):
            unit = self._unit(pq_idx, rg_idx, f"{self.where}['plan']")
            rows = range(self.reader.size(unit)) if rows is None else rows
            starts = starts or (None,) * len(rows)
            self._check_rows(rows, unit, pq_idx, rg_idx, f"{self.where}['plan']")
            for i in range(0, len(rows), tbs):
                chunk = rows[i:i + tbs]
                keys = [(epoch, pq_idx, rg_idx, r) if start is None else (epoch, pq_idx, rg_idx, r, start)
                        for r, start in zip(chunk, starts[i:i + tbs])]
                yield self.reader.pick(unit, chunk), keys, ("plan", u, i + len(chunk), len(rows))
        yield from self._regular()

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
                # the reference loops here forever; a rank with nothing to read is a configuration error
                raise ValueError(
                    f"rank {rank} of world size {world_size} receives no documents: the split's "
                    f"{len(self.paths)} file(s) have too few (non-empty) {self.reader.unit_name}s for this many "
                    f"ranks (they are dealt out rank, rank+{world_size}, ...); use fewer ranks or "
                    f"shards with more, smaller {self.reader.unit_name}s")
            epoch, pq_idx, rg_idx, row = epoch + 1, 0, rank, 0

    def remaining_plan(self, position) -> tuple[list[Unit], Cursor]:
        """(plan units not yet read, regular cursor) at a position yielded by batches()."""
        if position[0] == "regular":
            return [], tuple(position[1:])
        _, u, offset, n = position
        units = self.plan[u:]
        if offset:
            epoch, pq_idx, rg_idx, rows, starts = units[0]
            rest = tuple(range(offset, n)) if rows is None else tuple(rows[offset:])
            starts = None if starts is None else starts[offset:]
            units = ([(epoch, pq_idx, rg_idx, rest, starts)] if rest else []) + units[1:]
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
                 where: str = "resume_state_dict"):
    """The stream a loader starts from: fresh, or resumed from a state (version 2: exactly; the seeds'
    form, or another stream accepted with allow_state_mismatch: after the saved unit, as nanochat).
    where: what messages call the state. Returns (stream, version-2 start state or None, seeds position)."""
    paths = reader.paths
    if state is None:
        return Stream(reader, rank, world_size, batch_size, epochs=epochs), None, (0, 0, 1)
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
    if "merged" in state:  # elastic resume: every rank gets the merge, and takes its own part
        state, where = rank_state(state, rank, world_size, where)
    if "version" not in state and state.keys() & set(REQUIRED) - set(SEEDS_KEYS):
        raise ValueError(f"{where} is missing 'version' but has this loader's other keys "
                         f"({sorted(state.keys() & set(REQUIRED))}): a truncated state?")
    if "version" in state and check_state(state, config, reader.index, allow_mismatch=allow_state_mismatch,
                                          where=where):
        plan = decode_plan(state["plan"], reader.index)
        stream = Stream(reader, rank, world_size, batch_size, plan, tuple(state["next"]), epochs=epochs, where=where)
        return stream, state, (state["pq_idx"], state["rg_idx"], state["epoch"])
    if "version" in state and allow_state_mismatch:  # (another rank's state has said so already)
        logger.warning("%s is from another document stream; resuming approximately after its file %s, %s %s",
                       where, state.get("pq_idx"), reader.unit_name, state.get("rg_idx"))
    # the seeds' form: approximate, after the saved unit
    pq_idx, rg_idx, epoch = check_legacy_state(state, paths, reader, where)
    cursor = (epoch, pq_idx, (rg_idx // world_size + 1) * world_size + rank, 0)
    return Stream(reader, rank, world_size, batch_size, start=cursor, epochs=epochs), None, (pq_idx, rg_idx, epoch)
