"""
Reading pretokenized .bin/.idx shards for the walk (nanochat/data/loader/order.py).
TokenShardReader deals chunks of `chunk_size` entries as units, and its documents are (tokens,
overlap) views into the memory map, each chunk's ids checked against the vocabulary as it is read
(one numpy pass). shard_vocab settles the shards' BOS and vocabulary up front, from the caller or
from the pretokenize.json our writer leaves; it never guesses. Design: docs/pretokenized.md.

May import: numpy, nanochat.data.base.state, nanochat.data.pretokenized.token_shards,
nanochat.data.base.checks, nanochat.data.base.layout.
"""

import logging
import os
from collections import OrderedDict
from functools import partial
from typing import NamedTuple

import numpy as np

from nanochat.data.base.checks import check_int, is_int
from nanochat.data.base.layout import check_kind, list_token_shards
from nanochat.data.base.state import UnitIndex
from nanochat.data.pretokenized.token_shards import (META_FILENAME, TokenShard, entry_count,
                                                     recorded_settings)

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# Pretokenized shards: .bin/.idx pairs (token_shards.py), no tokenizer in the loop


_WARNED_NO_VOCAB: set = set()  # directories warned about once already
# entries of the first shard whose first token is checked before the loader starts: a wrong BOS
# fails at once, and the rest are checked chunk by chunk as they are read
UPFRONT_ENTRIES = 1024


class ShardVocab(NamedTuple):
    """What the pretokenized loaders know of their shards' ids, checked up front by shard_vocab."""
    bos_token: int  # prepended to an entry that does not start with it
    vocab_size: int | None  # every id is below it; None: unknown (the dtype bounds them)
    vocab_from: str  # where vocab_size comes from, for messages
    # what pretokenize.json records ("nanochat", "gpt-simple"); None: no record
    convention: str | None
    # the pretokenize.json bos_token came from, when every entry must start with it
    bos_record: str | None


def shard_vocab(first_path: str, bos_token, vocab_size, settings_dirs: list[str]) -> ShardVocab:
    """The shards' BOS and vocabulary, checked up front. The vocabulary comes from the vocab_size
    argument and from pretokenize.json in settings_dirs, which must all agree; with none, ids are
    bounded only by the shards' dtype (a warning, once per directory). bos_token defaults to what
    pretokenize.json records: for the nanochat convention the BOS, which every entry must then
    start with (checked here for the first shard's first entries, and chunk by chunk as they are
    read); for the gpt-simple convention the EOD, prepended to every entry. With no record,
    bos_token must be passed: a ValueError shows the first ids of the first shard. It must be an id
    in the vocabulary that the first shard's dtype can hold."""
    vocab_size, vocab_from, (convention, key, recorded, record) = _recorded(vocab_size,
                                                                            settings_dirs)
    first = TokenShard(first_path)  # the one shard opened up front: its dtype, its first entries
    given = bos_token is not None
    if not given:
        if recorded is None:
            raise ValueError(f"no pretokenize.json records the BOS of the shards of "
                             f"{first.bin_path} (looked in {', '.join(settings_dirs)}), and the "
                             "loader does not guess it: pass bos_token=, the BOS id of the "
                             "tokenizer that wrote them (for GPT-Simple's shards, which have no "
                             "BOS, their EOD id: it is prepended to every entry). "
                             f"{first_ids(first, 0)}")
        bos_token, what = recorded, f"bos_token (the {key} that {record} records)"
    elif not is_int(bos_token, numpy=True):  # an id read from an array is fine here
        raise TypeError(f"bos_token must be an int token id, got {bos_token!r}")
    else:
        bos_token, what = int(bos_token), "bos_token"  # a numpy integer becomes a plain int
        if recorded is not None and bos_token != recorded:
            logger.warning("bos_token %d is not the %s %d that %s records; it is prepended to "
                           "every entry that does not start with it", bos_token, key, recorded,
                           record)
    if bos_token < 0:
        raise ValueError(f"{what} is {bos_token}; token ids are >= 0")
    if vocab_size is not None and bos_token >= vocab_size:
        raise ValueError(f"{what} is {bos_token}, outside the vocabulary [0, {vocab_size:,}) "
                         f"({vocab_from})")
    check_bos_fits(bos_token, first)
    # our writer's nanochat-convention entries all start with the recorded BOS; a caller who passes
    # bos_token vouches for the shards instead (GPT-Simple's own shards start with no fixed id)
    bos_record = record if not given and convention == "nanochat" else None
    if bos_record is not None:
        check_starts(first, 0, min(len(first), UPFRONT_ENTRIES), bos_token, bos_record)
    # absolute: one warning per directory, however the caller spelled its path
    directory = os.path.dirname(os.path.abspath(first_path))
    if vocab_size is None and directory not in _WARNED_NO_VOCAB:
        _WARNED_NO_VOCAB.add(directory)
        logger.warning("no vocabulary size for the shards in %s (no pretokenize.json with "
                       "vocab_size next to them, no vocab_size argument): their token ids are "
                       "checked only against their dtype (%s); pass vocab_size to catch a damaged "
                       "shard before the model sees its ids", directory, first.dtype.name)
    return ShardVocab(bos_token, vocab_size, vocab_from, convention, bos_record)


