"""
Tests for nanochat/pretokenize.py: the .bin/.idx bytes field by field, the round trip through
TokenShard (uint16 and uint32), crash-safe writing, windowing in both conventions (hypothesis
property tests plus the docstring's worked examples; GPT-Simple's labelling rule on gpt-simple
entries), a clear error naming the file for every kind of damaged pair, and the CLI end to end:
parquet and jsonl inputs, 2 worker processes, --convention, rerun-skips, resume after a killed run
or Ctrl-C (one line, exit status 130), and --rank/--world-size. Hermetic: tiny shards and a
300-token tokenizer trained in-process, all under tmp_path. Run:
    python -m pytest tests/test_pretokenize.py -q
"""

import gzip
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TESTS, assert_interrupted, ctrl_c, sample_texts, worker_env, write_shards
from nanochat import pretokenize
from nanochat.pretokenize import INTERRUPTED, main, window_document, window_gpt_simple
from nanochat.data.pretokenized.token_shards import (MAGIC, VERSION, TokenShard, list_token_shards,
                                                     write_token_shard)
from nanochat.tokenizer import RustBPETokenizer

BOS = 9  # a stand-in BOS id for the format and windowing tests


# documents of 0 to ~120 words, so that some are longer than the windows used below; an empty
# document is kept: it becomes a lone BOS
TEXTS = dict(words=("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "token",
                    "shard", "é", "42"), lengths=(3, 10, 40, 120), empty_middle=True)
TOKENIZER_TEXTS = [t for seed in range(3) for t in sample_texts(seed, 40, **TEXTS)]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return RustBPETokenizer.from_directory(tokenizer_dir)


@pytest.fixture
def parquet_dir(tmp_path):
    """Three train shards and a val shard (the last) of 30 documents, row groups of 8."""
    data_dir = str(tmp_path / "parquet")
    write_shards(data_dir, [sample_texts(seed, 30, **TEXTS) for seed in range(10, 14)],
                 row_group_size=8)
    return data_dir


def _write_tiny(prefix) -> None:
    """3 entries of 3, 1 and 4 uint16 tokens; the last is a window whose first 2 tokens after BOS
    repeat."""
    entries = [np.array([BOS, 1, 2], np.uint16), np.array([BOS], np.uint16),
               np.array([BOS, 3, 4, 5], np.uint16)]
    write_token_shard(str(prefix), entries, [0, 0, 2], np.uint16)


def _files(directory) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under directory but the lock files: the
    output's, which every run rewrites (it names the run holding the output), and each pair's
    (.<name>.lock)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name.startswith(".") and name.endswith(".lock"):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


# -----------------------------------------------------------------------------
# The format, byte by byte


def test_idx_and_bin_bytes_field_by_field(tmp_path):
    _write_tiny(tmp_path / "tiny")
    with open(tmp_path / "tiny.idx", "rb") as f:
        idx = f.read()
    assert idx[0:4] == b"GPTS" == MAGIC
    assert struct.unpack_from("<I", idx, 4) == (1,) == (VERSION,)
    assert struct.unpack_from("<I", idx, 8) == (2,)  # uint16 tokens
    assert struct.unpack_from("<I", idx, 12) == (3,)  # entries
    assert struct.unpack_from("<4q", idx, 16) == (0, 3, 4, 8)  # offsets, then the total as sentinel
    assert struct.unpack_from("<3H", idx, 16 + 8 * 4) == (0, 0, 2)  # overlap prefixes
    assert len(idx) == 16 + 8 * 4 + 2 * 3
    with open(tmp_path / "tiny.bin", "rb") as f:
        assert f.read() == struct.pack("<8H", BOS, 1, 2, BOS, BOS, 3, 4, 5)
    assert sorted(os.listdir(tmp_path)) == ["tiny.bin", "tiny.idx"]  # no temporary files left


