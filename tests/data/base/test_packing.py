"""
The pure packing core (nanochat/data/base/packing.py) against a list-and-scan oracle
(tests/oracle.py), over random document lengths, buffer sizes and row capacities (hypothesis), plus
the properties every packed row must have. Run: python -m pytest tests/data/base/test_packing.py -q
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanochat.data.base.packing import POLICIES, BestFitPacker, ConcatPacker, next_cut, token_dtype
from oracle import bestfit_policy_rows, bestfit_rows, split_document

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
        chunk = [(np.array(d, dtype=np.uint32), d[1] if len(d) > 1 else None, 0, None)
                 for _, d in zip(range(batch), it)]
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


@pytest.mark.slow
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
    # three documents of length 3 (ids distinguish them), capacity 6: rows get the first two, in
    # order
    docs = [np.array([BOS, 10, 11]), np.array([BOS, 20, 21]), np.array([BOS, 30, 31])]
    packer = BestFitPacker(6)
    for d in docs:
        packer.add(d)
    row = np.zeros(6, dtype=np.int64)
    assert packer.place(row, 0) == 3 and packer.place(row, 3) == 6
    assert row.tolist() == [BOS, 10, 11, BOS, 20, 21]


def test_bestfit_nanochat_worked_example():
    # nanochat's worked example: A(4) B(3) C(6) D(2) into rows of 8
    # -> row 0 = C D; row 1 = A B + 1 cropped token
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
        len(d) for q in packer._by_length.values() for _, d in q) + sum(
        n for n, _, _ in packer._long)


def test_bestfit_bad_input():
    with pytest.raises(ValueError, match="row_capacity"):
        BestFitPacker(1)
    with pytest.raises(ValueError, match="empty document"):
        BestFitPacker(4).add(np.array([], dtype=np.uint16))


def concat_refill(docs, it, batch=3):
    """A refill that hands the packer the next `batch` (index, start) of `it`: the document of that
    index, keyed by it, whole (start None) or from token `start` on."""
    return lambda: [(np.array(docs[k]), k, 0, start) for _, (k, start) in zip(range(batch), it)]


@settings(max_examples=100, deadline=None)
@given(lengths=doc_lengths, n=st.integers(2, 200))
def test_concat_windows_overlap_by_one(lengths, n):
    # each take reads n tokens and consumes n - 1: every window's last token is the next one's
    # first, and the windows without their last token, then the final token, are the stream, none
    # skipped
    docs = make_docs(lengths)
    stream = [t for d in docs for t in d]
    packer, refill = ConcatPacker(), concat_refill(docs, ((k, None) for k in range(len(docs))))
    out, windows = np.empty(n, dtype=np.int64), []
    for _ in range((len(stream) - 1) // (n - 1)):  # as many as the stream can fill
        packer.take(out, refill)
        windows.append(out.tolist())
        consumed = len(windows) * (n - 1)
        assert packer.tokens_out == consumed and len(packer) == packer.tokens_in - consumed >= 1
    assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))
    got = [t for w in windows for t in w[:-1]] + windows[-1][-1:] if windows else []
    assert got == stream[:len(got)]


@settings(max_examples=100, deadline=None)
@given(lengths=doc_lengths, n=st.integers(2, 60), k=st.integers(0, 8), data=st.data())
def test_concat_restores_from_keys_pieces_and_offset(lengths, n, k, data):
    # a packer rebuilt from what a state holds (entry keys, pieces, offset) continues the stream
    # exactly; every third entry is the rest of its document, from a start that varies
    docs = make_docs(lengths)
    order = list(range(len(docs))) * (2 + 2 * n * (k + 3) // len(docs))  # never runs dry
    it = iter([(k, None if i % 3 else i % len(docs[k])) for i, k in enumerate(order)])
    packer, refill = ConcatPacker(), concat_refill(docs, it)
    out = np.empty(n, dtype=np.int64)
    for _ in range(k):
        packer.take(out, refill)
    restored = ConcatPacker()
    starts = dict(packer.buffered_pieces())
    for i, key in enumerate(packer.buffered_keys()):
        restored.add(np.array(docs[key]), key, 0, starts.get(i))
    if packer.buffered_keys():
        restored.skip_consumed(packer.offset)
    assert len(restored) == len(packer)
    rest = list(it)  # from here on, both refill from the same entries
    mine, theirs = concat_refill(docs, iter(rest)), concat_refill(docs, iter(rest))
    copy = np.empty(n, dtype=np.int64)
    for _ in range(4):
        packer.take(out, mine)
        restored.take(copy, theirs)
        assert out.tolist() == copy.tolist()
    # a piece: the document from token `start` on
    doc = docs[data.draw(st.integers(0, len(docs) - 1))]
    start = data.draw(st.integers(0, len(doc) - 1))
    piece = ConcatPacker()
    piece.add(np.array(doc), "d", 0, start)
    assert (piece.buffered_pieces() == [[0, start]]
            and len(piece) == piece.tokens_in == len(doc) - start)
    piece_out = np.empty(len(doc) - start, dtype=np.int64)
    piece.take(piece_out, lambda: [])
    assert piece_out.tolist() == doc[start:]
    with pytest.raises(ValueError, match="a piece starting at token"):
        piece.add(np.array(doc), "d", 0, len(doc))


def test_token_dtype():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(None) == np.uint32


# -----------------------------------------------------------------------------
# Long-document policies


def policy_case(data, max_length=150):
    """Random documents with unique token ids, some of them pretokenized windows (their first tokens
    after BOS repeat a previous window), and a random policy, overlap and shapes."""
    lengths = data.draw(st.lists(st.integers(1, max_length), min_size=1, max_size=200),
                        label="lengths")
    capacity = data.draw(st.integers(2, 64), label="row_capacity")
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    overlap = 0 if policy == "crop" else data.draw(st.integers(0, capacity - 2), label="overlap")
    docs = make_docs(lengths)
    windows = [min(data.draw(st.integers(0, 3), label="window"), len(d) - 1) for d in docs]
    return docs, windows, capacity, policy, overlap


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(data=st.data(), B=st.integers(1, 6), buffer_size=st.integers(1, 40), batch=st.integers(1, 9))
def test_policies_match_oracle(data, B, buffer_size, batch):
    docs, windows, capacity, policy, overlap = policy_case(data)
    # enough documents that the stream never runs dry (every placement takes at least one token)
    needed = B * capacity + buffer_size + batch
    order = [i % len(docs) for i in range(needed)]

    stream = iter(order)
    oracle_buffer = []

    def oracle_refill():
        for i in [i for _, i in zip(range(batch), stream)]:
            tokens = split_document(docs[i], i, capacity, overlap, windows[i])
            oracle_buffer.extend(tokens if policy != "crop" else [sum(tokens, [])])

    expected, cropped = bestfit_policy_rows(oracle_buffer, oracle_refill, B, capacity, buffer_size,
                                            policy, overlap, docs)

    fast_stream = iter(order)
    packer = BestFitPacker(capacity, policy, overlap)

    def refill():
        return [(np.array(docs[i], dtype=np.uint32), i, windows[i], None)
                for _, i in zip(range(batch), fast_stream)]

    rows = np.empty((B, capacity), dtype=np.int64)
    packer.trace = []
    packer.fill(rows, refill, buffer_size)
    assert rows.tolist() == [[t[0] for t in row] for row in expected]
    # the trace names each placement: (document, None) for a whole document, (document, 0) for the
    # first piece of a split one, (document, start > 0) for a piece that continues it
    for row, traced in zip(expected, packer.trace):
        heads = [t for t in row if t[0] == BOS]  # every placement starts with the only BOS token
        assert [key for key, _ in traced] == [t[1] for t in heads]
        for t, (_, start) in zip(heads, traced):
            whole = policy == "crop" or len(docs[t[1]]) <= capacity
            assert start == (None if whole else 0) if t[3] == "doc" else start > 0
    masked = {(r, t) for r, start, end in packer.masked for t in range(start, end)}
    # masked targets are exactly those that predict a repeated token (a piece's overlap, a window's)
    assert masked == {(r, t) for r, row in enumerate(expected) for t in range(capacity - 1)
                      if row[t + 1][4]}
    tagged = [t for row in expected for t in row]
    assert packer.tokens_cropped == cropped
    assert packer.tokens_bos_added == sum(t[3] == "bos" for t in tagged)
    assert packer.tokens_repeated == sum(t[3] == "copy" for t in tagged)
    assert packer.tokens_masked == len(masked)
    if policy == "split_reuse":
        assert packer.tokens_cropped == 0


def drain(packer, capacity):
    """Place everything buffered (rows of `capacity`, the last one partial); returns (rows, masked
    target set). Uses _place() so the buffer can run empty."""
    rows, masked = [], set()
    while len(packer):
        row, pos = np.zeros(capacity, dtype=np.int64), 0
        while pos < capacity and len(packer):
            start = pos
            pos, _, _, n_masked = packer._place(row, pos)
            masked |= {(len(rows), t) for t in range(start, min(start + n_masked, pos - 1))}
        rows.append(row[:pos])
    return rows, masked


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_policy_accounting_closes(data):
    docs, _, capacity, policy, overlap = policy_case(data, max_length=300)
    packer = BestFitPacker(capacity, policy, overlap)
    for i, doc in enumerate(docs):
        packer.add(np.array(doc), i)
    rows, masked = drain(packer, capacity)
    # every token id except BOS is unique to one document position: count where each one went
    emitted, repeats = [], []
    for r, row in enumerate(rows):
        assert row[0] == BOS  # every row (and every piece) starts with BOS
        for t in range(1, len(row)):
            if row[t] != BOS:
                (repeats if (r, t - 1) in masked else emitted).append(int(row[t]))
    every = [t for d in docs for t in d[1:]]
    assert len(emitted) == len(set(emitted))  # no token trained on twice
    assert set(repeats) <= set(emitted)  # masked tokens are repeats of emitted ones
    assert len(every) - len(emitted) == packer.tokens_cropped  # the rest was cropped, and counted
    assert packer.tokens_repeated == len(repeats)
    assert packer.tokens_in == sum(map(len, docs))
    assert packer.tokens_out == sum(map(len, rows))
    assert packer.tokens_out - packer.tokens_bos_added - packer.tokens_repeated \
        + packer.tokens_cropped == packer.tokens_in
    assert packer.stats()["buffer_tokens"] == 0
    if policy == "split_reuse":
        assert sorted(emitted) == sorted(every)  # nothing is lost
    if policy != "crop":
        assert all(len(row) <= capacity for row in rows)
        assert packer.docs_split >= sum(len(d) > capacity for d in docs)


def test_split_cuts_like_windowing():
    # capacity 8, overlap 2: pieces [0, 8), then 5 new tokens each, after BOS and 2 repeats
    assert [next_cut(s, 8, 2) for s in (0, 7, 8, 12, 13, 18)] == [8, 8, 13, 13, 18, 23]
    doc = np.array([BOS] + list(range(1, 20)))
    packer = BestFitPacker(8, "split", 2)
    packer.add(doc, "d")
    assert packer.docs_split == 1
    assert packer.buffered() == [("d", 0), ("d", 8), ("d", 13), ("d", 18)]
    rows, masked = drain(packer, 8)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 6, 7, 8, 9, 10, 11, 12],
                                          [0, 11, 12, 13, 14, 15, 16, 17], [0, 16, 17, 18, 19]]
    assert masked == {(r, t) for r in (1, 2, 3) for t in (0, 1)}


def test_split_reuse_puts_the_cropped_rest_back():
    packer = BestFitPacker(6, "split_reuse", 1)
    packer.add(np.array([BOS, 1, 2, 3]), "a")
    packer.add(np.array([BOS, 4, 5, 6, 7]), "b")
    row = np.zeros(6, dtype=np.int64)
    assert packer.place(row, 0) == 5 and packer.place(row, 5) == 6  # b whole, then a's BOS alone
    assert row.tolist() == [BOS, 4, 5, 6, 7, BOS] and packer.tokens_cropped == 0
    assert packer.buffered() == [("a", 1)] and packer.docs_split == 1
    row = np.zeros(6, dtype=np.int64)
    # no overlap before token 1
    assert packer.place(row, 0) == 4 and row[:4].tolist() == [BOS, 1, 2, 3]


def test_policy_bad_input():
    with pytest.raises(ValueError, match="long_doc_policy must be one of"):
        BestFitPacker(8, "truncate")
    with pytest.raises(ValueError, match=r"split_overlap must be an integer in \[0, 6\]"):
        BestFitPacker(8, "split", 7)
    with pytest.raises(ValueError, match="needs long_doc_policy='split'"):
        BestFitPacker(8, "crop", 2)
    with pytest.raises(ValueError, match="piece starting at token 9 of a 5-token document"):
        BestFitPacker(8, "split").add_piece(np.arange(5), "k", 0, 9)