class BosRecord(NamedTuple):
    """What a pretokenize.json records of the id every entry gets first (all Nones: no record)."""
    convention: str | None  # "nanochat" or "gpt-simple"
    key: str | None  # "bos_token_id", or "eod_token_id" for gpt-simple
    token: int | None
    path: str | None  # the pretokenize.json


def _recorded(vocab_size, settings_dirs: list[str]) -> tuple[int | None, str, BosRecord]:
    """The vocabulary size and where it comes from, and the BOS record, from the vocab_size
    argument and the pretokenize.json files in settings_dirs: all must agree."""
    known, records = [], []
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, 1)
        known.append((vocab_size, "the vocab_size argument"))
    for directory in settings_dirs:  # a mixture's: its data directory and each bucket's
        settings = recorded_settings(directory)
        if settings is None:
            continue
        path = os.path.join(directory, META_FILENAME)
        if settings["vocab_size"] is not None:
            known.append((settings["vocab_size"], path))
        # gpt-simple entries have no BOS but end with EOD: that id is the one prepended
        key = "eod_token_id" if settings["convention"] == "gpt-simple" else "bos_token_id"
        if settings[key] is not None:
            records.append(BosRecord(settings["convention"], key, settings[key], path))
    vocab_size, vocab_from = known[0] if known else (None, "")  # the first source; the others agree
    for size, other in known[1:]:
        if size != vocab_size:
            raise ValueError(f"vocab_size {vocab_size:,} ({vocab_from}) disagrees with {size:,} "
                             f"({other}); pass the vocab_size of the tokenizer that wrote the "
                             "shards, and keep shards of different tokenizers apart")
    convention, key, recorded, record = records[0] if records else BosRecord(None, None, None, None)
    for other_convention, other_key, other_id, other_record in records[1:]:
        if (other_convention, other_id) != (convention, recorded):
            raise ValueError(f"{record} records the {convention} convention with {key} {recorded}, "
                             f"but {other_record} the {other_convention} convention with "
                             f"{other_key} {other_id}; keep shards written with other conventions "
                             "or tokenizers apart")
    return vocab_size, vocab_from, BosRecord(convention, key, recorded, record)


def first_ids(shard, start: int, count: int = 8) -> str:
    """The first token of entries start, start + 1, ... of shard, for a message."""
    stop = min(len(shard), start + count)
    if start >= stop:
        return f"{shard.bin_path} has no entries from {start} on."
    ids = [str(int(shard.tokens[shard.offsets[i]])) if shard.offsets[i + 1] > shard.offsets[i]
           else "(empty)" for i in range(start, stop)]
    return f"Entries {start} to {stop - 1} of {shard.bin_path} start with the ids {', '.join(ids)}."


def check_bos_fits(bos_token: int, shard) -> None:
    if bos_token > np.iinfo(shard.dtype).max:
        raise ValueError(f"bos_token is {bos_token}, which the {shard.dtype.name} ids of "
                         f"{shard.bin_path} cannot hold, so it is not these shards' BOS; pass the "
                         "BOS id of the tokenizer that wrote them")


def check_ids(shard, start: int, stop: int, vocab_size: int, vocab_from: str) -> None:
    """ValueError naming the shard and the entry if an id of entries [start, stop) is not below
    vocab_size: one numpy pass over their tokens (the bench prints its cost)."""
    tokens = shard.tokens[shard.offsets[start]:shard.offsets[stop]]
    if tokens.size and tokens.max() >= vocab_size:
        at = int(shard.offsets[start]) + int(np.argmax(tokens >= vocab_size))  # the first bad token
        # the entry whose span holds it: the last that starts at or before it
        entry = int(np.searchsorted(shard.offsets, at, side="right")) - 1
        raise ValueError(f"{shard.bin_path}: entry {entry} holds token id "
                         f"{int(shard.tokens[at])} (token {at - int(shard.offsets[entry])} of the "
                         f"entry), outside the vocabulary [0, {vocab_size:,}) ({vocab_from}); the "
                         "shard "
                         "is damaged or was written with another tokenizer: delete the pair and "
                         "rerun python -m nanochat.pretokenize")


def check_starts(shard, start: int, stop: int, bos_token: int, record: str) -> None:
    """ValueError naming the shard and the entry unless each of entries [start, stop) starts with
    bos_token, as record (a nanochat-convention pretokenize.json) says they do: one gather of their
    first tokens and one comparison (the bench prints its cost)."""
    firsts = shard.offsets[start:stop]
    lengths = shard.offsets[start + 1:stop + 1] - firsts
    # lengths first: an empty entry has no first token (its offset may be the tokens' end)
    if (lengths > 0).all() and (shard.tokens[firsts] == bos_token).all():
        return
    # the slow path, only to name the first entry that fails
    entry = next(i for i in range(start, stop) if shard.offsets[i + 1] == shard.offsets[i]
                 or shard.tokens[shard.offsets[i]] != bos_token)
    raise ValueError(f"{shard.bin_path}: entry {entry} does not start with the BOS {bos_token} "
                     f"that {record} records (nanochat's convention: every entry starts with it); "
                     "the shard is damaged or was written with other settings: delete the pair and "
                     "rerun python -m nanochat.pretokenize (for GPT-Simple's shards, which have no "
                     "BOS, pass bos_token=, their EOD id). "
                     + first_ids(shard, entry))