def test_round_trip_through_token_shard(tmp_path):
    _write_tiny(tmp_path / "tiny")
    for path in (tmp_path / "tiny", tmp_path / "tiny.idx", str(tmp_path / "tiny.bin")):
        shard = TokenShard(str(path))
        assert shard.prefix == str(tmp_path / "tiny")
        assert (shard.idx_path, shard.bin_path) == (shard.prefix + ".idx", shard.prefix + ".bin")
        assert len(shard) == 3 and shard.dtype == np.uint16
        assert shard.offsets.dtype == np.int64 and shard.offsets.tolist() == [0, 3, 4, 8]
        assert shard.overlaps.dtype == np.uint16 and shard.overlaps.tolist() == [0, 0, 2]
        assert shard.lengths().tolist() == [3, 1, 4]
        assert [shard.entry(i).tolist() for i in range(3)] == [[BOS, 1, 2], [BOS], [BOS, 3, 4, 5]]
        assert shard.entry(-1).tolist() == [BOS, 3, 4, 5]
        # a plain view of the memory map (not a copy): its base is the np.memmap of the .bin
        assert isinstance(shard.tokens.base, np.memmap) and shard.tokens.dtype == np.uint16
        assert not shard.tokens.flags.writeable and not shard.tokens.flags.owndata
        with pytest.raises(ValueError):
            shard.tokens[0] = 1  # read-only
        with pytest.raises(IndexError, match="entry 3 is out of range"):
            shard.entry(3)


def test_uint32_when_ids_exceed_uint16(tmp_path):
    big = [np.array([70_000, 1, 2**32 - 1], np.int64), np.array([65_536], np.int64)]
    write_token_shard(str(tmp_path / "big"), big, [0, 0], np.uint32)
    with open(tmp_path / "big.idx", "rb") as f:
        assert struct.unpack_from("<I", f.read(), 8) == (4,)
    with open(tmp_path / "big.bin", "rb") as f:
        assert f.read() == struct.pack("<4I", 70_000, 1, 2**32 - 1, 65_536)
    shard = TokenShard(str(tmp_path / "big"))
    assert shard.dtype == np.uint32
    assert [shard.entry(i).tolist() for i in range(2)] == [[70_000, 1, 2**32 - 1], [65_536]]
    # the same ids do not fit uint16: refused, and nothing is left on disk
    with pytest.raises(ValueError, match="do not fit uint16; use uint32"):
        write_token_shard(str(tmp_path / "small"), big, [0, 0], np.uint16)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("small")]


def test_empty_shard(tmp_path):
    write_token_shard(str(tmp_path / "empty"), [], [], np.uint16)
    assert os.path.getsize(tmp_path / "empty.bin") == 0
    shard = TokenShard(str(tmp_path / "empty"))
    assert len(shard) == 0 and shard.offsets.tolist() == [0] and len(shard.tokens) == 0


def test_write_rejects_bad_arguments_and_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "bad")
    one = [np.array([BOS, 1], np.uint16)]
    with pytest.raises(ValueError, match="uint16 or uint32, got int32"):
        write_token_shard(prefix, one, [0], np.int32)
    with pytest.raises(ValueError, match="entry 0 has 2 tokens and an overlap prefix of 3"):
        write_token_shard(prefix, one, [3], np.uint16)
    with pytest.raises(ValueError):  # one overlap too many
        write_token_shard(prefix, one, [0, 0], np.uint16)
    with pytest.raises(ValueError, match="1-D"):
        write_token_shard(prefix, [np.zeros((2, 2), np.uint16)], [0], np.uint16)

    def failing():
        yield np.array([BOS, 1], np.uint16)
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        write_token_shard(prefix, failing(), [0, 0], np.uint16)
    assert os.listdir(tmp_path) == []


def test_write_replaces_an_existing_pair(tmp_path):
    _write_tiny(tmp_path / "tiny")
    write_token_shard(str(tmp_path / "tiny"), [np.array([BOS, 7], np.uint16)], [0], np.uint16)
    shard = TokenShard(str(tmp_path / "tiny"))
    assert len(shard) == 1 and shard.entry(0).tolist() == [BOS, 7]


