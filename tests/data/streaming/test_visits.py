"""
The order of a streaming loader's shard visits (nanochat/data/streaming/visits.py), pure: where the
reader is, the shards fetched ahead, those read and not yet packed, those read later (spared
longest by eviction), and a reader that opens a shard further on in the order.

    python -m pytest tests/data/streaming/test_visits.py -q
"""

from nanochat.data.streaming.visits import Visits

NAMES = [f"s{i}" for i in range(4)]
# two epochs of 4 shards, shard 2 visited twice in a row by a plan first
ORDER = [(0, 2), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_the_reader_and_what_it_reads_next():
    visits = Visits(NAMES, prefetch_shards=2, later_count=3)
    assert (visits.current(), visits.ahead(), visits.packing(), visits.later()) == (
        None, [], set(), ())
    visits.begin(iter(ORDER))
    assert visits.current() == 2 and visits.ahead() == [0, 1]
    assert visits.visits == ORDER[:3]  # looked at lazily: the reader's and prefetch_shards'
    assert visits.first_visit(1) == 2 and visits.first_visit(3) == 3  # (3: past all looked at)
    assert visits.later() == ("s2", "s3", "s0")  # past the 2 ahead, distinct, soonest first
    assert visits.first_visit(3) == 4  # (looked at by now)


def test_a_reader_moves_to_a_shard_further_on_and_the_packing_span_follows():
    visits = Visits(NAMES, prefetch_shards=1, later_count=0)
    visits.begin(iter(ORDER))
    assert visits.move_to(1)  # two visits on
    assert (visits.current(), visits.ahead()) == (1, [2])
    # nothing dealt yet: everything from the first visit to the reader's may be unpacked
    assert visits.packing() == {2, 0, 1}
    visits.deal((0, 0))  # a state's walk goes on in shard 0: visits before it are packed
    assert visits.packing() == {0, 1}
    visits.deal((0, 7))  # a file the order does not visit: nothing changes
    assert visits.packing() == {0, 1}
    assert visits.move_to(0)  # the next epoch's visit of shard 0
    assert visits.at == 5 and visits.current() == 0
    assert not visits.move_to(9) and visits.at == 5  # not in the order: the reader stays
    assert visits.later() == ()  # later_count=0: no budget to list them under
