"""
Where documents come from: the units a rank is dealt, and the documents in them, behind one small
interface that the rank's stream (nanochat/stream.py) reads through:

    reader.paths, reader.index       the split's files; a RowGroupIndex of their units
    reader.unit_name                 what a unit is called in messages ("row group", "chunk")
    reader.read(pq_idx, rg_idx)      one unit of one file
    reader.size(unit)                the documents in it
    reader.take(unit, start, stop)   documents [start, stop) of it, in order
    reader.pick(unit, rows)          the given documents of it

ParquetReader: parquet shards, whose units are row groups and whose documents are texts (tokenized
later). ShardReader: pretokenized .bin/.idx shards, whose units are chunks of chunk_size entries and
whose documents are (tokens, overlap) views into the memory map, each chunk's ids checked against
the vocabulary as it is read.

May import: nanochat.dataset, nanochat.token_shards, nanochat.options, nanochat.layout.
"""

import bisect
import logging
import os
from collections import OrderedDict

import numpy as np

from nanochat.dataset import open_parquet, read_row_group_column
from nanochat.layout import describe_mismatch
from nanochat.options import check_positive
from nanochat.token_shards import META_FILENAME, TokenShard, entry_count, list_token_shards, recorded_vocab_size

logger = logging.getLogger("nanochat.dataloader.readers")  # child of its old logger

# -----------------------------------------------------------------------------
# Where the units are: a global index over the split's files, read lazily (footers and indexes only)


class RowGroupIndex:
    """The units a stream deals out, per file: parquet row groups, or chunks of `chunk_size` entries
    of a pretokenized shard (chunk_size set). Counted lazily, a file's footer or index when that
    file is first asked about; only a plan's bitmaps (after an elastic merge) need them all."""

    def __init__(self, paths: list[str], chunk_size: int | None = None):
        self.paths = paths
        self.chunk_size = chunk_size
        self._sizes: dict[int, list[int]] = {}  # pq_idx -> documents in each of its units
        self._bases: list[int] | None = None  # cumulative counts: where each file starts

    def sizes(self, pq_idx: int) -> list[int]:
        """Documents in each unit of one file, from its footer (or its index), read once."""
        if pq_idx not in self._sizes:
            if self.chunk_size is None:
                meta = open_parquet(self.paths[pq_idx]).metadata
                self._sizes[pq_idx] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            else:
                n = entry_count(self.paths[pq_idx])
                self._sizes[pq_idx] = [min(self.chunk_size, n - start) for start in range(0, n, self.chunk_size)]
        return self._sizes[pq_idx]

    def count(self, pq_idx: int) -> int:
        return len(self.sizes(pq_idx))

    def rows(self, pq_idx: int, rg_idx: int) -> int:
        """Documents in one unit."""
        return self.sizes(pq_idx)[rg_idx]

    @property
    def bases(self) -> list[int]:
        if self._bases is None:
            self._bases = [0]
            for pq_idx in range(len(self.paths)):
                self._bases.append(self._bases[-1] + self.count(pq_idx))
        return self._bases

    @property
    def total(self) -> int:
        return self.bases[-1]

    def base(self, pq_idx: int) -> int:
        return self.bases[pq_idx]

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.total:
            raise ValueError("row group index past the end of the split")
        pq_idx = bisect.bisect_right(self.bases, index) - 1
        return pq_idx, index - self.bases[pq_idx]


# -----------------------------------------------------------------------------
# Parquet shards


class ParquetReader:
    """The stream's view of parquet shards: units are row groups, items are texts to tokenize."""

    unit_name = "row group"

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.index = RowGroupIndex(paths)

    def read(self, pq_idx: int, rg_idx: int):
        path = self.paths[pq_idx]
        return read_row_group_column(open_parquet(path), rg_idx, path)

    @staticmethod
    def size(unit) -> int:
        return len(unit)

    @staticmethod
    def take(unit, start: int, stop: int) -> list[str]:
        return unit.slice(start, stop - start).to_pylist()  # a slice at a time: see read_row_group_column

    @staticmethod
    def pick(unit, rows) -> list[str]:
        return unit.take(list(rows)).to_pylist()


# -----------------------------------------------------------------------------
# Pretokenized shards: .bin/.idx pairs (nanochat/token_shards.py), no tokenizer in the loop


_WARNED_NO_VOCAB: set = set()  # directories warned about once already