def test_reads_a_gpt_simple_shard(tmp_path):
    # GPT-Simple's convention: no BOS, EOD after a short document and after a document's last
    # window, the overlap prefix counting the entry's leading tokens. Same format, so TokenShard
    # reads it.
    EOD = 50256
    entries = [np.array([1, 2, EOD], np.uint16),  # a short document
               # 2 windows
               np.array([10, 11, 12, 13], np.uint16), np.array([12, 13, 14, EOD], np.uint16)]
    write_token_shard(str(tmp_path / "gpts"), entries, [0, 0, 2], np.uint16)
    shard = TokenShard(str(tmp_path / "gpts"))
    assert [shard.entry(i).tolist() for i in range(3)] == [e.tolist() for e in entries]
    # the loader prepends BOS where an entry lacks it: the overlap then sits right after the BOS,
    # as in ours
    with_bos = [[BOS] + shard.entry(i).tolist() for i in range(3)]
    o = int(shard.overlaps[2])
    assert with_bos[2][1:1 + o] == with_bos[1][-o:] == [12, 13]


def test_list_token_shards_lists_complete_pairs_only(tmp_path):
    for name in ("b", "a"):
        _write_tiny(tmp_path / name)
    _write_tiny(tmp_path / "lone_bin")
    os.remove(tmp_path / "lone_bin.idx")  # a run killed between the two renames
    _write_tiny(tmp_path / "lone_idx")
    os.remove(tmp_path / "lone_idx.bin")
    for name in ("killed.bin.tmp", "killed.idx.tmp", "notes.txt"):
        (tmp_path / name).write_bytes(b"partial")
    os.makedirs(tmp_path / "sub")
    _write_tiny(tmp_path / "sub" / "nested")  # not recursive
    assert list_token_shards(str(tmp_path)) == [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_token_shards(str(tmp_path / "nowhere"))


# -----------------------------------------------------------------------------
# Windowing


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


def gpt_simple_windows(tokens: list[int], max_length: int,
                       overlap: int) -> list[tuple[list[int], int]]:
    """The reference, from the definition with plain lists: window k holds tokens
    [k * step, k * step + L) (step = L - O), and a window is written only if it holds a token that
    no earlier one had."""
    windows, k = [], 0
    while True:
        first = k * (max_length - overlap)
        windows.append((tokens[first:first + max_length], overlap if k else 0))
        if first + max_length >= len(tokens):
            return windows
        k += 1


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


# -----------------------------------------------------------------------------
# Damaged pairs


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


OFFSETS_AT, OVERLAPS_AT = 16, 16 + 8 * 4  # in the tiny pair: 3 entries of 3, 1, 4 tokens
CORRUPTIONS = {
    # name: (damage(prefix), exception, the file the message names, what the message says)
    "missing idx": (lambda p: os.remove(p + ".idx"), FileNotFoundError, ".idx", "does not exist"),
    "missing bin": (lambda p: os.remove(p + ".bin"), FileNotFoundError, ".bin", "does not exist"),
    "bad magic": (lambda p: _patch(p + ".idx", 0, b"GPTX"), ValueError, ".idx",
                  "not the magic b'GPTS'"),
    "unknown version": (lambda p: _patch(p + ".idx", 4, struct.pack("<I", 2)), ValueError, ".idx",
                        "format version 2; this code reads version 1"),
    "unknown dtype code": (lambda p: _patch(p + ".idx", 8, struct.pack("<I", 8)), ValueError,
                           ".idx", "dtype code 8"),
    "header cut": (lambda p: _truncate(p + ".idx", 10), ValueError, ".idx",
                   "shorter than the 16-byte header"),
    "index shorter than header says": (lambda p: _truncate(p + ".idx", OVERLAPS_AT + 4),
                                       ValueError, ".idx",
                                       "shorter than its header says: 3 entries need 54 bytes"),
    "count larger than the index": (lambda p: _patch(p + ".idx", 12, struct.pack("<I", 4)),
                                    ValueError, ".idx",
                                    "shorter than its header says: 4 entries need 64 bytes"),
    "index longer than header says": (lambda p: _append(p + ".idx", b"\0\0"), ValueError, ".idx",
                                      "2 more than its header's 3 entries need"),
    "first offset not 0": (lambda p: _patch(p + ".idx", OFFSETS_AT, struct.pack("<q", 1)),
                           ValueError, ".idx", "first offset is 1, it must be 0"),
    "offsets decrease": (lambda p: _patch(p + ".idx", OFFSETS_AT + 16, struct.pack("<q", 2)),
                         ValueError, ".idx", r"offsets decrease at entry 1 \(3 -> 2\)"),
    "last offset past the bin": (
        lambda p: _patch(p + ".idx", OFFSETS_AT + 24, struct.pack("<q", 9)), ValueError, ".idx",
        r"last offset 9 \(18 bytes of uint16\) is past the end of .*16 bytes"),
    "bin truncated": (lambda p: _truncate(p + ".bin", 14), ValueError, ".idx", "past the end"),
    "bin too long": (lambda p: _append(p + ".bin", b"\0\0"), ValueError, ".bin",
                     "has 18 bytes, but its index .* says 8 tokens x 2 bytes = 16"),
    "bin odd size": (lambda p: _append(p + ".bin", b"\0"), ValueError, ".bin", "has 17 bytes"),
    "overlap longer than entry": (
        lambda p: _patch(p + ".idx", OVERLAPS_AT + 2, struct.pack("<H", 2)), ValueError, ".idx",
        "entry 1 has an overlap prefix of 2 tokens but only 1 tokens"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_damaged_pair_names_file_and_problem(tmp_path, name):
    damage, exc_type, ext, message = CORRUPTIONS[name]
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    _write_tiny(good)
    for ext_ in (".idx", ".bin"):
        shutil.copyfile(good + ext_, bad + ext_)
    damage(bad)
    with pytest.raises(exc_type, match=message) as info:
        TokenShard(bad)
    assert bad + ext in str(info.value)
    assert len(TokenShard(good)) == 3  # the original is untouched


# -----------------------------------------------------------------------------
# The command line


def _expected_entries(tokenizer, texts, max_length, overlap) -> list[tuple[list[int], int]]:
    docs = tokenizer.encode_to_arrays(texts, prepend=tokenizer.get_bos_token_id(), num_threads=1)
    if max_length is None:
        return [(d.tolist(), 0) for d in docs]
    return [(w.tolist(), o) for d in docs for w, o in window_document(d, max_length, overlap)]


def _rebuild_documents(shard: TokenShard) -> list[list[int]]:
    """Documents from entries, when overlap > 0: a window with an overlap prefix continues a
    document."""
    docs = []
    for i in range(len(shard)):
        entry, o = shard.entry(i).tolist(), int(shard.overlaps[i])
        if o:
            docs[-1] += entry[1 + o:]
        else:
            docs.append(entry)
    return docs


def _check_outputs(out_dir, inputs: dict, tokenizer, max_length=None, overlap=0) -> int:
    """Each {split: [(name, texts)]} input is exactly one pair holding its documents' entries in
    order. Returns how many documents were cut into windows."""
    windowed = 0
    for split, items in inputs.items():
        assert list_token_shards(os.path.join(out_dir, split)) == [
            os.path.join(out_dir, split, name) for name, _ in items]
        for name, texts in items:
            shard = TokenShard(os.path.join(out_dir, split, name))
            assert shard.dtype == np.uint16
            got = [(shard.entry(i).tolist(), int(shard.overlaps[i])) for i in range(len(shard))]
            assert got == _expected_entries(tokenizer, texts, max_length, overlap)
            if overlap:
                docs = tokenizer.encode_to_arrays(texts, prepend=tokenizer.get_bos_token_id(),
                                                  num_threads=1)
                assert _rebuild_documents(shard) == [d.tolist() for d in docs]
                windowed += sum(len(d) > max_length for d in docs)
            if max_length is not None:
                assert shard.lengths().max() <= max_length
    return windowed


def _parquet_inputs(parquet_dir) -> dict:
    names = sorted(os.listdir(parquet_dir))
    texts = {n[:-len(".parquet")]: sample_texts(10 + i, 30, **TEXTS)
             for i, n in enumerate(names)}
    items = sorted(texts.items())
    return {"train": items[:-1], "val": items[-1:]}


@pytest.mark.slow
def test_cli_parquet_windowed_two_workers_then_rerun_skips(
        parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "24", "--overlap-size", "6", "--num-workers", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "max_length=24 overlap_size=6 num_workers=2" in printed  # the echo of the arguments
    assert "wrote 4/4 shards" in printed and "0 skipped" in printed
    windowed = _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer, 24, 6)
    assert windowed >= 10  # guard: the windowing path did run
    with open(os.path.join(out, "pretokenize.json")) as f:
        meta = json.load(f)
    assert (meta["max_length"], meta["overlap_size"], meta["dtype"]) == (24, 6, "uint16")
    assert meta["bos_token_id"] == tokenizer.get_bos_token_id()

    before = _files(out)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 already done" in printed and "wrote 0/0 shards" in printed and "4 skipped" in printed
    assert _files(out) == before  # byte-identical, same mtimes

    # the same output with other windowing would mix two kinds of shards: refused
    with pytest.raises(ValueError,
                       match="pretokenize.json records other settings .*max_length 24 -> 32"):
        main(argv[:-6] + ["--max-length", "32", "--overlap-size", "6"])


def test_cli_parquet_unwindowed(parquet_dir, tokenizer_dir, tokenizer, tmp_path):
    out = str(tmp_path / "tokens")
    assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 0
    _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer)
    shard = TokenShard(os.path.join(out, "train", "shard_00000"))
    assert not shard.overlaps.any() and shard.lengths().max() > 24  # nothing was cut


@pytest.mark.slow
def test_cli_gpt_simple_convention(parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    """--convention gpt-simple, in 2 worker processes: each document's tokens + EOD (the tokenizer's
    BOS id), no BOS, windowed as the reference says, every entry within --max-length; recorded in
    pretokenize.json, and a rerun with the other convention is refused."""
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "16", "--overlap-size", "4", "--num-workers", "2",
            "--convention", "gpt-simple"]
    assert main(argv) == 0
    assert "world_size=1 convention=gpt-simple" in capsys.readouterr().out
    eod = tokenizer.get_bos_token_id()
    windowed = 0
    for split, items in _parquet_inputs(parquet_dir).items():
        for name, texts in items:
            shard = TokenShard(os.path.join(out, split, name))
            expected = [window for ids in tokenizer.encode(texts, num_threads=1)
                        for window in gpt_simple_windows(ids + [eod], 16, 4)]
            assert [(shard.entry(i).tolist(), int(shard.overlaps[i]))
                    for i in range(len(shard))] == expected
            assert shard.lengths().max() == 16 and shard.dtype == np.uint16
            windowed += sum(o > 0 for _, o in expected)
    assert windowed > 10  # guard: long documents were cut
    with open(os.path.join(out, "pretokenize.json")) as f:
        meta = json.load(f)
    assert (meta["convention"], meta["eod_token_id"], meta["bos_token_id"]) == (
        "gpt-simple", eod, eod)
    with pytest.raises(ValueError,
                       match=f"records other settings .*convention 'gpt-simple' -> 'nanochat', "
                             f"eod_token_id {eod} -> None"):
        main(argv[:-2])


def test_cli_settings_written_before_conventions(parquet_dir, tokenizer_dir, tmp_path, capsys):
    """A pretokenize.json without the convention fields is the nanochat convention's: a rerun with
    the same arguments goes on; one with --convention gpt-simple is refused."""
    out = tmp_path / "tokens"
    argv = ["--input", parquet_dir, "--output", str(out), "--tokenizer-dir", tokenizer_dir,
            "--num-workers", "1"]
    assert main(argv) == 0
    meta = json.loads((out / "pretokenize.json").read_text())
    assert (meta["convention"], meta["eod_token_id"]) == ("nanochat", None)
    del meta["convention"], meta["eod_token_id"]
    (out / "pretokenize.json").write_text(json.dumps(meta))
    os.remove(out / "train" / "shard_00001.idx")
    capsys.readouterr()
    assert main(argv) == 0
    assert "3 already done" in capsys.readouterr().out
    with pytest.raises(ValueError, match="convention 'nanochat' -> 'gpt-simple'"):
        main(argv + ["--convention", "gpt-simple"])


def test_cli_resumes_a_killed_run(parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "24", "--overlap-size", "6", "--num-workers", "1"]
    assert main(argv) == 0
    reference = {k: data for k, (data, _) in _files(out).items()}
    train = os.path.join(out, "train")
    # killed between the two renames: a .bin without its .idx
    os.remove(os.path.join(train, "shard_00001.idx"))
    # killed while writing: partial temporary files, no final ones
    for ext in (".bin", ".idx"):
        os.remove(os.path.join(train, "shard_00002" + ext))
        with open(os.path.join(train, "shard_00002" + ext + ".tmp"), "wb") as f:
            f.write(b"\x01partial")
    assert list_token_shards(train) == [os.path.join(train, "shard_00000")]
    untouched = _files(out)["train/shard_00000.bin"]
    capsys.readouterr()

    assert main(argv) == 0
    assert "2 already done" in capsys.readouterr().out
    # no .tmp left, same bytes
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert _files(out)["train/shard_00000.bin"] == untouched  # the complete pair was not rewritten
    _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer, 24, 6)


def test_cli_ranks_split_inputs_disjointly(parquet_dir, tokenizer_dir, tmp_path, monkeypatch):
    written = []
    for rank in range(3):
        out = str(tmp_path / f"rank{rank}")
        assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                     "--num-workers", "1", "--rank", str(rank), "--world-size", "3"]) == 0
        written.append({os.path.relpath(p, out) for split in ("train", "val")
                        if os.path.isdir(os.path.join(out, split))
                        for p in list_token_shards(os.path.join(out, split))})
    assert written == [{"train/shard_00000", "val/shard_00003"}, {"train/shard_00001"},
                       {"train/shard_00002"}]
    # torchrun's variables do the same
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    out = str(tmp_path / "torchrun")
    assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 0
    assert list_token_shards(os.path.join(out, "train")) == [
        os.path.join(out, "train", "shard_00001")]
    assert list_token_shards(os.path.join(out, "val")) == [os.path.join(out, "val", "shard_00003")]


