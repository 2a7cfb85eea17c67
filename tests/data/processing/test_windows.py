"""
Windowing long documents (nanochat/data/processing/windows.py) in both conventions: the
docstring's worked examples, hypothesis property tests (every document token once, each window
bringing a new one, the overlap repeating the previous window), the argument checks, and
GPT-Simple's labelling rule applied to our gpt-simple entries. Run:
    python -m pytest tests/data/processing/test_windows.py -q
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import gpt_simple_windows
from nanochat.data.processing.windows import window_document, window_gpt_simple

BOS = 9  # a stand-in BOS id


def test_window_worked_example_from_the_docstring():
    doc = np.array([BOS] + list(range(100, 110)), np.uint16)  # BOS d0..d9
    windows = window_document(doc, 6, 2)
    assert [(w.tolist(), o) for w, o in windows] == [
        ([BOS, 100, 101, 102, 103, 104], 0),
        ([BOS, 103, 104, 105, 106, 107], 2),
        ([BOS, 106, 107, 108, 109], 2),
    ]
    assert all(w.dtype == np.uint16 for w, _ in windows)
    # with no overlap, windows tile the document
    assert [w.tolist() for w, _ in window_document(doc, 6, 0)] == [
        [BOS, 100, 101, 102, 103, 104], [BOS, 105, 106, 107, 108, 109]]
    # an entry that fits is returned whole
    assert [(w.tolist(), o) for w, o in window_document(doc[:6], 6, 2)] == [(doc[:6].tolist(), 0)]


@settings(max_examples=300, deadline=None)
@given(doc_len=st.integers(0, 200), max_length=st.integers(2, 40), data=st.data())
def test_windows_property(doc_len, max_length, data):
    overlap = data.draw(st.integers(0, max(0, min(max_length // 2, max_length - 2))))
    doc = np.arange(1000, 1000 + doc_len, dtype=np.uint32)  # distinct, so any misplacement shows
    windows = window_document(np.concatenate(([BOS], doc)).astype(np.uint32), max_length, overlap)
    rebuilt = []
    for k, (w, o) in enumerate(windows):
        assert 1 <= len(w) <= max_length and w[0] == BOS and w.dtype == np.uint32
        assert o == (overlap if k > 0 else 0)
        if k > 0:
            # the overlap is the previous window's last O document tokens, and something new follows
            if o:
                assert w[1:1 + o].tolist() == windows[k - 1][0][-o:].tolist()
            assert w[1:1 + o].tolist() == rebuilt[len(rebuilt) - o:]
            assert len(w) > 1 + o
        rebuilt += w[1 + o:].tolist()
    assert rebuilt == doc.tolist()
    assert len(windows) == 1 or len(windows[0][0]) == max_length  # window 0 is always full
    assert all(len(w) == max_length for w, _ in windows[:-1])


def test_window_arguments_are_checked():
    doc = np.arange(20, dtype=np.uint16)
    with pytest.raises(ValueError, match=r"overlap_size 5 .* max_length // 2 = 4 \(max_length 8\)"):
        window_document(doc, 8, 5)
    with pytest.raises(ValueError, match="overlap_size -1"):
        window_document(doc, 8, -1)
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        window_document(doc, 1, 0)
    with pytest.raises(ValueError, match="no new token per window at max_length 2"):
        window_document(doc, 2, 1)


# GPT-Simple's convention: the document + EOD, no BOS; the overlap prefix counts the entry's
# leading tokens

EOD = 9  # the stand-in BOS, which --convention gpt-simple writes as EOD


def test_gpt_simple_window_worked_example():
    doc = np.array(list(range(100, 110)) + [EOD], np.uint16)  # d0..d9 EOD: 11 tokens
    windows = window_gpt_simple(doc, 6, 2)
    assert [(w.tolist(), o) for w, o in windows] == [
        ([100, 101, 102, 103, 104, 105], 0),
        # 104 105 repeat window 0's end: the entry's first 2 tokens
        ([104, 105, 106, 107, 108, 109], 2),
        # only the last window holds the EOD; no window of repeated tokens alone
        ([108, 109, EOD], 2),
    ]
    assert all(w.dtype == np.uint16 and w.base is doc for w, _ in windows)  # views, no copies
    # the tokens and EOD fit: one entry
    assert [(w.tolist(), o) for w, o in window_gpt_simple(doc, 11, 2)] == [(doc.tolist(), 0)]
    # a document of exactly L tokens: its EOD is a window alone (GPT-Simple's writer would make it
    # L + 1 long)
    assert [(w.tolist(), o) for w, o in window_gpt_simple(doc[-7:], 6, 0)] == [
        ([104, 105, 106, 107, 108, 109], 0), ([EOD], 0)]
    assert [(w.tolist(), o) for w, o in window_gpt_simple(np.array([EOD], np.uint16), 6, 2)] == [
        ([EOD], 0)]
    with pytest.raises(ValueError, match=r"overlap_size 4 .* max_length // 2 = 3"):
        window_gpt_simple(doc, 6, 4)


@settings(max_examples=300, deadline=None)
@given(doc_len=st.integers(0, 200), max_length=st.integers(2, 40), data=st.data())
def test_gpt_simple_windows_property(doc_len, max_length, data):
    overlap = data.draw(st.integers(0, max(0, min(max_length // 2, max_length - 2))))
    tokens = np.arange(1000, 1000 + doc_len + 1, dtype=np.uint32)
    tokens[-1] = EOD
    windows = window_gpt_simple(tokens, max_length, overlap)
    assert [(w.tolist(), o) for w, o in windows] == gpt_simple_windows(
        tokens.tolist(), max_length, overlap)
    rebuilt = []
    for k, (w, o) in enumerate(windows):
        assert 1 <= len(w) <= max_length and w.dtype == np.uint32
        assert o == (overlap if k else 0) and len(w) > o  # each window brings a new token
        # the leading O tokens repeat the previous window
        assert w[:o].tolist() == rebuilt[len(rebuilt) - o:]
        assert (w == EOD).sum() == (k == len(windows) - 1)  # the EOD, in the last window only
        rebuilt += w[o:].tolist()
    assert rebuilt == tokens.tolist()
    assert all(len(w) == max_length for w, _ in windows[:-1])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=8), max_length=st.integers(2, 24),
       data=st.data())
def test_gpt_simple_labels_train_each_token_once(lengths, max_length, data):
    """GPT-Simple's documented labelling rule (its loader's; written here in a few lines), applied
    to our gpt-simple entries of several documents packed in order: labels are the input ids (the
    model shifts them, so labels[0] trains nothing), labels[pos:pos+O] = -100 for an entry with
    overlap prefix O at position pos, and the label right after each EOD is -100. What is trained
    is each document's tokens after its first (which follows the previous EOD), then its EOD: every
    token once, none twice, none lost. And no entry is longer than max_length, so GPT-Simple's
    loader at that max_length crops none."""
    overlap = data.draw(st.integers(0, max(0, min(max_length // 2, max_length - 2))))
    documents, entries, next_id = [], [], 1000
    for n in lengths:
        # distinct ids, so a misplaced one shows
        documents.append(list(range(next_id, next_id + n)))
        next_id += n
        entries += window_gpt_simple(np.array(documents[-1] + [EOD], np.uint32), max_length,
                                     overlap)
    assert all(len(entry) <= max_length for entry, _ in entries)
    inputs = [int(t) for entry, _ in entries for t in entry]
    labels, pos = list(inputs), 0
    for entry, o in entries:
        labels[pos:pos + o] = [-100] * o
        pos += len(entry)
    for i in range(1, len(inputs)):
        if inputs[i - 1] == EOD:
            labels[i] = -100
    assert [t for t in labels[1:] if t != -100] == [t for doc in documents
                                                    for t in (doc + [EOD])[1:]]
