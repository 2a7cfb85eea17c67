"""
Tokens to packed rows (nanochat/data/loader/rows.py), each step on its own with exact values: the
tokenizer's output checked and stored compactly (to_documents), pretokenized entries given BOS
(EntryDocuments), the documents fed to a packer with where the walk stands (DocumentFeed), a
resumed buffer read and tokenized again (restore_buffer), and the attention outputs of a batch.

    python -m pytest tests/data/loader/test_rows.py -q
"""

import numpy as np
import pytest

from nanochat.data.base.packing import BestFitPacker
from nanochat.data.base.state import (Cursor, DocKey, PlanUnit, Position, Progress, StateRecorder,
                                      UnitIndex)
from nanochat.data.loader.rows import (DocumentFeed, EntryDocuments, TokenBatch, attention_info,
                                       restore_buffer, to_documents)

BOS = 9


def test_to_documents_stores_lists_compactly():
    docs = to_documents([[BOS, 1, 2], (BOS,)], BOS, np.dtype(np.uint16))
    assert [d.tolist() for d in docs] == [[BOS, 1, 2], [BOS]]
    assert all(d.dtype == np.uint16 for d in docs)
    with pytest.raises(ValueError, match="does not start with the BOS token 9"):
        to_documents([[1, BOS]], BOS, np.dtype(np.uint16))
    with pytest.raises(ValueError, match=r"token id out of range \[0, 65535\]"):
        to_documents([[BOS, 70_000]], BOS, np.dtype(np.uint16))
    with pytest.raises(TypeError, match="lists of ints, got a list holding float"):
        to_documents([[BOS, 1.5]], BOS, np.dtype(np.uint16))


def test_entries_get_bos_only_where_they_lack_it():
    items = [(np.array([BOS, 4], np.uint32), 0), (np.array([4, 5], np.uint32), 1)]
    docs, overlaps = EntryDocuments(BOS)(items)
    assert [d.tolist() for d in docs] == [[BOS, 4], [BOS, 4, 5]] and overlaps == [0, 1]
    docs, _ = EntryDocuments(BOS, always=True)(items)  # GPT-Simple's: BOS before every entry
    assert [d.tolist() for d in docs] == [[BOS, BOS, 4], [BOS, 4, 5]]


def test_attention_info_of_two_rows():
    # row 0: documents at 0 and 3; row 1: at 0, 2 and 4 (T=5, at most 3 a row)
    info = attention_info([[0, 3], [0, 2, 4]], 5, 3)
    assert info["doc_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 2]]
    assert info["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 0]]
    # boundaries of the flattened 2x5 inputs, padded with B*T to B * 3 + 1 entries
    assert info["cu_seqlens"].tolist() == [0, 3, 5, 7, 9, 10, 10]
    with pytest.raises(ValueError, match="a row holds 3 documents, more than max_docs_per_row=2"):
        attention_info([[0, 1, 2]], 5, 2)


class Order:
    """The walk's side a feed and a restore use: where a state of it starts, places, documents."""
    first_position = Cursor(1, 0, 0, 0)
    state_name = "resume_state_dict"
    index = UnitIndex(["a.parquet"], lambda path: [4])

    def __init__(self):
        self.read = []

    def place(self, key):
        return key

    def progress(self, after, position):
        return Progress([PlanUnit(1, 0, 0, None, None)], after, position)

    def read_documents(self, keys, state_name):
        self.read.append((keys, state_name))
        return [f"text{key.doc_index}" for key in keys]


def test_the_feed_hands_documents_and_says_where_the_walk_stands():
    keys = [DocKey(1, 0, 0, 0), DocKey(1, 0, 0, 1)]
    docs = [np.array([BOS, 1]), np.array([BOS, 2, 3])]
    batch = TokenBatch(docs, [0, 1], keys, Cursor(1, 0, 0, 2), None)
    feed = DocumentFeed(iter([batch]), Order(), Position(0, 0, 1))
    assert feed.after == Cursor(1, 0, 0, 0)  # before the first batch: where the walk starts
    pieces = list(feed())
    assert [(p.key, p.overlap, p.start) for p in pieces] == [(keys[0], 0, None), (keys[1], 1, None)]
    assert feed.progress() == Progress([PlanUnit(1, 0, 0, None, None)], Cursor(1, 0, 0, 2),
                                       Position(0, 0, 1))


def test_restore_buffer_reads_each_document_once():
    # two pieces of document 1 and document 3 buffered; the packer gets all three entries back
    resumed = {"buffer": [[1, 0, 0, [1, 1, 3]]], "pieces": [[0, 0], [1, 2]], "offset": 0,
               "counters": {"docs_split": 1},
               "emitted": {"batches": 3, "tokens": 48, "hash": "0" * 32}}
    order = Order()

    def encoder(texts):
        return [np.array([BOS] + [ord(c) for c in text]) for text in texts], [0] * len(texts)

    recorder = StateRecorder("bestfit", order, encoder, {}, resumed)
    packer = BestFitPacker(8, "split", 0)
    restore_buffer(recorder, packer)
    key1, key3 = DocKey(1, 0, 0, 1), DocKey(1, 0, 0, 3)
    assert order.read == [([key1, key3], "resume_state_dict['buffer']")]  # each document once
    assert packer.buffered_keys() == [key1, key1, key3]
    assert packer.buffered_pieces() == [[0, 0], [1, 2]]
    assert packer.docs_split == 1