def test_cli_jsonl_and_jsonl_gz(tokenizer_dir, tokenizer, tmp_path):
    raw = tmp_path / "raw"
    os.makedirs(raw)
    docs = {name: sample_texts(seed, n, **TEXTS) for name, seed, n in (("a", 20, 12), ("b", 21, 12),
                                                                         ("c", 22, 5))}

    def lines(texts):
        # blank lines are skipped; other fields are ignored
        return "".join(json.dumps({"id": i, "content": t}) + "\n\n" for i, t in enumerate(texts))

    (raw / "a.jsonl").write_text(lines(docs["a"]), encoding="utf-8")
    with gzip.open(raw / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines(docs["b"]))
    (raw / "ignored.txt").write_text("not an input")
    val = tmp_path / "c.jsonl"
    val.write_text(lines(docs["c"]), encoding="utf-8")
    out = str(tmp_path / "tokens")
    assert main(["--input", str(raw), "--val-input", str(val), "--output", out,
                 "--tokenizer-dir", tokenizer_dir, "--text-field", "content",
                 "--max-length", "16", "--overlap-size", "8", "--num-workers", "1"]) == 0
    windowed = _check_outputs(
        out, {"train": [("a", docs["a"]), ("b", docs["b"])], "val": [("c", docs["c"])]},
        tokenizer, 16, 8)
    assert windowed > 0


