"""
The rank's walk (nanochat/data/loader/order.py) on a stand-in reader (two files: units of 3 and 2
documents, then one of 4), with exact expected batches: where start_order starts a walk (fresh, or
after nanochat's keys), the regular walk's units rank, rank + world_size, ... cut into document
batches, each with where the walk goes on after it; a plan read first, a unit's chosen rows and
pieces, then a whole unit; what a state records at each place (progress); the files a streaming
loader fetches, in order.

    python -m pytest tests/data/loader/test_order.py -q
"""

from nanochat.data.base.state import Cursor, DocKey, PlanUnit, Position, Progress, UnitIndex
from nanochat.data.loader.order import PlanPlace, RankOrder, Started, start_order

SIZES = {"a.parquet": [3, 2], "b.parquet": [4]}


class Reader:
    """A reader's walk-facing side: documents are named "<pq_idx><rg_idx><row>"."""
    paths = list(SIZES)
    unit_name = "row group"

    def __init__(self):
        self.index = UnitIndex(self.paths, SIZES.__getitem__)

    def read(self, pq_idx, rg_idx, doc_indices=None):
        return [f"{pq_idx}{rg_idx}{r}" for r in range(SIZES[self.paths[pq_idx]][rg_idx])]

    size = staticmethod(len)

    @staticmethod
    def take(unit, first, stop):
        return unit[first:stop]

    @staticmethod
    def pick(unit, doc_indices):
        return [unit[i] for i in doc_indices]


def test_start_order_starts_a_fresh_walk_at_the_ranks_first_unit():
    started = start_order(Reader(), 1, 2, 2, None, {}, allow_state_mismatch=False)
    assert isinstance(started, Started) and started.resumed is None
    assert started.position == Position(0, 0, 1)
    assert started.order.cursor == Cursor(1, 0, 1, 0) and started.order.plan == []


def test_start_order_after_nanochats_keys():
    # after unit 0 of file 1: rank 0 of 1 goes on at that file's unit 1 (past its last: file 2)
    started = start_order(Reader(), 0, 1, 2, {"pq_idx": 1, "rg_idx": 0, "epoch": 2}, {},
                          allow_state_mismatch=False)
    assert started.resumed is None and started.position == Position(1, 0, 2)
    assert started.order.cursor == Cursor(2, 1, 1, 0)


def test_the_regular_walk_reads_the_ranks_units_in_batches():
    order = RankOrder(Reader(), 0, 2, 2, epochs=2)
    batches = list(order.document_batches())
    assert [(b.items, b.after) for b in batches[:4]] == [
        (["000", "001"], Cursor(1, 0, 0, 2)),
        (["002"], Cursor(1, 0, 2, 0)),  # the unit's last batch: the rank's next unit, 0 + 2
        (["100", "101"], Cursor(1, 1, 0, 2)),
        (["102", "103"], Cursor(1, 1, 2, 0)),
    ]
    assert batches[0].keys == [DocKey(1, 0, 0, 0), DocKey(1, 0, 0, 1)]
    # epoch 2 reads the same units again, and then the walk of 2 epochs ends
    assert [b.items for b in batches[4:]] == [b.items for b in batches[:4]]
    assert [b.after.epoch for b in batches] == [1] * 4 + [2] * 4
    assert order.progress(batches[0].after, Position(0, 0, 1)) == Progress(
        [], Cursor(1, 0, 0, 2), Position(0, 0, 1))


def test_a_plan_is_read_first_then_the_regular_walk():
    # chosen rows of a unit (the second a piece from token 2), then a whole unit
    plan = [PlanUnit(1, 1, 0, (3, 1), (None, 2)), PlanUnit(1, 0, 0, None, None)]
    order = RankOrder(Reader(), 1, 2, 2, epochs=1, plan=plan)
    assert order.first_position == PlanPlace(0, 0, None)
    batches = list(order.document_batches())
    assert [(b.items, b.after, b.starts) for b in batches] == [
        (["103", "101"], PlanPlace(0, 2, 2), (None, 2)),
        (["000", "001"], PlanPlace(1, 2, 3), (None, None)),
        (["002"], PlanPlace(1, 3, 3), (None,)),
        (["010", "011"], Cursor(1, 0, 3, 0), None),  # the regular walk: rank 1's unit of file 0
    ]
    at = Position(0, 0, 1)
    # what a state records: the plan's unread units (the begun one's rows left), then the cursor
    assert [order.progress(b.after, at).plan for b in batches] == [
        [PlanUnit(1, 0, 0, None, None)], [PlanUnit(1, 0, 0, (2,), None)], [], []]
    assert order.progress(batches[0].after, at).cursor == Cursor(1, 0, 1, 0)


def test_the_files_a_streaming_walk_visits():
    plan = [PlanUnit(1, 1, 0, (3,), None), PlanUnit(1, 0, 0, None, None)]
    order = RankOrder(Reader(), 1, 2, 2, epochs=2, plan=plan)
    # the plan's files, then per epoch the files holding a unit of rank 1 (file 1 has none)
    assert list(order.file_visits()) == [(1, 1), (1, 0), (1, 0), (2, 0)]
    assert order.plan_files(1) == [1] and order.plan_files(2) == [1, 0]
