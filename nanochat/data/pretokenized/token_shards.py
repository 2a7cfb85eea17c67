"""
The `.bin`/`.idx` token-shard format (GPT-Simple's, version 1): write a pair, check it, map it.
`python -m nanochat.pretokenize` writes shards with `write_token_shard`; the pretokenized loaders
read them with `TokenShard`, which checks the pair on open and raises, naming the file, for any
damage. A pair is renamed into place `.bin` first and `.idx` last, so an `.idx` always means a
complete pair.

Cost: opening reads and checks the index (10 bytes per entry); the tokens stay on disk until read.
Design and byte layout: docs/pretokenized.md

May import: nanochat.data.base.checks, numpy, nanochat.data.base.files.
"""

import json
import os
import struct

import numpy as np

from nanochat.data.base.checks import is_int
from nanochat.data.base.files import fsync_dir, remove_if_exists

MAGIC = b"GPTS"
VERSION = 1
DTYPE_CODES = {2: np.uint16, 4: np.uint32}  # the code is the item size in bytes
HEADER = struct.Struct("<4sIII")  # magic, version, dtype code, entry count: 16 bytes
MAX_OVERLAP = np.iinfo(np.uint16).max  # the overlap prefix is stored as uint16
TMP_SUFFIX = ".tmp"  # prefix.bin.tmp / prefix.idx.tmp: never end in .idx, so never listed
META_FILENAME = "pretokenize.json"
# how documents become entries (pretokenize --convention; recorded in pretokenize.json):
# "nanochat", [BOS] + the document; "gpt-simple", the document + EOD, no BOS. The format itself is
# the same for both
CONVENTIONS = ("nanochat", "gpt-simple")

# -----------------------------------------------------------------------------
# Reading a shard


def _le(dtype) -> np.dtype:
    # the format is little-endian; on the usual (little-endian) hosts this is the native dtype
    return np.dtype(dtype).newbyteorder("<")


def _split_prefix(path: str) -> str:
    """The common prefix of a pair, from the .idx path, the .bin path or the prefix itself."""
    root, ext = os.path.splitext(path)
    return root if ext in (".idx", ".bin") else path