def test_cli_bad_input_fails_alone(tokenizer_dir, tmp_path, capsys):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = str(tmp_path / "tokens")
    assert main(["--input", str(good), str(bad), "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 1
    printed = capsys.readouterr().out
    assert "bad.jsonl line 2: invalid JSON" in printed and "failed (1): bad.jsonl" in printed
    assert sorted(os.listdir(os.path.join(out, "train"))) == [
        ".bad.lock", ".good.lock", "good.bin", "good.idx"]


# -----------------------------------------------------------------------------
# kill -9 and concurrent runs: real processes (tests/slow_pretokenize.py sleeps 0.1 s per encode
# call, one call per input here, so a run of 24 inputs on 2 workers lasts over a second)

SLOW_SCRIPT = os.path.join(TESTS, "slow_pretokenize.py")


@pytest.fixture(scope="module")
def many_inputs(tmp_path_factory, tokenizer_dir):
    """24 small jsonl inputs, and their output from an uninterrupted run (the reference)."""
    root = tmp_path_factory.mktemp("many")
    os.makedirs(root / "raw")
    for i in range(24):
        (root / "raw" / f"part_{i:02d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in sample_texts(100 + i, 12, **TEXTS)),
            encoding="utf-8")
    argv = ["--input", str(root / "raw"), "--tokenizer-dir", tokenizer_dir, "--max-length", "16",
            "--overlap-size", "4", "--num-workers", "2"]
    assert main(argv + ["--output", str(root / "reference")]) == 0
    return argv, {k: data for k, (data, _) in _files(root / "reference").items()}


def _start_slow_run(argv, log_path):
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, SLOW_SCRIPT] + argv, env=worker_env(), stdout=log,
                                stderr=subprocess.STDOUT)


