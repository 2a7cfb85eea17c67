"""
The .bin/.idx format of nanochat/data/pretokenized/token_shards.py: the bytes field by field, the
round trip through TokenShard (uint16 and uint32), crash-safe writing, GPT-Simple's shards, the
listing of complete pairs, and a clear error naming the file for every kind of damaged pair.
Hermetic: tiny pairs under tmp_path. Run:
    python -m pytest tests/data/pretokenized/test_token_shards.py -q
"""

import os
import shutil
import struct

import numpy as np
import pytest

from nanochat.data.pretokenized.token_shards import MAGIC, VERSION, TokenShard, write_token_shard
from nanochat.data.base.layout import list_token_shards

BOS = 9  # a stand-in BOS id


def _write_tiny(prefix) -> None:
    """3 entries of 3, 1 and 4 uint16 tokens; the last is a window whose first 2 tokens after BOS
    repeat."""
    entries = [np.array([BOS, 1, 2], np.uint16), np.array([BOS], np.uint16),
               np.array([BOS, 3, 4, 5], np.uint16)]
    write_token_shard(str(prefix), entries, [0, 0, 2], np.uint16)


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