class TokenShard:
    """A memory-mapped .bin/.idx pair, validated on open. The index is read into memory (10 bytes
    per entry); the tokens stay on disk until an entry is touched."""

    def __init__(self, path: str):
        self.prefix = _split_prefix(os.fspath(path))
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"token shard file {p} does not exist; a .bin/.idx pair is "
                                        "written by python -m nanochat.pretokenize")
        with open(self.idx_path, "rb") as f:
            data = f.read()
        self.dtype, self.offsets, self.overlaps = _parse_index(data, self.idx_path)
        self._check_bin()
        num_tokens = int(self.offsets[-1])
        if num_tokens:
            # a plain ndarray view of the map: slicing a np.memmap subclass costs ~2 us more per
            # entry
            self.tokens = np.memmap(self.bin_path, dtype=_le(self.dtype), mode="r",
                                    shape=(num_tokens,)).view(np.ndarray)
        else:
            # numpy cannot map an empty file; an empty read-only array behaves the same
            self.tokens = np.empty(0, dtype=self.dtype)
            self.tokens.flags.writeable = False

    def _check_bin(self) -> None:
        bin_bytes = os.path.getsize(self.bin_path)
        need = int(self.offsets[-1]) * self.dtype.itemsize
        if need > bin_bytes:
            raise ValueError(f"{self.idx_path}: the last offset {int(self.offsets[-1])} ({need} "
                             f"bytes of {self.dtype.name}) is past the end of {self.bin_path} "
                             f"({bin_bytes} bytes); the .bin is truncated, rewrite the pair")
        if need != bin_bytes:  # longer: another write's tokens, which the offsets do not describe
            raise ValueError(f"{self.bin_path} has {bin_bytes} bytes, but its index "
                             f"{self.idx_path} says {int(self.offsets[-1])} tokens x "
                             f"{self.dtype.itemsize} bytes = {need}; the pair does not belong "
                             "together, rewrite it")
        lengths = np.diff(self.offsets)
        # vectorised: an index of a million entries is checked in milliseconds
        bad = np.flatnonzero(self.overlaps > lengths)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{self.idx_path}: entry {i} has an overlap prefix of "
                             f"{int(self.overlaps[i])} tokens but only {int(lengths[i])} tokens "
                             f"({bad.size} such entries)")

    def __len__(self) -> int:
        return len(self.overlaps)

    def entry(self, i: int) -> np.ndarray:
        """The tokens of entry i (negative counts from the end), a read-only view into the map."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"entry {i} is out of range for {self.idx_path} ({n} entries)")
        i = i % n  # negative i counts from the end, as for a list
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        """int64 (N,): tokens per entry."""
        return np.diff(self.offsets)

    def __repr__(self) -> str:
        return (f"TokenShard({self.prefix!r}, entries={len(self)}, "
                f"tokens={int(self.offsets[-1])}, {self.dtype.name})")


def _parse_header(data: bytes, size: int, idx_path: str) -> tuple[int, int]:
    """(dtype code, entry count N) from an .idx file's first bytes, checked against its size in
    bytes."""
    if size < HEADER.size:
        raise ValueError(f"{idx_path} is {size} bytes, shorter than the {HEADER.size}-byte header; "
                         "the index is truncated, rewrite the pair")
    magic, version, code, n = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"{idx_path} starts with {magic!r}, not the magic {MAGIC!r}; "
                         "it is not a .bin/.idx token index")
    if version != VERSION:
        raise ValueError(f"{idx_path} has format version {version}; this code reads version "
                         f"{VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path} has dtype code {code}; known codes are "
                         f"{ {c: np.dtype(t).name for c, t in DTYPE_CODES.items()} }")
    need = HEADER.size + 8 * (n + 1) + 2 * n  # the header, N+1 int64 offsets, N uint16 overlaps
    if size < need:
        raise ValueError(f"{idx_path} is {size} bytes, shorter than its header says: {n} entries "
                         f"need {need} bytes; the index is truncated, rewrite the pair")
    if size > need:
        raise ValueError(f"{idx_path} is {size} bytes, {size - need} more than its header's "
                         f"{n} entries need ({need}); the index is damaged, rewrite the pair")
    return code, n


def entry_count(path: str) -> int:
    """The number of entries of a pair, from its .idx header alone (16 bytes read; the rest is
    checked when the pair is opened): counting the entries of thousands of shards reads no index
    whole."""
    idx_path = _split_prefix(os.fspath(path)) + ".idx"
    with open(idx_path, "rb") as f:
        header = f.read(HEADER.size)
        size = os.fstat(f.fileno()).st_size  # the header's N is checked against the file's size
    return _parse_header(header, size, idx_path)[1]


def _parse_index(data: bytes, idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(dtype, offsets int64 (N+1,), overlaps uint16 (N,)) of an .idx file's bytes, checked."""
    code, n = _parse_header(data, len(data), idx_path)
    offsets_at = HEADER.size
    overlaps_at = offsets_at + 8 * (n + 1)
    # little-endian on disk; astype(copy=False) is free on little-endian hosts
    offsets = np.frombuffer(data, dtype="<i8", count=n + 1,
                            offset=offsets_at).astype(np.int64, copy=False)
    overlaps = np.frombuffer(data, dtype="<u2", count=n,
                             offset=overlaps_at).astype(np.uint16, copy=False)
    if offsets[0] != 0:
        raise ValueError(f"{idx_path}: the first offset is {int(offsets[0])}, it must be 0")
    bad = np.flatnonzero(np.diff(offsets) < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{idx_path}: offsets decrease at entry {i} ({int(offsets[i])} -> "
                         f"{int(offsets[i + 1])}); the index is damaged, rewrite the pair")
    return np.dtype(DTYPE_CODES[code]), offsets, overlaps




def recorded_settings(directory: str) -> dict | None:
    """directory/pretokenize.json, the settings pretokenize wrote, with the fields the loaders use
    checked; None when there is no such file. In a file without them, vocab_size, bos_token_id and
    eod_token_id are None, and convention is "nanochat"."""
    path = os.path.join(directory, META_FILENAME)
    if not os.path.isfile(path):
        return None
    fix = ("restore the file, or remove it and pass the tokenizer's vocab_size and bos_token to "
           "the loader")
    try:
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"{path} (pretokenize's settings) is not valid JSON: {e}; {fix}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} holds a JSON {type(settings).__name__}, not pretokenize's "
                         f"settings; {fix}")
    settings = {"vocab_size": None, "bos_token_id": None, "eod_token_id": None,
                "convention": "nanochat", **settings}
    for key, least, what in (("vocab_size", 1, "a positive"), ("bos_token_id", 0, "a non-negative"),
                             ("eod_token_id", 0, "a non-negative")):
        value = settings[key]
        # is_int, not check_int: the message ends with the fix, after the value
        if value is not None and (not is_int(value) or value < least):
            raise ValueError(f"{path}: {key} must be {what} integer, got {value!r}; {fix}")
    if settings["convention"] not in CONVENTIONS:
        raise ValueError(f"{path}: convention must be one of {list(CONVENTIONS)}, "
                         f"got {settings['convention']!r}; {fix}")
    return settings