def _children(pid: int) -> dict:
    """{pid: (start time, command line)} of the live child processes of pid (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(name)] = (fields[19], cmdline)
    return out


def _alive(pid: int, start_time: str) -> bool:
    """Whether that process (not a later one with its pid) still runs; a zombie has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == start_time


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cli_kill_9_leaves_no_process_and_a_rerun_matches(many_inputs, tmp_path, capsys):
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    run = _start_slow_run(argv + ["--output", str(out)], tmp_path / "log.txt")
    try:
        train = out / "train"
        _wait_for(lambda: train.is_dir() and any(n.endswith(".idx") for n in os.listdir(train)),
                  60, "first pair")
        children = _children(run.pid)
        kinds = sorted("resource_tracker" if "resource_tracker" in c
                       else "spawn" if "spawn_main" in c else c
                       for _, c in children.values())
        # 2 workers and multiprocessing's tracker
        assert kinds == ["resource_tracker", "spawn", "spawn"]
        run.kill()  # SIGKILL: no handler, no cleanup
    finally:
        run.kill()
        run.wait()
    done = [n for n in os.listdir(train) if n.endswith(".idx")]
    assert 1 <= len(done) < 24  # killed in the middle

    capsys.readouterr()
    assert main(argv + ["--output", str(out)]) == 0  # at once
    assert f"{len(done)} already done" in capsys.readouterr().out
    # byte for byte, no .tmp left
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    # the killed run's workers and resource tracker are gone, not left running
    _wait_for(lambda: not any(_alive(pid, start) for pid, (start, _) in children.items()), 5,
              "exit of all")


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", ["2", "1"])
def test_cli_ctrl_c_says_so_in_one_line_and_a_rerun_matches(many_inputs, tmp_path, capsys,
                                                           num_workers):
    """Ctrl-C to the whole process group, as a terminal sends it, with its workers inside a job or
    between two: one line, exit status 130, no partial pair; the rerun writes the rest."""
    argv, reference = many_inputs
    argv = argv[:-1] + [num_workers]  # (--num-workers)
    out = tmp_path / "tokens"
    train = out / "train"
    code, _, err = ctrl_c(
        [sys.executable, SLOW_SCRIPT] + argv + ["--output", str(out)],
        lambda: train.is_dir() and any(n.endswith(".idx") for n in os.listdir(train)),
        env=worker_env())
    assert_interrupted(code, err, "interrupted: " + INTERRUPTED)
    done = [n for n in os.listdir(train) if n.endswith(".idx")]
    assert 1 <= len(done) < 24  # stopped in the middle
    assert not [n for n in os.listdir(train) if n.endswith(".tmp")]  # nothing half written
    capsys.readouterr()
    assert main(argv + ["--output", str(out)]) == 0
    assert f"{len(done)} already done" in capsys.readouterr().out
    assert {k: data for k, (data, _) in _files(out).items()} == reference  # byte for byte


