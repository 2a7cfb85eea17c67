"""
The pure packing core (nanochat/packing.py) against the seeds' list-and-scan oracle (tests/oracle.py),
over random document lengths, buffer sizes and row capacities (hypothesis), plus the properties
every packed row must have. Run: python -m pytest tests/test_packing.py -q
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanochat.packing import BestFitPacker, ConcatPacker, token_dtype
from oracle import bestfit_rows

BOS = 0


def make_docs(lengths, start_id=1):
    """Documents [BOS, id, id+1, ...]: every token is unique, so any misplacement shows."""
    docs, next_id = [], start_id
    for n in lengths:
        docs.append([BOS] + list(range(next_id, next_id + n - 1)))
        next_id += n - 1
    return docs


def run_fast(docs, B, row_capacity, buffer_size, batch):
    """Pack with the fast core, refilling `batch` documents at a time from the list."""
    it = iter(docs)
    packer = BestFitPacker(row_capacity)

    def refill():
        chunk = [(np.array(d, dtype=np.uint32), d[1] if len(d) > 1 else None, 0) for _, d in zip(range(batch), it)]
        if not chunk:
            raise StopIteration
        return chunk

    rows = np.empty((B, row_capacity), dtype=np.int64)
    packer.fill(rows, refill, buffer_size)
    return rows, packer


def run_oracle(docs, B, row_capacity, buffer_size, batch):
    it = iter(docs)
    doc_buffer = []

    def refill():
        chunk = [d for _, d in zip(range(batch), it)]
        if not chunk:
            raise StopIteration
        doc_buffer.extend(chunk)

    return bestfit_rows(doc_buffer, refill, B, row_capacity, buffer_size)


doc_lengths = st.lists(st.integers(1, 80), min_size=1, max_size=400)


@settings(max_examples=300, deadline=None)
@given(lengths=doc_lengths, B=st.integers(1, 6), row_capacity=st.integers(2, 64),
       buffer_size=st.integers(1, 40), batch=st.integers(1, 9))
def test_bestfit_matches_oracle(lengths, B, row_capacity, buffer_size, batch):
    # cycle the lengths so the stream never runs dry: each placement takes at least one token
    # of a row, so B * row_capacity placements at most, plus one full buffer and one refill
    needed = B * row_capacity + buffer_size + batch
    docs = make_docs([lengths[i % len(lengths)] for i in range(needed)])
    expected, cropped = run_oracle(docs, B, row_capacity, buffer_size, batch)
    rows, packer = run_fast(docs, B, row_capacity, buffer_size, batch)
    assert rows.tolist() == expected
    assert packer.tokens_cropped == cropped
    # accounting closes: everything added is emitted, cropped, or still buffered
    assert packer.tokens_out == B * row_capacity


def test_bestfit_ties_go_to_the_earliest_document():
    # three documents of length 3 (ids distinguish them), capacity 6: rows get the first two, in order
    docs = [np.array([BOS, 10, 11]), np.array([BOS, 20, 21]), np.array([BOS, 30, 31])]
    packer = BestFitPacker(6)
    for d in docs:
        packer.add(d)
    row = np.zeros(6, dtype=np.int64)
    assert packer.place(row, 0) == 3 and packer.place(row, 3) == 6
    assert row.tolist() == [BOS, 10, 11, BOS, 20, 21]


def test_bestfit_seed_worked_example():
    # seed 002: A(4) B(3) C(6) D(2) into rows of 8 -> row 0 = C D; row 1 = A B + 1 cropped token
    A, B_, C, D = ([BOS] + [c] * (n - 1) for c, n in ((1, 4), (2, 3), (3, 6), (4, 2)))
    packer = BestFitPacker(8)
    for d in (A, B_, C, D):
        packer.add(np.array(d))
    row0, row1 = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    pos = 0
    while pos < 8:
        pos = packer.place(row0, pos)
    assert row0.tolist() == C + D
    pos = 0
    while pos < 8 and len(packer):
        pos = packer.place(row1, pos)
    assert row1[:7].tolist() == A + B_ and pos == 7  # the buffer ran out before the crop


def test_bestfit_crops_long_documents_shortest_first():
    packer = BestFitPacker(4)
    for n in (9, 7, 7, 12):
        packer.add(np.arange(n) + 100 * n)
    row = np.zeros(4, dtype=np.int64)
    packer.place(row, 0)  # nothing fits: crop the shortest (the first 7)
    assert row.tolist() == [700, 701, 702, 703]
    assert packer.tokens_cropped == 3 and len(packer) == 3


def test_bestfit_rows_have_the_packing_properties():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=3000)
    docs = make_docs(lengths.tolist())
    rows, packer = run_fast(docs, 64, 129, 50, 16)
    assert (rows[:, 0] == BOS).all()  # every row starts with a document
    assert max((row == BOS).sum() for row in rows) >= 2  # not vacuous: rows hold several documents
    emitted = rows[rows != BOS]
    assert len(np.unique(emitted)) == len(emitted)  # no token emitted twice
    assert packer.tokens_in == packer.tokens_out + packer.tokens_cropped + sum(
        len(d) for q in packer._by_length.values() for _, d in q) + sum(n for n, _, _ in packer._long)


def test_bestfit_bad_input():
    with pytest.raises(ValueError, match="row_capacity"):
        BestFitPacker(1)
    with pytest.raises(ValueError, match="empty document"):
        BestFitPacker(4).add(np.array([], dtype=np.uint16))


@settings(max_examples=100, deadline=None)
@given(lengths=doc_lengths, n=st.integers(1, 200))
def test_concat_is_the_stream(lengths, n):
    docs = make_docs(lengths)
    stream = [t for d in docs for t in d]
    it = iter(docs)
    packer = ConcatPacker()
    out, got = np.empty(n, dtype=np.int64), []
    for _ in range(len(stream) // n):
        packer.take(out, lambda: [(np.array(d), None, 0) for _, d in zip(range(3), it)])
        got.extend(out.tolist())
    assert got == stream[:len(got)]
    assert packer.tokens_out == len(got) and len(packer) == packer.tokens_in - len(got)


def test_token_dtype():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(None) == np.uint32