# -----------------------------------------------------------------------------
# Writing a shard


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():  # np.dtype equality: "uint16", np.uint16 alike
        if dtype == np.dtype(known):
            return code
    raise ValueError(f"token dtype must be uint16 or uint32, got {dtype.name}")


def _as_tokens(entry, dtype: np.dtype, i: int, prefix: str) -> np.ndarray:
    """entry as a 1-D little-endian array of dtype, or a ValueError if an id does not fit."""
    arr = np.asarray(entry)
    if arr.ndim != 1:
        raise ValueError(f"{prefix}: entry {i} has shape {arr.shape}, expected a 1-D array of "
                         "token ids")
    if arr.dtype == dtype:  # the common case: no range check, no copy on little-endian hosts
        return arr.astype(_le(dtype), copy=False)
    # arr.size: an empty list comes as float64, and is a fine empty entry
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{prefix}: entry {i} has dtype {arr.dtype}, expected integer token ids")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):  # astype would wrap them
        raise ValueError(f"{prefix}: entry {i} has ids in [{arr.min()}, {arr.max()}], which do not "
                         f"fit {dtype.name}; use uint32 for vocabularies over 65,536 ids")
    return arr.astype(_le(dtype))


def write_token_shard(prefix: str, entries, overlaps, dtype) -> None:
    """Write prefix.bin and prefix.idx from entries (1-D int arrays) and their overlap prefixes
    (ints, one per entry). Entries are streamed to disk, so a shard larger than memory is fine.
    Both files go to temporary names, are fsynced, then renamed .bin first and .idx last: a complete
    .idx always means a complete pair, and a failure leaves nothing under the final names."""
    # strict: one overlap too many or too few is an error, not a silently shorter shard
    write_token_pairs(prefix, zip(entries, overlaps, strict=True), dtype)


def write_token_pairs(prefix: str, pairs, dtype) -> None:
    """write_token_shard over (entry, overlap) pairs, which lets a caller pass both from one
    generator."""
    prefix = os.fspath(prefix)
    code = _dtype_code(dtype)
    dtype = np.dtype(DTYPE_CODES[code])
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    bin_tmp, idx_tmp = bin_path + TMP_SUFFIX, idx_path + TMP_SUFFIX
    lengths, overlap_list = [], []  # the index is built in memory: 10 bytes per entry
    try:
        with open(bin_tmp, "wb") as f:
            for i, (entry, overlap) in enumerate(pairs):
                tokens = _as_tokens(entry, dtype, i, prefix)
                overlap = int(overlap)
                if not 0 <= overlap <= min(len(tokens), MAX_OVERLAP):
                    raise ValueError(f"{prefix}: entry {i} has {len(tokens)} tokens and an overlap "
                                     f"prefix of {overlap}; it must be between 0 and the entry "
                                     f"length (and <= {MAX_OVERLAP})")
                f.write(np.ascontiguousarray(tokens).data)
                lengths.append(len(tokens))
                overlap_list.append(overlap)
            f.flush()
            os.fsync(f.fileno())  # the tokens are on disk before an index can name them
        n = len(lengths)
        if n > np.iinfo(np.uint32).max:  # the header stores N as uint32
            raise ValueError(f"{prefix}: {n} entries do not fit the uint32 entry count; write "
                             "smaller shards")
        offsets = np.zeros(n + 1, dtype="<i8")
        np.cumsum(lengths, out=offsets[1:])
        with open(idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, code, n))
            f.write(offsets.tobytes())
            f.write(np.asarray(overlap_list, dtype="<u2").tobytes())
            f.flush()
            os.fsync(f.fileno())
        # an old .idx must go before its .bin is replaced: for a moment there is then no pair at
        # all, never an old index over new tokens
        remove_if_exists(idx_path)
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        remove_if_exists(bin_tmp)
        remove_if_exists(idx_tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(prefix)))  # the renames survive a crash too