@pytest.mark.slow
def test_cli_two_runs_on_one_output(many_inputs, tmp_path, capsys):
    """A second run on an output a run is writing is refused, naming the output and the other run's
    pid; the first run is undisturbed, and once it is done the output is free again."""
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    first = _start_slow_run(argv + ["--output", str(out)], tmp_path / "log.txt")
    try:
        lock = out / ".pretokenize.lock"
        _wait_for(lambda: lock.is_file() and lock.read_text().startswith(f"pid {first.pid} on"),
                  60, "lock")
        capsys.readouterr()
        with pytest.raises(TimeoutError) as info:
            main(argv + ["--output", str(out), "--lock-timeout", "0.2"])
        message = str(info.value)
        assert message.startswith(
            f"another pretokenize run (pid {first.pid} on {socket.gethostname()}, since ")
        assert (f") is writing to {out}: {lock} stayed locked for 0.2s; "
                "let that run finish (or stop it)") in message
        # how to run several at once
        assert message.endswith("To run several at once, give each its own share of the inputs: "
                                "--rank R --world-size N, with R from 0 to N-1, on one machine "
                                "or several")
        # the wait was said, once, as it started
        printed = capsys.readouterr().out.splitlines()
        waiting = [line for line in printed if line.startswith("waiting ")]
        assert len(waiting) == 1, printed
        assert waiting[0].startswith("waiting up to 0.2s (--lock-timeout) for another pretokenize "
                                     f"run (pid {first.pid} on {socket.gethostname()}, since ")
        assert waiting[0].endswith(f") that is writing to {out}")
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert lock.read_text() == ""  # released: it names nobody
    capsys.readouterr()
    # free again: all 24 skipped
    assert main(argv + ["--output", str(out), "--lock-timeout", "0"]) == 0
    printed = capsys.readouterr().out
    assert "24 already done" in printed and "waiting" not in printed  # (a free lock: no wait)


