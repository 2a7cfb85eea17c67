"""
The loader state's format and its building (nanochat/data/base/state.py), each piece on its own
with exact expected values: run-length rows, document keys (KeyEncoder against encode_keys,
exactly), bitmaps and plans, the checksum (every field counts, the order of fields does not),
UnitIndex's global numbering, and StateRecorder's state and restored buffer, on stand-ins for the
walk and the packer.

    python -m pytest tests/data/base/test_state.py -q
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanochat.data.base.state import (EMPTY_HASH, Cursor, DocKey, KeyEncoder, PlanUnit, Position,
                                      Progress, StateRecorder, UnitIndex, WindowKey, add_checksum,
                                      checksum, decode_bitmap, decode_keys, decode_plan,
                                      decode_indices, encode_bitmap, encode_keys, encode_plan,
                                      encode_indices, hash_tokens)

# three files: 2 units (5 and 3 documents), none, 1 unit (4 documents)
SIZES = {"a.parquet": [5, 3], "b.parquet": [], "c.parquet": [4]}


def index() -> UnitIndex:
    return UnitIndex(list(SIZES), SIZES.__getitem__)


# -----------------------------------------------------------------------------
# Compact encodings


def test_doc_indices_run_length():
    assert encode_indices([3, 4, 5, 9]) == [3, -2, 9]
    assert encode_indices([0, 1]) == [0, -1]  # index 0 starts a run too
    assert encode_indices([2, 1, 0]) == [2, 1, 0]  # only increasing neighbours run
    assert encode_indices([]) == []
    assert decode_indices([3, -2, 9]) == [3, 4, 5, 9]
    assert decode_indices([0, -1, 7, -3]) == [0, 1, 7, 8, 9, 10]


def test_keys_group_by_unit_and_window():
    keys = [DocKey(1, 0, 0, 3), DocKey(1, 0, 0, 4), DocKey(1, 0, 0, 5), DocKey(1, 0, 1, 0),
            WindowKey(2, 1, 7)]
    groups = [[1, 0, 0, [3, -2]], [1, 0, 1, [0]], [2, 1, [7]]]
    assert encode_keys(keys) == groups
    assert KeyEncoder()(keys) == groups
    decoded = decode_keys(groups)
    assert decoded == keys and [type(key) for key in decoded] == [DocKey] * 4 + [WindowKey]


def test_bitmap_bits_are_high_first():
    assert encode_bitmap([0, 9], 10) == "gEA="  # 0x80 0x40: bits 0 and 9 of two bytes
    assert decode_bitmap("gEA=", 10) == [0, 9]
    assert decode_bitmap(encode_bitmap([], 3), 3) == []


def test_plan_items_and_back():
    units = [PlanUnit(1, 0, 1, (0, 1, 2, 4), None), PlanUnit(1, 0, 0, None, None),
             PlanUnit(1, 2, 0, None, None), PlanUnit(2, 0, 0, None, None),
             PlanUnit(1, 0, 0, (2,), (7,))]
    items = encode_plan(units, index())
    assert items == [
        {"epoch": 1, "pq_idx": 0, "rg_idx": 1, "rows": [0, -2, 4]},
        # whole units of one epoch, in file order: global units 0 and 2 of 3 (0b101)
        {"epoch": 1, "row_groups": "oA==", "total": 3},
        {"epoch": 2, "row_groups": "gA==", "total": 3},  # another epoch: another bitmap
        {"epoch": 1, "pq_idx": 0, "rg_idx": 0, "rows": [2], "pieces": [[0, 7]]},
    ]
    assert decode_plan(items, index()) == units


# a key of a unit's document or of a shuffled window's entry: small ranges, so that heads repeat
# and indices run on (the cases encode_indices shortens)
doc_keys = st.builds(DocKey, st.integers(1, 2), st.integers(0, 1), st.integers(0, 2),
                     st.integers(0, 9))
window_keys = st.builds(WindowKey, st.integers(1, 2), st.integers(0, 2), st.integers(0, 9))
buffers = st.lists(st.lists(st.one_of(doc_keys, window_keys), max_size=40), min_size=1,
                   max_size=8)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(buffers, st.integers(0, 3))
def test_key_encoder_equals_encode_keys(batches, runs):
    encoder = KeyEncoder()  # one encoder over several buffers: numbered keys are reused
    for keys in batches:
        for _ in range(runs):  # runs of consecutive rows, as a refill adds them
            if keys:
                last = keys[-1]
                keys.append(last._replace(**{last._fields[-1]: last[-1] + 1}))
        assert encoder(keys) == encode_keys(keys)
        assert decode_keys(encoder(keys)) == [tuple(key) for key in keys]


def test_key_encoder_forgets_old_keys():
    encoder = KeyEncoder()
    for start in range(0, 20_000, 1_000):  # keys that leave the buffer are forgotten in bulk
        keys = [DocKey(1, start // 5_000, start // 1_000, row) for row in range(0, 1_000, 3)]
        assert encoder(keys) == encode_keys(keys)
    assert len(encoder._codes) <= 4 * 334 + 4096


# -----------------------------------------------------------------------------
# Checksum and fingerprints

STATE = {"version": 2, "loader": "bestfit", "pq_idx": 0, "rg_idx": 1, "epoch": 1, "plan": [],
         "next": [1, 0, 2, 0], "buffer": [[1, 0, 1, [0, -1]]], "pieces": [], "offset": 0,
         "config": {"B": 2}, "emitted": {"batches": 1, "tokens": 4, "hash": EMPTY_HASH},
         "counters": {}}


@pytest.mark.parametrize("field", sorted(STATE))
def test_every_field_is_in_the_checksum(field):
    """An edit of any field (the buffer too) gives another checksum."""
    edited = json.loads(json.dumps(STATE))
    edited[field] = [edited[field]]  # any other value
    assert checksum(edited) != checksum(STATE)


def test_checksum_ignores_field_order_and_itself():
    state = add_checksum(dict(STATE))
    assert state["checksum"] == checksum(dict(reversed(list(state.items()))))
    assert len(state["checksum"]) == 32
    edited = dict(state, buffer=[[1, 0, 1, [1, -1]]])  # another buffer, the old checksum
    assert checksum(edited) != edited["checksum"]


def test_hash_tokens_chains_in_one_byte_form():
    tokens = np.array([[1, 2], [3, 70_000]], dtype=np.int64)
    first = hash_tokens(EMPTY_HASH, tokens)
    # the same tokens in another dtype hash the same; the chain depends on the hash before
    assert first == hash_tokens(EMPTY_HASH, tokens.astype(np.uint32))
    assert hash_tokens(first, tokens) != first
    assert len(first) == 32 and int(first, 16) >= 0


# -----------------------------------------------------------------------------
# UnitIndex


def test_unit_index_numbers_units_across_files():
    reads = []
    idx = UnitIndex(list(SIZES), lambda path: reads.append(path) or SIZES[path])
    assert idx.docs(0, 1) == 3 and reads == ["a.parquet"]  # one file read, the others not yet
    assert idx.bases == [0, 2, 2, 3] and idx.total == 3
    assert reads == list(SIZES)  # each file read once
    assert [idx.locate(g) for g in range(3)] == [(0, 0), (0, 1), (2, 0)]  # past the empty file
    with pytest.raises(ValueError, match="past the end"):
        idx.locate(3)
    known = UnitIndex(["x"], lambda path: pytest.fail("read"), known_sizes=[[2, 2]])
    assert known.count(0) == 2 and known.docs(0, 1) == 2  # given sizes: nothing read


# -----------------------------------------------------------------------------
# StateRecorder: building the state, restoring a buffer


class Walk:
    """The recorder's view of a walk: its units and the name of the state it resumed from."""
    index = index()
    state_name = "resume_state_dict"