class Chunk(NamedTuple):
    """A unit of a pretokenized shard: its entries [start, stop)."""
    shard: TokenShard
    start: int
    stop: int


class TokenShardReader:
    """The walk's view of pretokenized shards: units are chunks of `chunk_size` entries (the DDP
    sharding deals chunks out as the parquet loader deals row groups), items are (tokens, overlap),
    the tokens a view into the memory-mapped .bin: shards larger than RAM are read in constant
    memory. The last 16 shards read stay open.
    vocab is shard_vocab's result: each chunk's ids are checked against it as the chunk is read
    (and their first tokens against the BOS, when it came from a nanochat-convention
    pretokenize.json)."""

    unit_name = "chunk"

    def __init__(self, paths: list[str], chunk_size: int, vocab: ShardVocab):
        self.paths, self.chunk_size = paths, chunk_size
        self.vocab = vocab
        self.index = chunk_index(paths, chunk_size)
        # the last few shards stay mapped (a shuffled window reads chunks of several); thousands
        # would exhaust file handles
        self._open: OrderedDict = OrderedDict()

    def shard(self, pq_idx: int):
        if pq_idx not in self._open:
            shard = TokenShard(self.paths[pq_idx])
            check_bos_fits(self.vocab.bos_token, shard)  # every shard: they may mix uint16, uint32
            self._open[pq_idx] = shard
            if len(self._open) > 16:
                self._open.popitem(last=False)
        self._open.move_to_end(pq_idx)
        return self._open[pq_idx]

    def read(self, pq_idx: int, rg_idx: int, doc_indices=None) -> Chunk:
        """Chunk rg_idx of shard pq_idx, its ids checked. doc_indices: unused (the walk passes a
        buffer's document indices to any reader; a parquet reader may serve them from kept
        copies)."""
        shard = self.shard(pq_idx)
        start = rg_idx * self.chunk_size
        stop = min(start + self.chunk_size, len(shard))  # the last chunk may be short
        if self.vocab.vocab_size is not None:  # (else the dtype bounds the ids, by construction)
            check_ids(shard, start, stop, self.vocab.vocab_size, self.vocab.vocab_from)
        if self.vocab.bos_record is not None:
            check_starts(shard, start, stop, self.vocab.bos_token, self.vocab.bos_record)
        return Chunk(shard, start, stop)

    @staticmethod
    def size(unit: Chunk) -> int:
        return unit.stop - unit.start

    @classmethod
    def take(cls, unit: Chunk, first: int, stop: int) -> list:
        return cls.pick(unit, range(first, stop))

    @staticmethod
    def pick(unit: Chunk, doc_indices) -> list:
        shard, first, _ = unit
        at = np.asarray(doc_indices, dtype=np.int64) + first
        # the bounds and overlaps of every entry at once, as ints: a slice of the map per entry is
        # then all that is left (~3x cheaper per entry than shard.entry())
        bounds, overlaps = shard.offsets[at].tolist(), shard.overlaps[at].tolist()
        ends = shard.offsets[at + 1].tolist()
        tokens = shard.tokens
        return [(tokens[a:b], overlap) for a, b, overlap in zip(bounds, ends, overlaps)]


def chunk_index(paths: list[str], chunk_size: int) -> UnitIndex:
    """The chunks of `chunk_size` entries of token shards, counted from their .idx headers."""
    return UnitIndex(paths, partial(chunk_sizes, chunk_size), chunk_size)


def chunk_sizes(chunk_size: int, path: str) -> list[int]:
    """Entries in each chunk of a token shard: chunk_size each, the last one holding the rest."""
    n = entry_count(path)  # 16 bytes of the .idx header
    return [min(chunk_size, n - first) for first in range(0, n, chunk_size)]


def shard_paths(data_dir: str, split: str) -> list[str]:
    """The .bin paths of the complete pairs in data_dir/split, sorted. When there are none:
    ValueError if data_dir holds another kind of data (parquet shards, buckets, ...), else
    FileNotFoundError."""
    split_dir = os.path.join(data_dir, split)
    paths = ([prefix + ".bin" for prefix in list_token_shards(split_dir)]
             if os.path.isdir(split_dir) else [])
    if paths:
        return paths
    check_kind(data_dir, "pretokenized")  # another kind of data: a ValueError that names it
    command = ("python -m nanochat.pretokenize --input <parquet dir, or jsonl files> "
               f"--output {data_dir}")
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"{split_dir} does not exist; pretokenize shards first: {command}")
    raise FileNotFoundError(f"no .bin/.idx pairs in {split_dir}; pretokenize shards first: "
                            f"{command}" + (" (jsonl files for val/ go to --val-input)"
                                            if split == "val" else ""))
