"""
Checking a loader state and where a walk resumes from it (nanochat/data/base/state_checks.py), on
hand-made states over a stand-in for the data (two files of 2 units of 5 documents each): a state
whose buffer was edited is refused by its checksum alone; a field that is wrong on its own, or
names a place the data does not have, is refused with its name; check_resume says exactly where
the walk goes on, from a state of this loader or from nanochat's {pq_idx, rg_idx, epoch}.

    python -m pytest tests/data/base/test_state_checks.py -q
"""

import json

import pytest

from nanochat.data.base.state import (EMPTY_HASH, Cursor, DocKey, Position, UnitIndex,
                                      add_checksum, encode_keys, loader_config)
from nanochat.data.base.state_checks import (Resume, check_data, check_fields, check_resume,
                                             check_state)

PATHS = ["a.parquet", "b.parquet"]


class Reader:
    """What check_resume reads of a reader: the files, their units, what a unit is called."""
    paths = PATHS
    index = UnitIndex(PATHS, lambda path: [5, 5])
    unit_name = "row group"


def config(rank: int = 0, world_size: int = 1) -> dict:
    return loader_config("bestfit", "parquet", "train", PATHS, B=2, T=8, buffer_size=4,
                         batch_size=2, tokenizer="t", rank=rank, world_size=world_size,
                         policy=("crop", 0), sizes=[10, 20])


def state(**over) -> dict:
    """A state after one batch: the walk goes on at row 3 of file 0's unit 0, two documents of
    file 0 buffered."""
    fields = {"version": 2, "loader": "bestfit", "pq_idx": 0, "rg_idx": 0, "epoch": 1,
              "plan": [], "next": [1, 0, 0, 3],
              "buffer": encode_keys([DocKey(1, 0, 0, 1), DocKey(1, 0, 0, 2)]), "pieces": [],
              "offset": 0, "config": config(),
              "emitted": {"batches": 1, "tokens": 16, "hash": EMPTY_HASH}, "counters": {}}
    return add_checksum(fields | over)


def test_a_whole_state_continues_the_walk_exactly():
    assert check_state(state(), config(), Reader.index, allow_mismatch=False) is True


def test_a_state_whose_buffer_was_edited_is_refused():
    """Another buffer that is valid on its own and in the data: only the checksum tells."""
    edited = state()
    edited["buffer"] = encode_keys([DocKey(1, 0, 0, 1), DocKey(1, 0, 0, 4)])
    check_fields(edited)  # every field is fine on its own
    check_data(edited, Reader.index)  # and names places the data has
    with pytest.raises(ValueError, match=r"resume_state_dict\['checksum'\] does not match its "
                                         r"contents: the state was edited"):
        check_state(edited, config(), Reader.index, allow_mismatch=False)
    # allowed: it resumes from the edited buffer as it stands
    assert check_state(edited, config(), Reader.index, allow_mismatch=True) is True


@pytest.mark.parametrize("field,value,message", [
    ("next", [1, 0, 0], r"\['next'\] must be \[epoch >= 1, pq_idx, rg_idx, doc_index\]"),
    ("buffer", [[0, 0, 0, [1]]],
     r"\['buffer'\]\[0\] must be \[epoch >= 1, pq_idx, rg_idx, doc_indices\]"),
    ("buffer", [[1, 0, 0, [-1]]], r"\['buffer'\]\[0\] must be a non-empty list of indices"),
    ("offset", 2, r"\['offset'\] must be 0 for a best-fit state, got 2"),
    ("plan", [{"epoch": 1, "row_groups": "gA==", "total": 9}],
     r"\['plan'\]\[0\]\['row_groups'\] must be the base64 bitmap of 9 row groups"),
    ("counters", {"tokens_in": -1}, r"\['counters'\]\['tokens_in'\]"),
])
def test_a_field_wrong_on_its_own_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_fields(state(**{field: value}))


def test_a_buffer_larger_than_the_loader_keeps_is_refused():
    # best-fit keeps at most max(buffer_size, T+1) + tokenizer_batch_size = 9 + 2 documents
    keys = [DocKey(1, p, g, r) for p in range(2) for g in range(2) for r in range(3)]
    with pytest.raises(ValueError, match=r"holds 12 whole documents, more than the 11"):
        check_fields(state(buffer=encode_keys(keys)))


@pytest.mark.parametrize("field,value,message", [
    ("buffer", [[1, 0, 0, [5]]], r"\['buffer'\]\[0\] refers to document 5 of a.parquet row "
                                 r"group 0, which has 5 documents"),
    ("buffer", [[1, 2, 0, [0]]], r"\['buffer'\]\[0\] refers to file 2, row group 0"),
    ("next", [1, 0, 0, 5], r"\['next'\] = \[1, 0, 0, 5\] is not a place where rank 0 of 1 reads "
                           r"\(the data has 2 files\)"),
    ("plan", [{"epoch": 1, "row_groups": "gA==", "total": 3}],
     r"\['plan'\]\[0\]\['total'\] is 3, but the data has 4 row groups"),
])
def test_a_place_the_data_does_not_have_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_data(state(**{field: value}), Reader.index)


def test_the_next_unit_must_be_the_ranks_own():
    # rank 1 of 2 reads units 1, 3, ... of every file; just past a file's last one is a place too
    ok = state(next=[1, 1, 1, 0], config=config(1, 2))
    check_data(ok, Reader.index)
    check_data(state(next=[1, 0, 3, 0], config=config(1, 2)), Reader.index)
    with pytest.raises(ValueError, match=r"is not a place where rank 1 of 2 reads"):
        check_data(state(next=[1, 1, 0, 0], config=config(1, 2)), Reader.index)


def test_resume_exactly_from_a_state_of_this_walk():
    saved = state()
    assert check_resume(Reader(), 0, 1, saved, config(), allow_state_mismatch=False) == Resume(
        saved, "resume_state_dict", Cursor(1, 0, 0, 3), Position(0, 0, 1))


def test_resume_approximately_from_nanochats_keys():
    # after unit 0 of file 1: rank 1 of 2 goes on in the next round of 2 units, at its unit 3
    # (past the file's last: its walk goes on in the next file)
    resume = check_resume(Reader(), 1, 2, {"pq_idx": 1, "rg_idx": 0, "epoch": 3}, config(1, 2),
                          allow_state_mismatch=False)
    assert resume == Resume(None, "resume_state_dict", Cursor(3, 1, 3, 0), Position(1, 0, 3))
    # nanochat's concatenating loader saves no epoch: the first
    resume = check_resume(Reader(), 0, 1, {"pq_idx": 1, "rg_idx": 0}, config(),
                          allow_state_mismatch=False)
    assert resume.cursor == Cursor(1, 1, 1, 0) and resume.position == Position(1, 0, 1)
    with pytest.raises(ValueError, match=r"\['rg_idx'\]=7 points past the data"):
        check_resume(Reader(), 0, 1, {"pq_idx": 1, "rg_idx": 7}, config(),
                     allow_state_mismatch=False)


def test_resume_takes_this_ranks_part_of_a_merge():
    parts = [state(config=config(q, 2), next=[1, 0, q, 0]) for q in range(2)]
    merged = json.loads(json.dumps({"version": 2, "states": parts,
                                    "merged": {"from_world_size": 1, "world_size": 2}}))
    resume = check_resume(Reader(), 1, 2, merged, config(1, 2), allow_state_mismatch=False)
    assert resume.state_name == "resume_state_dict['states'][1]"
    assert resume.resumed == parts[1] and resume.cursor == Cursor(1, 0, 1, 0)
