"""
One input to its pair (nanochat/data/processing/tokenize_pair.py): pretokenize_file's entries and
counts in both conventions, whole and windowed, from parquet and jsonl; write_pair's result for a
pair written, one written meanwhile by another run (left alone), and a bad input (failed alone,
nothing left). A byte-level tokenizer (BOS 256) under tmp_path. Run:
    python -m pytest tests/data/processing/test_tokenize_pair.py -q
"""

import json
import os

import numpy as np
import pytest

from conftest import ByteArrayTokenizer, write_shards
from nanochat.data.processing.inputs import PairToWrite
from nanochat.data.pretokenized.token_shards import TokenShard
from nanochat.data.processing.tokenize_pair import (PairResult, pair_lock, pretokenize_file,
                                                      write_pair)

BOS = ByteArrayTokenizer.bos
TEXTS = ["abc", "", "a longer document"]  # 3, 0 and 17 bytes


def entries(prefix) -> list[tuple[list[int], int]]:
    shard = TokenShard(str(prefix))
    return [(shard.entry(i).tolist(), int(shard.overlaps[i])) for i in range(len(shard))]


def test_a_parquet_shard_whole_and_windowed(tmp_path):
    shard, = write_shards(str(tmp_path / "in"), [TEXTS], row_group_size=2)
    tokenizer = ByteArrayTokenizer()
    stats = pretokenize_file(tokenizer, shard, str(tmp_path / "out" / "whole"))
    assert stats == {"documents": 3, "entries": 3, "tokens": 4 + 1 + 18, "windowed": 0}
    assert entries(tmp_path / "out" / "whole") == [([BOS, *b"abc"], 0), ([BOS], 0),
                                                     ([BOS, *b"a longer document"], 0)]
    assert TokenShard(str(tmp_path / "out" / "whole")).dtype == np.uint16  # 257 ids fit
    # windows of 8 with 2 tokens of overlap: BOS + 7 new, then BOS + 2 old + 5 new, ...
    stats = pretokenize_file(tokenizer, shard, str(tmp_path / "out" / "windows"), max_length=8,
                             overlap=2)
    doc = [BOS, *b"a longer document"]
    assert entries(tmp_path / "out" / "windows")[2:] == [
        (doc[:8], 0), ([BOS] + doc[6:13], 2), ([BOS] + doc[11:], 2)]
    assert stats == {"documents": 3, "entries": 5, "tokens": 4 + 1 + 8 + 8 + 8, "windowed": 1}


def test_a_jsonl_file_in_gpt_simples_convention(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    stats = pretokenize_file(ByteArrayTokenizer(), str(path), str(tmp_path / "out"),
                             text_field="body", convention="gpt-simple")
    # the document + EOD (the BOS id), no BOS
    assert entries(tmp_path / "out") == [([*b"abc", BOS], 0), ([BOS], 0),
                                         ([*b"a longer document", BOS], 0)]
    assert stats["tokens"] == 4 + 1 + 18
    with pytest.raises(ValueError, match="convention must be one of"):
        pretokenize_file(ByteArrayTokenizer(), str(path), str(tmp_path / "x"), convention="gpt")


def test_write_pair(tmp_path):
    shard, = write_shards(str(tmp_path / "in"), [TEXTS], row_group_size=2)
    prefix = str(tmp_path / "out" / "train" / "a")
    pair = PairToWrite(shard, prefix)
    result = write_pair(ByteArrayTokenizer(), {}, pair)
    assert result == PairResult(shard, {"documents": 3, "entries": 3, "tokens": 23,
                                        "windowed": 0}, None)
    # written meanwhile (here: before): left as it is, said with neither counts nor error
    mtime = os.stat(prefix + ".idx").st_mtime_ns
    assert write_pair(ByteArrayTokenizer(), {}, pair) == PairResult(shard, None, None)
    assert os.stat(prefix + ".idx").st_mtime_ns == mtime
    # the pair's lock is a hidden file beside it, which no listing of pairs matches
    assert os.path.exists(os.path.join(tmp_path, "out", "train", ".a.lock"))
    assert pair_lock(prefix).lock_file == os.path.join(tmp_path, "out", "train", ".a.lock")


def test_a_bad_input_fails_alone(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    prefix = str(tmp_path / "out" / "bad")
    source, stats, error = write_pair(ByteArrayTokenizer(), {}, PairToWrite(str(bad), prefix))
    assert (source, stats) == (str(bad), None)
    assert error.startswith("ValueError: ") and "bad.jsonl" in error
    assert [name for name in os.listdir(tmp_path / "out") if not name.endswith(".lock")] == []