class Packer:
    """A packer's state-facing side: counters, buffered keys and pieces, what add() received."""
    COUNTERS = ("tokens_in", "docs_in")
    offset = 0

    def __init__(self):
        self.tokens_in, self.docs_in, self.added = 7, 2, []

    def buffered_keys(self):
        return [DocKey(1, 0, 1, 0), DocKey(1, 0, 1, 1)]

    def buffered_pieces(self):
        return []

    def add(self, doc, key, overlap, start):
        self.added.append((list(doc), key, overlap, start))


def test_recorder_builds_the_state_of_a_batch():
    watched = []
    recorder = StateRecorder("bestfit", Walk(), None, {"B": 2}, None,
                             lambda keys, at: watched.append((keys, at)))
    tokens = np.array([[1, 2, 3]], dtype=np.uint16)
    plan = [PlanUnit(1, 2, 0, None, None)]
    state = recorder.state(Packer(), Progress(plan, Cursor(2, 0, 0, 0), Position(0, 1, 1)), tokens)
    assert state == add_checksum({
        "version": 2, "loader": "bestfit", "pq_idx": 0, "rg_idx": 1, "epoch": 1,
        "plan": [{"epoch": 1, "row_groups": "IA==", "total": 3}],  # global unit 2 of 3
        "next": [2, 0, 0, 0], "buffer": [[1, 0, 1, [0, -1]]], "pieces": [], "offset": 0,
        "config": {"B": 2},
        "emitted": {"batches": 1, "tokens": 3, "hash": hash_tokens(EMPTY_HASH, tokens)},
        "counters": {"tokens_in": 7, "docs_in": 2}})
    # the file the walk goes on in: the plan's first unit's
    assert watched == [([DocKey(1, 0, 1, 0), DocKey(1, 0, 1, 1)], (1, 2))]
    # the counts go on from the state before
    again = recorder.state(Packer(), Progress([], Cursor(2, 0, 0, 0), Position(0, 1, 1)), tokens)
    assert again["emitted"]["batches"] == 2 and again["emitted"]["tokens"] == 6
    assert again["plan"] == []


def test_recorder_restores_the_buffer_in_arrival_order():
    resumed = {"buffer": [[1, 0, 1, [2]], [1, 0, 0, [4, -1]]], "pieces": [[1, 3]], "offset": 0,
               "counters": {"docs_in": 9},
               "emitted": {"batches": 5, "tokens": 40, "hash": "1" * 32}}
    recorder = StateRecorder("bestfit", Walk(), None, {}, resumed)
    keys = [DocKey(1, 0, 1, 2), DocKey(1, 0, 0, 4), DocKey(1, 0, 0, 5)]
    assert recorder.buffered() == (keys, [None, 3, None])
    documents = {keys[0]: ([0, 1], 0), keys[1]: ([0, 5, 6, 7, 8], 1), keys[2]: ([0], 0)}
    packer = Packer()
    recorder.restore(packer, documents)
    assert packer.added == [([0, 1], keys[0], 0, None), ([0, 5, 6, 7, 8], keys[1], 1, 3),
                            ([0], keys[2], 0, None)]
    assert packer.docs_in == 9 and packer.tokens_in == 7  # restored; a missing counter kept
    assert (recorder.batches, recorder.tokens, recorder.hash) == (5, 40, "1" * 32)
    short = {**documents, keys[1]: ([0, 5], 1)}  # the piece starts past its document's end
    with pytest.raises(ValueError, match=r"\['pieces'\] starts buffered entry 1 at token 3"):
        recorder.restore(Packer(), short)
