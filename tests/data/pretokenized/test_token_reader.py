"""
Tests for reading pretokenized .bin/.idx pairs (nanochat/data/pretokenized/token_reader.py) on tiny
pairs written with token_shards' writer: chunk_index's exact chunk sizes, the exact documents a
TokenShardReader reads, check_ids' refusal of an id outside the vocabulary (its message), and
shard_vocab reading the BOS and vocabulary from pretokenize.json. Run:
    python -m pytest tests/data/pretokenized/test_token_reader.py -q
"""

import json
import os
import re

import numpy as np
import pytest

from nanochat.data.pretokenized.token_reader import (ShardVocab, TokenShardReader, check_ids,
                                                     chunk_index, shard_vocab)
from nanochat.data.pretokenized.token_shards import META_FILENAME, TokenShard, write_token_shard

# 5 entries, each starting with BOS 0; entry 3 has an overlap of 1
ENTRIES = [[0, 1, 2], [0, 3], [0], [0, 4, 5, 6], [0, 7]]
OVERLAPS = [0, 0, 0, 1, 0]


def pair(directory, name: str = "shard_00000", entries=ENTRIES, overlaps=OVERLAPS) -> str:
    """A .bin/.idx pair of uint16 entries in directory; its .bin path."""
    prefix = os.path.join(str(directory), name)
    write_token_shard(prefix, [np.array(e, dtype=np.uint16) for e in entries], overlaps, np.uint16)
    return prefix + ".bin"


def test_chunk_index_counts_chunks_of_chunk_size_entries_the_last_short(tmp_path):
    paths = [pair(tmp_path, "a"), pair(tmp_path, "b", ENTRIES[:2], OVERLAPS[:2])]
    index = chunk_index(paths, 2)
    assert index.sizes(0) == [2, 2, 1]
    assert index.sizes(1) == [2]
    assert index.total == 4 and index.chunk_size == 2


def test_a_reader_reads_each_chunks_documents_and_overlaps(tmp_path):
    path = pair(tmp_path)
    reader = TokenShardReader([path], 2, ShardVocab(0, 10, "test", "nanochat", None))
    chunks = [reader.read(0, rg) for rg in range(3)]
    assert [reader.size(chunk) for chunk in chunks] == [2, 2, 1]
    read = [(tokens.tolist(), overlap) for chunk in chunks
            for tokens, overlap in reader.take(chunk, 0, reader.size(chunk))]
    assert read == list(zip(ENTRIES, OVERLAPS))
    assert [(t.tolist(), o) for t, o in reader.pick(chunks[1], [1])] == [([0, 4, 5, 6], 1)]


def test_an_id_outside_the_vocabulary_is_refused_naming_the_entry(tmp_path):
    path = pair(tmp_path)
    shard = TokenShard(path)
    check_ids(shard, 0, 5, 10, "the vocab_size argument")  # every id < 10: fine
    message = re.escape(f"{path}: entry 3 holds token id 6 (token 3 of the entry), outside the "
                        "vocabulary [0, 6) (the vocab_size argument); the shard is damaged or was "
                        "written with another tokenizer: delete the pair and rerun "
                        "python -m nanochat.pretokenize")
    with pytest.raises(ValueError, match=message):
        check_ids(shard, 0, 5, 6, "the vocab_size argument")
    check_ids(shard, 0, 3, 6, "the vocab_size argument")  # entries 0-2 only: all below 6
    check_ids(shard, 0, 5, 8, "the vocab_size argument")  # the largest id, 7, is the last allowed
    with pytest.raises(ValueError, match=r"entry 4 holds token id 7 \(token 1 of the entry\), "
                                         r"outside the vocabulary \[0, 7\)"):
        check_ids(shard, 0, 5, 7, "the vocab_size argument")
    reader = TokenShardReader([path], 2, ShardVocab(0, 6, "the vocab_size argument", None, None))
    reader.read(0, 0)
    with pytest.raises(ValueError, match="entry 3 holds token id 6"):
        reader.read(0, 1)


def test_shard_vocab_reads_the_bos_and_vocabulary_from_pretokenize_json(tmp_path):
    path = pair(tmp_path)
    record = tmp_path / META_FILENAME
    record.write_text(json.dumps({"vocab_size": 10, "bos_token_id": 0}))
    assert shard_vocab(path, None, None, [str(tmp_path)]) == ShardVocab(
        0, 10, str(record), "nanochat", str(record))
    # a bos_token passed is used, and the caller vouches for the entries' starts
    assert shard_vocab(path, 3, None, [str(tmp_path)]) == ShardVocab(
        3, 10, str(record), "nanochat", None)
    with pytest.raises(ValueError, match=r"vocab_size 12 \(the vocab_size argument\) disagrees "
                                         r"with 10"):
        shard_vocab(path, None, 12, [str(tmp_path)])


def test_shard_vocab_refuses_to_guess_a_bos_without_a_record(tmp_path):
    path = pair(tmp_path)
    with pytest.raises(ValueError, match=r"no pretokenize.json records the BOS of the shards of "
                                         r".*Entries 0 to 4 of .* start with the ids 0, 0, 0, 0, "
                                         r"0\."):
        shard_vocab(path, None, 10, [str(tmp_path)])
    with pytest.raises(ValueError, match=r"bos_token is 10, outside the vocabulary \[0, 10\) "
                                         r"\(the vocab_size argument\)"):
        shard_vocab(path, 10, 10, [str(tmp_path)])