def shard_vocab(first_path: str, bos_token, vocab_size, settings_dirs: list[str]) -> tuple[int, int | None, str]:
    """(bos_token, vocab_size or None, where vocab_size comes from), checked up front. The vocabulary
    comes from the vocab_size argument and from pretokenize.json in settings_dirs, which must all agree;
    bos_token (default: the first token of the first shard) must be an id in it, and one that the first
    shard's dtype can hold. With no vocabulary known, ids are bounded only by the shards' dtype (a
    warning, once per directory)."""
    known = []
    if vocab_size is not None:
        check_positive(vocab_size=vocab_size)
        known.append((vocab_size, "the vocab_size argument"))
    for directory in settings_dirs:
        size = recorded_vocab_size(directory)
        if size is not None:
            known.append((size, os.path.join(directory, META_FILENAME)))
    vocab_size, where = known[0] if known else (None, "")
    for size, other in known[1:]:
        if size != vocab_size:
            raise ValueError(f"vocab_size {vocab_size:,} ({where}) disagrees with {size:,} ({other}); pass the "
                             "vocab_size of the tokenizer that wrote the shards, and keep shards of different "
                             "tokenizers apart")
    first = TokenShard(first_path)
    if bos_token is None:
        if not len(first) or not len(first.entry(0)):
            raise ValueError(f"{first.prefix} starts with an empty entry; pass bos_token explicitly")
        bos_token, what = int(first.entry(0)[0]), f"bos_token (the first token of {first.bin_path})"
    elif isinstance(bos_token, bool) or not isinstance(bos_token, (int, np.integer)):
        raise TypeError(f"bos_token must be an int token id, got {bos_token!r}")
    else:
        bos_token, what = int(bos_token), "bos_token"
    if bos_token < 0:
        raise ValueError(f"{what} is {bos_token}; token ids are >= 0")
    if vocab_size is not None and bos_token >= vocab_size:
        raise ValueError(f"{what} is {bos_token}, outside the vocabulary [0, {vocab_size:,}) ({where})")
    check_bos_fits(bos_token, first)
    directory = os.path.dirname(os.path.abspath(first_path))
    if vocab_size is None and directory not in _WARNED_NO_VOCAB:
        _WARNED_NO_VOCAB.add(directory)
        logger.warning("no vocabulary size for the shards in %s (no pretokenize.json with vocab_size next to "
                       "them, no vocab_size argument): their token ids are checked only against their dtype "
                       "(%s); pass vocab_size to catch a damaged shard before the model sees its ids",
                       directory, first.dtype.name)
    return bos_token, vocab_size, where


def check_bos_fits(bos_token: int, shard) -> None:
    if bos_token > np.iinfo(shard.dtype).max:
        raise ValueError(f"bos_token is {bos_token}, which the {shard.dtype.name} ids of {shard.bin_path} cannot "
                         "hold, so it is not these shards' BOS; pass the BOS id of the tokenizer that wrote them")


def check_ids(shard, start: int, stop: int, vocab_size: int, where: str) -> None:
    """ValueError naming the shard and the entry if an id of entries [start, stop) is not below
    vocab_size: one numpy pass over their tokens (the bench prints its cost)."""
    tokens = shard.tokens[shard.offsets[start]:shard.offsets[stop]]
    if tokens.size and tokens.max() >= vocab_size:
        at = int(shard.offsets[start]) + int(np.argmax(tokens >= vocab_size))  # the first bad token
        entry = int(np.searchsorted(shard.offsets, at, side="right")) - 1
        raise ValueError(f"{shard.bin_path}: entry {entry} holds token id {int(shard.tokens[at])} (token "
                         f"{at - int(shard.offsets[entry])} of the entry), outside the vocabulary [0, "
                         f"{vocab_size:,}) ({where}); the shard is damaged or was written with another "
                         "tokenizer: delete the pair and rerun python -m nanochat.pretokenize")


class ShardReader:
    """The stream's view of pretokenized shards: units are chunks of `chunk_size` entries (the DDP
    sharding deals chunks out as the parquet loader deals row groups), items are (tokens, overlap),
    the tokens a view into the memory-mapped .bin: shards larger than RAM stream in constant memory.
    The last 16 shards read stay open.
    vocab is shard_vocab's result: each chunk's ids are checked against it as the chunk is read."""

    unit_name = "chunk"

    def __init__(self, paths: list[str], chunk_size: int, vocab: tuple[int, int | None, str]):
        self.paths, self.chunk_size = paths, chunk_size
        self.bos_token, self.vocab_size, self.vocab_where = vocab
        self.index = RowGroupIndex(paths, chunk_size)
        # the last few shards stay mapped (a shuffled window reads chunks of several); thousands would exhaust
        # file handles
        self._open: OrderedDict = OrderedDict()

    def shard(self, pq_idx: int):
        if pq_idx not in self._open:
            shard = TokenShard(self.paths[pq_idx])
            check_bos_fits(self.bos_token, shard)
            self._open[pq_idx] = shard
            if len(self._open) > 16:
                self._open.popitem(last=False)
        self._open.move_to_end(pq_idx)
        return self._open[pq_idx]

    def read(self, pq_idx: int, rg_idx: int):
        shard = self.shard(pq_idx)
        start = rg_idx * self.chunk_size
        stop = min(start + self.chunk_size, len(shard))
        if self.vocab_size is not None:  # (else the dtype bounds the ids, by construction)
            check_ids(shard, start, stop, self.vocab_size, self.vocab_where)
        return shard, start, stop

    @staticmethod
    def size(unit) -> int:
        return unit[2] - unit[1]

    @classmethod
    def take(cls, unit, start: int, stop: int) -> list:
        return cls.pick(unit, range(start, stop))

    @staticmethod
    def pick(unit, rows) -> list:
        shard, first, _ = unit
        return [(shard.entry(first + r), int(shard.overlaps[first + r])) for r in rows]


def shard_paths(data_dir: str, split: str) -> list[str]:
    """The .bin paths of the complete pairs in data_dir/split, sorted. When there are none: ValueError if
    data_dir holds another kind of data (parquet shards, buckets, ...), else FileNotFoundError."""
    split_dir = os.path.join(data_dir, split)
    paths = [prefix + ".bin" for prefix in list_token_shards(split_dir)] if os.path.isdir(split_dir) else []
    if paths:
        return paths
    mismatch = describe_mismatch(data_dir, "pretokenized")
    if mismatch:
        raise ValueError(mismatch)
    command = f"python -m nanochat.pretokenize --input <parquet dir, or jsonl files> --output {data_dir}"
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"{split_dir} does not exist; pretokenize shards first: {command}")
    raise FileNotFoundError(f"no .bin/.idx pairs in {split_dir}; pretokenize shards first: {command}"
                            + (" (jsonl files for val/ go to --val-input)" if split == "val" else ""))