@pytest.mark.slow
def test_cli_plain_run_and_a_rank_on_one_output_at_once(many_inputs, tmp_path):
    """A plain run and rank 0 of 2 on one output at once hold different output locks and share the
    even inputs: each pair is written once, by whichever run takes its pair lock first, and the
    other skips it."""
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    runs = [_start_slow_run(argv + ["--output", str(out)] + extra, tmp_path / f"log{i}.txt")
            for i, extra in enumerate([[], ["--world-size", "2", "--rank", "0"]])]
    try:
        assert [run.wait(timeout=120) for run in runs] == [0, 0]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(2)]
    written = [re.search(r"^wrote (\d+)/\d+ shards", log, re.M) for log in logs]
    assert all(written), logs
    assert sum(int(m[1]) for m in written) == 24, logs  # no pair written twice, none missed
    # byte for byte, no .tmp left
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert list_token_shards(str(out / "train")) == [str(out / "train" / f"part_{i:02d}")
                                                     for i in range(24)]


def _die(job):
    os._exit(3)  # a worker killed mid-shard (the OOM killer, kill -9)


@pytest.mark.slow
def test_cli_dead_worker_fails_the_run(parquet_dir, tokenizer_dir, tmp_path, monkeypatch):
    # the pool pickles the task function by name, so spawned workers run this module's _die
    monkeypatch.setattr(pretokenize, "_run_job", _die)
    out = str(tmp_path / "tokens")
    with pytest.raises(BrokenProcessPool):
        main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
              "--num-workers", "2"])
    assert not os.path.exists(os.path.join(out, "train"))  # nothing half-written


def test_cli_rejects_bad_arguments(parquet_dir, tokenizer_dir, tmp_path, capsys):
    base = ["--input", parquet_dir, "--output", str(tmp_path / "out"),
            "--tokenizer-dir", tokenizer_dir]
    with pytest.raises(SystemExit) as info:
        main(base + ["--max-length", "8", "--overlap-size", "5"])
    assert info.value.code == 2
    assert "--max-length 8 / --overlap-size 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--overlap-size", "5"])
    assert "needs --max-length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--rank", "2", "--world-size", "2"])
    with pytest.raises(SystemExit):
        main(base + ["--lock-timeout", "-1"])
    assert "--lock-timeout must be >= 0 seconds, got -1.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pass their directory"):
        main(["--input", os.path.join(parquet_dir, "shard_00000.parquet"),
              "--output", str(tmp_path / "out"), "--tokenizer-dir", tokenizer_dir])
    with pytest.raises(ValueError, match="drop --val-input"):
        main(base + ["--val-input", parquet_dir])
    assert not os.path.exists(tmp_path / "out" / "train")  # nothing was written
