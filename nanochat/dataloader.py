"""
Distributed, tokenizing data loaders: parquet shards -> token documents -> packed rows -> device.

    for inputs, targets, state_dict in tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, B, T, "train", device="cuda"):
        ...  # inputs, targets: (B, T) int64 on the device

The pipeline, each stage a generator that can be read and tested alone:
  1. documents: walk the split's shards, row groups rank, rank+world_size, ... (DDP sharding),
     cut into batches of `tokenizer_batch_size` texts, forever (epochs count from 1);
  2. tokens: `tokenizer.encode(texts, prepend=bos)` -> numpy documents (2 bytes/token when the
     vocabulary allows);
  3. packing (nanochat/packing.py, pure): best-fit BOS-aligned rows (long documents cropped as the
     seeds do, or split into BOS-led pieces: long_doc_policy), or the concatenated stream;
  4. transfer: one pinned `[inputs | targets]` staging buffer -> one non-blocking copy to the device.
Reading, tokenizing and packing each run ahead on a background thread (`prefetch`), so they overlap
with each other and with the training step; the state yielded with a batch describes what that batch
consumed, never what was read ahead.

The yielded tensors are views into one device buffer that the next batch overwrites (in stream
order on CUDA, so a training step that has already been queued is safe); clone them to keep them.

`state_dict` is the exact position of the stream (format and checks in nanochat/resume.py): passed
back as `resume_state_dict`, it makes a new loader yield the very batches the uninterrupted run would
have. It keeps nanochat's keys {"pq_idx", "rg_idx", "epoch"} (the last document batch consumed), and
a dict with only those keys still resumes approximately, after that row group, as nanochat does.
"""

import atexit
import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from nanochat import resume
from nanochat.common import get_dist_info
from nanochat.dataset import SPLITS, open_parquet, read_row_group_column, split_parquet_files
from nanochat.packing import BestFitPacker, ConcatPacker, check_long_doc_policy, token_dtype
from nanochat.resume import Key, RowGroupIndex, Unit

logger = logging.getLogger(__name__)

Position = tuple[int, int, int]  # (pq_idx, rg_idx, epoch): the seeds' state keys
Cursor = tuple[int, int, int, int]  # (epoch, pq_idx, rg_idx, row): where a document batch starts
SEEDS_KEYS = ("pq_idx", "rg_idx", "epoch")
IGNORE_INDEX = -100  # cross_entropy's default ignore_index

# -----------------------------------------------------------------------------
# Checking arguments


def _check_positive(**kwargs) -> None:
    for name, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    _, env_rank, _, env_world_size = get_dist_info()
    rank = env_rank if rank is None else rank
    world_size = env_world_size if world_size is None else world_size
    _check_positive(world_size=world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size


def _check_legacy_state(state: dict, paths: list[str], reader, where: str = "resume_state_dict") -> Position:
    """Validate a seeds-form state {pq_idx, rg_idx[, epoch]}; returns where the stream continues:
    the row group after the saved one (approximate, as the seeds' resume)."""
    missing = {"pq_idx", "rg_idx"} - state.keys()
    if missing:
        raise ValueError(f"{where} is missing {sorted(missing)}")
    # "epoch" is optional: the older concatenating loader's states do not carry it
    values = {"pq_idx": state["pq_idx"], "rg_idx": state["rg_idx"], "epoch": state.get("epoch", 1)}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}[{key!r}] must be an int, got {value!r}")
    pq_idx, rg_idx, epoch = values["pq_idx"], values["rg_idx"], values["epoch"]
    if epoch < 1:
        raise ValueError(f"{where}['epoch'] must be >= 1 (epochs count from 1), got {epoch}")
    if not 0 <= pq_idx < len(paths):
        raise ValueError(f"{where}['pq_idx']={pq_idx} points past the data: "
                         f"the split has {len(paths)} file(s)")
    num_units = reader.index.count(pq_idx)
    if not 0 <= rg_idx < num_units:
        raise ValueError(f"{where}['rg_idx']={rg_idx} points past the data: "
                         f"{paths[pq_idx]} has {num_units} {reader.unit_name}(s)")
    return pq_idx, rg_idx, epoch


# -----------------------------------------------------------------------------
# Stage 1: documents


class _ParquetReader:
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


class _Stream:
    """One rank's documents, in order: first its plan (work an elastic resume dealt to it), then the
    regular stream from `start`: per epoch, units (row groups, or chunks of a pretokenized shard)
    rank, rank + world_size, ... of every file, each cut into batches of `batch_size` documents."""

    def __init__(self, reader, rank: int, world_size: int, batch_size: int,
                 plan: list[Unit] = (), start: Cursor | None = None, epochs: int | None = None,
                 where: str = "resume_state_dict"):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.where = where  # what messages call the state it resumed from
        self.epochs = epochs  # None: forever; 1: one pass (a mixture's bucket), then the stream ends
        self.paths, self.index = reader.paths, reader.index
        self.tokenizer_batch_size = batch_size
        self.plan = list(plan)
        self.start = start if start is not None else (1, 0, rank, 0)  # (epoch, pq_idx, rg_idx, row)
        self.first_position = ("plan", 0, 0, None) if self.plan else ("regular", *self.start)

    def _unit(self, pq_idx: int, rg_idx: int, where: str):
        if not (0 <= pq_idx < len(self.paths) and 0 <= rg_idx < self.index.count(pq_idx)):
            raise ValueError(f"{where} refers to file {pq_idx}, {self.reader.unit_name} {rg_idx}, which this "
                             f"split does not have ({len(self.paths)} files): the state does not match the data")
        return self.reader.read(pq_idx, rg_idx)

    def _check_rows(self, rows, unit, pq_idx: int, rg_idx: int, where: str) -> None:
        n = self.reader.size(unit)
        if rows and not 0 <= min(rows) <= max(rows) < n:
            raise ValueError(f"{where} refers to row {max(rows)} of {self.paths[pq_idx]} {self.reader.unit_name} "
                             f"{rg_idx}, which has {n} rows: the state does not match the data")

    def read_documents(self, keys: list[Key], where: str) -> list:
        """The items of the given documents (for rebuilding a buffer), reading each unit once."""
        items = []
        for (pq_idx, rg_idx), group in itertools.groupby(keys, key=lambda k: (k[1], k[2])):
            rows = [key[3] for key in group]
            unit = self._unit(pq_idx, rg_idx, where)
            self._check_rows(rows, unit, pq_idx, rg_idx, where)
            items += self.reader.pick(unit, rows)
        return items

    def batches(self):
        """Yield (texts, keys, after): the keys (epoch, pq_idx, rg_idx, row) of the texts (a plan's
        pieces: (epoch, pq_idx, rg_idx, row, start)), and where the stream continues after them,
        ("plan", unit, offset, n) or ("regular", *cursor)."""
        tbs = self.tokenizer_batch_size
        for u, (epoch, pq_idx, rg_idx, rows, starts) in enumerate(self.plan):
            unit = self._unit(pq_idx, rg_idx, f"{self.where}['plan']")
            rows = range(self.reader.size(unit)) if rows is None else rows
            starts = starts or (None,) * len(rows)
            self._check_rows(rows, unit, pq_idx, rg_idx, f"{self.where}['plan']")
            for i in range(0, len(rows), tbs):
                chunk = rows[i:i + tbs]
                keys = [(epoch, pq_idx, rg_idx, r) if start is None else (epoch, pq_idx, rg_idx, r, start)
                        for r, start in zip(chunk, starts[i:i + tbs])]
                yield self.reader.pick(unit, chunk), keys, ("plan", u, i + len(chunk), len(rows))
        yield from self._regular()

    def _regular(self):
        tbs, rank, world_size = self.tokenizer_batch_size, self.rank, self.world_size
        epoch, pq_idx, rg_idx, row = self.start
        while self.epochs is None or epoch <= self.epochs:  # one epoch per pass
            docs_this_pass = 0
            full_pass = (pq_idx, rg_idx, row) == (0, rank, 0)
            while pq_idx < len(self.paths):
                while rg_idx < self.index.count(pq_idx):
                    unit = self.reader.read(pq_idx, rg_idx)
                    n = self.reader.size(unit)
                    if row > n:
                        raise ValueError(f"{self.where}['next'] points at row {row} of {self.paths[pq_idx]} "
                                         f"{self.reader.unit_name} {rg_idx}, which has {n} rows: the state does "
                                         "not match the data")
                    docs_this_pass += n
                    for i in range(row, n, tbs):
                        j = min(i + tbs, n)
                        # where the stream continues: the next batch of this unit, else the next unit
                        after = (epoch, pq_idx, rg_idx, j) if j < n else (epoch, pq_idx, rg_idx + world_size, 0)
                        yield (self.reader.take(unit, i, j), [(epoch, pq_idx, rg_idx, r) for r in range(i, j)],
                               ("regular", *after))
                    rg_idx += world_size
                    row = 0
                pq_idx += 1
                rg_idx = rank
            if full_pass and docs_this_pass == 0 and self.epochs is None:
                # the reference loops here forever; a rank with nothing to read is a configuration error
                raise ValueError(
                    f"rank {rank} of world size {world_size} receives no documents: the split's "
                    f"{len(self.paths)} file(s) have too few (non-empty) {self.reader.unit_name}s for this many "
                    f"ranks (they are dealt out rank, rank+{world_size}, ...); use fewer ranks or "
                    f"shards with more, smaller {self.reader.unit_name}s")
            epoch, pq_idx, rg_idx, row = epoch + 1, 0, rank, 0

    def remaining_plan(self, position) -> tuple[list[Unit], Cursor]:
        """(plan units not yet read, regular cursor) at a position yielded by batches()."""
        if position[0] == "regular":
            return [], tuple(position[1:])
        _, u, offset, n = position
        units = self.plan[u:]
        if offset:
            epoch, pq_idx, rg_idx, rows, starts = units[0]
            rest = tuple(range(offset, n)) if rows is None else tuple(rows[offset:])
            starts = None if starts is None else starts[offset:]
            units = ([(epoch, pq_idx, rg_idx, rest, starts)] if rest else []) + units[1:]
        return units, self.start


# -----------------------------------------------------------------------------
# Stage 2: tokens


# A tokenizer that returns lists (nanochat's, any duck-typed one) costs the loader a conversion per token:
# struct packs a document's Python ints into the storage dtype in one C loop, ~14 ns a token inside the
# loader against ~33 for np.asarray to int64, a min/max and astype, and refuses, with struct.error, an id
# that is not an int (a float, a str) or does not fit the dtype
_FORMATS = {np.dtype(np.uint16): "H", np.dtype(np.uint32): "I"}
assert all(struct.calcsize(code) == dtype.itemsize for dtype, code in _FORMATS.items())


def _to_documents(token_lists, bos: int, dtype: np.dtype) -> list[np.ndarray]:
    """Check the tokenizer's output and store each document compactly."""
    if not isinstance(token_lists, (list, tuple)):
        raise TypeError(f"tokenizer.encode must return a list of token-id lists, got {type(token_lists).__name__}")
    limit = np.iinfo(dtype).max
    docs = []
    for ids in token_lists:
        if isinstance(ids, np.ndarray) and ids.dtype == dtype and ids.ndim == 1 and ids.size and ids[0] == bos:
            docs.append(ids)  # already compact (encode_to_arrays): every value fits by its dtype
            continue
        if isinstance(ids, (list, tuple)):
            arr = _list_to_array(ids, dtype, limit)
        elif isinstance(ids, np.ndarray):
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise TypeError(f"tokenizer.encode must return lists of ints, got an array of {ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() > limit):
                raise _out_of_range(dtype, limit)
            arr = ids.astype(dtype)
        else:
            raise TypeError(f"tokenizer.encode must return lists of ints, got an element of type {type(ids).__name__}")
        if arr.size == 0 or arr[0] != bos:
            raise ValueError("tokenizer.encode(texts, prepend=bos) returned a document that does not start "
                             f"with the BOS token {bos}; every document must start with BOS")
        docs.append(arr)
    return docs


def _list_to_array(ids, dtype: np.dtype, limit: int) -> np.ndarray:
    try:
        packed = struct.Struct(f"{len(ids)}{_FORMATS[dtype]}").pack(*ids)
    except (struct.error, OverflowError, TypeError):
        bad = next((type(i).__name__ for i in ids if not isinstance(i, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"tokenizer.encode must return lists of ints, got a list holding {bad}") from None
        raise _out_of_range(dtype, limit) from None
    return np.frombuffer(packed, dtype=dtype).copy()  # owns its memory and is writable, as astype's result was


def _out_of_range(dtype: np.dtype, limit: int) -> ValueError:
    return ValueError(f"token id out of range [0, {limit}] for {dtype} storage: "
                      "tokenizer.get_vocab_size() is smaller than the ids it produces")


class _Encoder:
    """texts -> checked numpy documents with BOS first, in the narrowest dtype the vocabulary allows."""

    def __init__(self, tokenizer, tokenizer_threads: int):
        self.bos = tokenizer.get_bos_token_id()
        vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
        self.dtype = token_dtype(vocab_size)
        # a tokenizer that can return numpy arrays (ours can) skips building a Python int per token;
        # ours may also be called from two threads at once (its thread pool is shared and locked).
        # One that returns lists is called one batch at a time, even where two calls would be safe
        # (nanochat's RustBPETokenizer): tiktoken starts a thread pool per call, and two calls at once
        # took 10-30% more CPU per token and lowered the loader's throughput (0.69-0.86 of the
        # tokenizer alone, against 0.86-0.93 one at a time, on 2 cores)
        self.encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
        self.thread_safe = hasattr(tokenizer, "encode_to_arrays")
        self.threads = tokenizer_threads

    def __call__(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        """(documents, overlaps): whole documents repeat nothing."""
        docs = _to_documents(self.encode(texts, prepend=self.bos, num_threads=self.threads), self.bos, self.dtype)
        return docs, [0] * len(docs)


def _token_batches(doc_batches, encoder, overlap_calls: bool = False):
    """Yield (documents, keys, after, overlaps) for each document batch: the texts tokenized with BOS
    prepended (or, for pretokenized shards, the entries as they are).

    overlap_calls: start the next batch's encode call before this one returns, so the tokenizer's
    thread pool does not idle on the tail of each call (its last, longest documents). Only for a
    tokenizer that returns arrays and may be called from two threads at once (ours)."""
    if not overlap_calls:
        for items, keys, after in doc_batches:
            docs, overlaps = encoder(items)
            yield docs, keys, after, overlaps
        return
    with ThreadPoolExecutor(2, thread_name_prefix="nanochat-encode-call") as calls:
        pending: deque = deque()
        for items, keys, after in doc_batches:
            pending.append((calls.submit(encoder, items), keys, after))
            if len(pending) == 2:  # the newer call keeps running while this batch goes on
                future, keys, after = pending.popleft()
                docs, overlaps = future.result()
                yield docs, keys, after, overlaps
        while pending:
            future, keys, after = pending.popleft()
            docs, overlaps = future.result()
            yield docs, keys, after, overlaps


# -----------------------------------------------------------------------------
# Stage 3: packing (the pure core is in nanochat/packing.py)


class _Source:
    """Pulls document batches for a packer as (document, key) pairs, and remembers where the stream
    stands after the last batch pulled (what a state must describe: consumed, not read ahead)."""

    def __init__(self, token_batches, stream: _Stream, position: Position):
        self.token_batches = token_batches
        self.after = stream.first_position
        self.position = position  # the seeds' keys of the last batch pulled
        self.where = stream.where

    def __call__(self):
        docs, keys, self.after, overlaps = next(self.token_batches)
        self.position = (keys[-1][1], keys[-1][2], keys[-1][0])
        if self.after[0] == "plan":  # an elastic plan may deal single pieces of split documents
            for doc, key in zip(docs, keys):
                if len(key) == 5 and key[4] >= len(doc):
                    raise ValueError(f"{self.where}['plan'] deals document {key[:4]} from token {key[4]}, but it has "
                                     f"{len(doc)}: the state does not match the data or the tokenizer")
            return [(doc, key[:4], overlap, key[4] if len(key) == 5 else None)
                    for doc, key, overlap in zip(docs, keys, overlaps)]
        return zip(docs, keys, overlaps, itertools.repeat(None))


class _Tracker:
    """Builds the state yielded with each batch, and restores a packer from one."""

    def __init__(self, kind: str, stream: _Stream, encoder, config: dict, start: dict | None):
        self.kind, self.stream, self.encoder, self.config = kind, stream, encoder, config
        self.start = start  # a version-2 state that continues this stream, or None
        emitted = start["emitted"] if start else {"batches": 0, "tokens": 0, "hash": resume.EMPTY_HASH}
        self.batches, self.tokens, self.hash = emitted["batches"], emitted["tokens"], emitted["hash"]
        self._plan_cache: tuple = (None, None)

    def restore(self, packer) -> None:
        """Re-read and re-tokenize the buffered documents (each once, however many of its pieces are
        buffered), rebuild the buffer in arrival order, and restore the counters."""
        if not self.start:
            return
        where = self.stream.where
        keys = resume.decode_keys(self.start["buffer"])  # (its size was checked: resume.check_fields)
        starts = resume.decode_pieces(self.start.get("pieces", []), len(keys))
        unique = list(dict.fromkeys(keys))
        items = self.stream.read_documents(unique, f"{where}['buffer']")
        tokenized = {}
        for i in range(0, len(items), 1024):
            docs, overlaps = self.encoder(items[i:i + 1024])
            tokenized.update(zip(unique[i:i + 1024], zip(docs, overlaps)))
        for i, (key, start) in enumerate(zip(keys, starts)):
            doc, overlap = tokenized[key]
            if start is not None and start >= len(doc):
                raise ValueError(f"{where}['pieces'] starts buffered entry {i} at token {start}, but its document has "
                                 f"{len(doc)}: the state does not match the data or the tokenizer")
            packer.add(doc, key, overlap, start)
        if self.kind == "concat" and keys:
            offset, first = self.start["offset"], len(tokenized[keys[0]][0]) - (starts[0] or 0)
            if offset >= first:  # the last token of the first entry is never consumed: it is the next batch's first
                raise ValueError(f"{where}['offset'] is {offset}, but the first buffered entry has {first} tokens: "
                                 "the state does not match the data or the tokenizer")
            packer.skip_consumed(offset)
        for name, value in self.start["counters"].items():
            setattr(packer, name, value)

    def _plan_items(self, units: list[Unit]) -> list[dict]:
        # the encoded tail of a long plan changes only when a unit is finished: cache it
        if self._plan_cache[0] != len(units):
            self._plan_cache = (len(units), resume.encode_plan(units[1:], self.stream.index))
        return resume.encode_plan(units[:1], self.stream.index) + self._plan_cache[1]

    def state(self, packer, source: _Source, tokens: np.ndarray) -> dict:
        self.batches += 1
        self.tokens += tokens.size
        self.hash = resume.hash_tokens(self.hash, tokens)
        units, cursor = self.stream.remaining_plan(source.after)
        pq_idx, rg_idx, epoch = source.position
        counters = {name: getattr(packer, name) for name in packer.COUNTERS}
        return resume.seal({
            "version": resume.VERSION, "loader": self.kind,
            "pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch,
            "plan": self._plan_items(units) if units else [], "next": list(cursor),
            "buffer": resume.encode_keys(packer.buffered_keys()), "pieces": packer.buffered_pieces(),
            "offset": packer.offset if self.kind == "concat" else 0,
            "config": self.config,
            "emitted": {"batches": self.batches, "tokens": self.tokens, "hash": self.hash},
            "counters": counters,
        })


def _attention_info(starts: list[list[int]], T: int, max_docs_per_row: int) -> dict[str, np.ndarray]:
    """Per-batch outputs for document-aware attention, from where each row's documents start:
    doc_ids (B, T) (0, 1, ... within each row), position_ids (B, T) restarting at every document, and
    cu_seqlens (B * max_docs_per_row + 1,) int32: the document boundaries of the flattened B*T inputs
    for variable-length attention kernels, padded with B*T to a fixed size (a fixed shape never makes
    torch.compile recompile)."""
    B = len(starts)
    marker = np.zeros((B, T), dtype=np.int64)
    bounds = []
    for r, row_starts in enumerate(starts):
        inside = [s for s in row_starts if s < T]  # a document starting at T is only a target
        if len(inside) > max_docs_per_row:
            raise ValueError(f"a row holds {len(inside)} documents, more than max_docs_per_row={max_docs_per_row}; "
                             "raise max_docs_per_row (the padded size of cu_seqlens)")
        marker[r, inside[1:]] = inside[1:]
        bounds += [r * T + s for s in inside]
    segment_start = np.maximum.accumulate(marker, axis=1)
    doc_ids = np.cumsum(marker > 0, axis=1).astype(np.int32)
    position_ids = np.arange(T)[None, :] - segment_start
    cu_seqlens = np.full(B * max_docs_per_row + 1, B * T, dtype=np.int32)
    cu_seqlens[:len(bounds)] = bounds
    return {"doc_ids": doc_ids, "position_ids": position_ids, "cu_seqlens": cu_seqlens}


def _bestfit_batches(token_batches, tracker: _Tracker, position: Position, B: int, T: int, buffer_size: int,
                     trace: bool, max_docs_per_row: int | None = None):
    """Yield (rows (B, T+1), state, stats, extras) packed best-fit; rows are a fresh array each batch.
    extras: the trace, the target ranges to mask (window overlaps) and, when max_docs_per_row is set,
    the attention outputs."""
    # T + 1 so that inputs and targets can both be sliced from one row
    packer = BestFitPacker(T + 1, tracker.config["long_doc_policy"], tracker.config["split_overlap"])
    tracker.restore(packer)
    source = _Source(token_batches, tracker.stream, position)
    while True:
        rows = np.empty((B, T + 1), dtype=tracker.encoder.dtype)  # token dtype: the transfer widens it
        packer.trace = [] if trace else None
        packer.fill(rows, source, buffer_size)
        extras = {"trace": None, "masked": packer.masked}
        if trace:  # a document's key, or (*key, start) for a piece of a split document
            extras["trace"] = [[key if start is None else (*key, start) for key, start in row] for row in packer.trace]
        if max_docs_per_row is not None:
            extras["info"] = _attention_info(packer.starts, T, max_docs_per_row)
        yield rows, tracker.state(packer, source, rows), packer.stats(), extras


def _concat_batches(token_batches, tracker: _Tracker, position: Position, B: int, T: int, trace: bool):
    """Yield (tokens (B*T+1,), state, stats, extras): the next B*T+1 tokens of the concatenated stream,
    of which B*T are consumed: the last (the last target) is the next batch's first token too."""
    packer = ConcatPacker()
    tracker.restore(packer)
    source = _Source(token_batches, tracker.stream, position)
    while True:
        tokens = np.empty(B * T + 1, dtype=tracker.encoder.dtype)  # +1: the last target
        packer.take(tokens, source)
        yield tokens, tracker.state(packer, source, tokens), packer.stats(), {"trace": None, "masked": ()}


# -----------------------------------------------------------------------------
# Running a stage ahead on a background thread


class _Prefetcher:
    """Runs an iterator on a daemon thread, up to `depth` items ahead.
    An exception in the thread is raised by the consumer's next `next()` (and every one after).

    `close()` stops it: the thread asks its source for nothing more and ends, closing the source from
    inside; a call already running there (one tokenizer call, one row group read) is not interrupted,
    and the thread ends when it returns. From then on `next()` raises StopIteration, even for items
    already made. A prefetcher started on another's thread (the packing stage starts the reading and
    tokenizing stages) stops with it, so a whole pipeline stops at once; its waits are woken at once."""

    def __init__(self, source, depth: int, name: str):
        self._source = source
        self._depth = depth
        self._items: deque = deque()  # (ok, item) made ahead: at most depth
        self._changed = threading.Condition()  # notified when an item is put or taken, and on close
        self._stop = threading.Event()
        self._parent = getattr(_running, "prefetcher", None)  # the prefetcher whose thread started this one
        self._children: list[_Prefetcher] = []
        if self._parent is not None:
            self._parent._children.append(self)
        self._error: BaseException | None = None
        self.wait_seconds = 0.0  # time the consumer spent blocked in next(): the stall it felt
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _PREFETCHERS.add(self)
        self._thread.start()

    def stopping(self) -> bool:
        return self._stop.is_set() or (self._parent is not None and self._parent.stopping())

    def _put(self, entry) -> bool:
        """Hand (ok, item) to the consumer, waiting while `depth` are waiting; False (dropped) once stopping."""
        with self._changed:
            while len(self._items) >= self._depth and not self.stopping():
                self._changed.wait(0.1)  # (woken when the consumer takes one, or on close)
            if self.stopping():
                return False
            self._items.append(entry)
            self._changed.notify_all()
            return True

    def _run(self) -> None:
        _running.prefetcher = self
        try:
            items = iter(self._source)
            while not self.stopping():  # checked before every pull: a pull may start a long call
                try:
                    item = next(items)
                except StopIteration:
                    self._put((False, StopIteration()))
                    return
                self._put((True, item))
        except BaseException as e:  # hand every failure to the consumer, never die silently
            self._put((False, e))
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        ok, item = self._get()
        self.wait_seconds += time.perf_counter() - t0
        if ok:
            return item
        self._error = item
        raise item

    def _get(self) -> tuple[bool, object]:
        """The thread's next (ok, item), or (False, StopIteration()) once stopping (dropping what was made)."""
        with self._changed:
            while not self._items and not self.stopping() and self._thread.is_alive():
                self._changed.wait(0.1)  # (woken when the thread puts one, or on close)
            if self.stopping():
                return False, StopIteration()
            if not self._items:  # (never: the thread ends with a last entry unless stopping)
                return False, RuntimeError(f"{self._thread.name} ended without a result")
            entry = self._items.popleft()
            self._changed.notify_all()
            return entry

    def _wake(self) -> None:
        """Wake whoever waits on this prefetcher or on those it started, so that they see it stopping."""
        with self._changed:
            self._changed.notify_all()
        for child in self._children:
            child._wake()

    def close(self, timeout: float = 0.5) -> None:
        """Stop the thread and wait for it at most `timeout` seconds (it ends when its current call does)."""
        self._stop.set()
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


_running = threading.local()  # .prefetcher: the prefetcher whose thread this is
_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()  # every prefetcher (a running thread keeps its own alive)
EXIT_TIMEOUT = 5.0  # seconds the interpreter's exit waits, in all, for background calls still running


@atexit.register
def _stop_threads_at_exit() -> None:
    """Stop every loader's threads when the interpreter exits (a script that never closes its loader,
    or ends right after closing it), and wait for the calls they are in to return, at most EXIT_TIMEOUT
    seconds in all: a daemon thread still inside a C++ call (pyarrow, torch, the tokenizer) when the
    interpreter finalizes aborts the process with 'terminate called without an active exception'."""
    prefetchers = list(_PREFETCHERS)
    for prefetcher in prefetchers:
        prefetcher.close(timeout=0)
    deadline = time.monotonic() + EXIT_TIMEOUT
    for prefetcher in prefetchers:
        prefetcher._thread.join(max(0.0, deadline - time.monotonic()))
    running = [p._thread.name for p in prefetchers if p._thread.is_alive()]
    if running:
        logger.warning("exiting with loader threads still inside a call after %ss: %s", EXIT_TIMEOUT, running)


def _maybe_prefetch(source, depth: int, name: str):
    return _Prefetcher(source, depth, name) if depth > 0 else source


def _pipeline(doc_batches, encoder, prefetch: int, pack, tokenizing: bool = True):
    """Reading, tokenizing and packing, each on its own thread when prefetch > 0: reading runs a few
    row groups ahead of the tokenizer (so its pool never waits on parquet), tokenizing `prefetch`
    document batches ahead of packing. Yields what `pack(token_batches)` yields. Without a tokenizer
    (pretokenized shards) reading is a slice of a memory map: it stays on the packing thread, since
    handing each batch between threads would cost more than the work."""
    depth = prefetch if tokenizing else 0
    stages = []  # a prefetcher closes its source itself, on its thread (which may still be running it)
    try:
        stages.append(_maybe_prefetch(doc_batches, 4 * depth, "nanochat-read"))
        overlap_calls = depth > 0 and getattr(encoder, "thread_safe", False)
        stages.append(_maybe_prefetch(_token_batches(stages[-1], encoder, overlap_calls), depth, "nanochat-tokenize"))
        yield from pack(stages[-1])
    finally:
        for stage in reversed(stages):  # downstream first: it may be waiting on the one before
            stage.close()


# -----------------------------------------------------------------------------
# Stage 4: transfer to the device


class _DeviceBatches:
    """Copies packed batches to the device through preallocated `[inputs | targets]` buffers.

    On CUDA: two pinned host staging buffers used alternately, one device buffer, exactly one
    non-blocking host-to-device copy per batch. Before a staging buffer is rewritten we wait on the
    event recorded after the copy that last read it (two batches ago), so an in-flight copy never
    reads half-written data. On CPU the staging buffer is the yielded memory; on other devices
    (MPS) nothing is pinned and one blocking copy lands the batch.
    """

    def __init__(self, B: int, T: int, device):
        self.B, self.T = B, T
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA GPU is available; pass device='cpu'")
        n = 2 * B * T
        num_staging = 2 if self.cuda else 1
        self.staging = [torch.empty(n, dtype=torch.long, pin_memory=self.cuda) for _ in range(num_staging)]
        self.copied: list = [None] * num_staging  # CUDA events: copy from staging[i] finished
        if self.device.type == "cpu":
            self.buffer = self.staging[0]
        else:
            self.buffer = torch.empty(n, dtype=torch.long, device=self.device)
        self.count = 0

    def __call__(self, inputs: np.ndarray, targets: np.ndarray, masked=()) -> tuple[torch.Tensor, torch.Tensor]:
        BT = self.B * self.T
        i = self.count % len(self.staging)
        self.count += 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        host = self.staging[i].numpy()
        np.copyto(host[:BT].reshape(self.B, self.T), inputs)
        host_targets = host[BT:].reshape(self.B, self.T)
        np.copyto(host_targets, targets)
        for r, start, end in masked:  # targets that predict a window's repeated tokens: trained once
            host_targets[r, start:end] = IGNORE_INDEX
        if self.buffer is not self.staging[i]:
            self.buffer.copy_(self.staging[i], non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
                self.copied[i] = event
        return self.buffer[:BT].view(self.B, self.T), self.buffer[BT:].view(self.B, self.T)


# -----------------------------------------------------------------------------
# The loaders


def _check_options(B, T, split, prefetch, **more) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    _check_positive(B=B, T=T, **{k: v for k, v in more.items() if v is not None})
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0 (0 = no background threads), got {prefetch!r}")


def _start_stream(reader, rank, world_size, batch_size, state, config, allow_state_mismatch, epochs=None,
                  where: str = "resume_state_dict"):
    """The stream a loader starts from: fresh, or resumed from a state (version 2: exactly; the seeds'
    form, or another stream accepted with allow_state_mismatch: after the saved unit, as nanochat).
    where: what messages call the state. Returns (stream, version-2 start state or None, seeds position)."""
    paths = reader.paths
    if state is None:
        return _Stream(reader, rank, world_size, batch_size, epochs=epochs), None, (0, 0, 1)
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
    if "merged" in state:  # elastic resume: every rank gets the merge, and takes its own part
        state, where = resume.rank_state(state, rank, world_size, where)
    if "version" not in state and state.keys() & set(resume.REQUIRED) - set(SEEDS_KEYS):
        raise ValueError(f"{where} is missing 'version' but has this loader's other keys "
                         f"({sorted(state.keys() & set(resume.REQUIRED))}): a truncated state?")
    if "version" in state and resume.check_state(state, config, reader.index, allow_mismatch=allow_state_mismatch,
                                                 where=where):
        plan = resume.decode_plan(state["plan"], reader.index)
        stream = _Stream(reader, rank, world_size, batch_size, plan, tuple(state["next"]), epochs=epochs, where=where)
        return stream, state, (state["pq_idx"], state["rg_idx"], state["epoch"])
    if "version" in state and allow_state_mismatch:  # (another rank's state has said so already)
        logger.warning("%s is from another document stream; resuming approximately after its file %s, %s %s",
                       where, state.get("pq_idx"), reader.unit_name, state.get("rg_idx"))
    # the seeds' form: approximate, after the saved unit
    pq_idx, rg_idx, epoch = _check_legacy_state(state, paths, reader, where)
    cursor = (epoch, pq_idx, (rg_idx // world_size + 1) * world_size + rank, 0)
    return _Stream(reader, rank, world_size, batch_size, start=cursor, epochs=epochs), None, (pq_idx, rg_idx, epoch)


def _setup(kind, tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict,
           data_dir, rank, world_size, prefetch, allow_state_mismatch, buffer_size=None, policy=None):
    """Validate everything up front (so bad input fails at the call, not deep in a thread), then
    build the document stream and the state tracker, resuming if asked.
    Returns (document batches, tracker, seeds position)."""
    _check_options(B, T, split, prefetch, tokenizer_threads=tokenizer_threads,
                   tokenizer_batch_size=tokenizer_batch_size, buffer_size=buffer_size)
    if buffer_size is None and kind == "bestfit":
        raise ValueError("buffer_size must be an integer >= 1")
    if policy is not None:
        check_long_doc_policy(*policy, T)
    for method in ("get_bos_token_id", "encode"):
        if not callable(getattr(tokenizer, method, None)):
            raise TypeError(f"tokenizer must have a {method}() method, got {type(tokenizer).__name__}")
    rank, world_size = _resolve_rank(rank, world_size)
    reader = _ParquetReader(split_parquet_files(split, data_dir))
    encoder = _Encoder(tokenizer, tokenizer_threads)
    config = {"loader": kind, "source": "parquet", "split": split, "files": resume.files_fingerprint(reader.paths),
              "num_files": len(reader.paths), "B": B, "T": T, "buffer_size": buffer_size,
              "tokenizer_batch_size": tokenizer_batch_size, "tokenizer": resume.tokenizer_fingerprint(tokenizer),
              "rank": rank, "world_size": world_size}
    if policy is not None:
        config["long_doc_policy"], config["split_overlap"] = policy
    stream, start, position = _start_stream(reader, rank, world_size, tokenizer_batch_size, resume_state_dict,
                                            config, allow_state_mismatch)
    return stream.batches(), _Tracker(kind, stream, encoder, config, start), position


class DataLoader:
    """What the loader functions return: an iterator of (inputs, targets, state_dict) (or of
    (inputs, targets) without state), with `stats` and `close()`.

    Background threads start at the first `next()` and stop on `close()`, on garbage collection,
    or when the loader fails; a failure is raised again by every later `next()`.
    `stats` describes the batches yielded so far (not the read-ahead): tokens tokenized, emitted
    and cropped, crop_share (cropped / (emitted + cropped)), documents per row, buffer occupancy,
    masked targets, and wait_seconds, the time `next()` spent waiting for a batch (the stall a GPU
    would feel). With attention_info, each batch has a fourth element: a dict of doc_ids,
    position_ids and cu_seqlens on the device (see _attention_info).
    """

    def __init__(self, batches, transfer: _DeviceBatches, split_rows, prefetch: int, with_state: bool,
                 attention_info: bool = False):
        self._batches = batches  # generator of (packed, state_dict, stats, extras)
        self._attention_info = attention_info
        self._transfer = transfer
        self._split_rows = split_rows
        self._prefetch = prefetch
        self._with_state = with_state
        self._source = None
        self._closed = False
        self._error: BaseException | None = None
        self._wait_seconds = 0.0
        self.stats: dict = {}
        # with trace_documents=True: per row of the last batch, the (epoch, pq_idx, rg_idx, row) of
        # every document placed in it, in order (a debugging aid: which documents did a step see?)
        self.documents: list | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        if self._closed:
            raise StopIteration  # as a closed generator: nothing comes out after close()
        if self._source is None:
            self._source = _maybe_prefetch(self._batches, self._prefetch, "nanochat-packing")
        t0 = time.perf_counter()
        try:
            packed, state_dict, stats, extras = next(self._source)
            self._check(extras)
        except BaseException as e:
            self._error = e
            self.close()
            raise
        self._wait_seconds += time.perf_counter() - t0
        self.documents = extras["trace"]
        inputs, targets = self._transfer(*self._split_rows(packed), extras["masked"])
        self.stats = stats | {"wait_seconds": self._wait_seconds}
        out = (inputs, targets, state_dict) if self._with_state else (inputs, targets)
        if self._attention_info:
            device = self._transfer.device
            out += ({k: torch.from_numpy(v).to(device) for k, v in extras["info"].items()},)
        return out

    def _check(self, extras: dict) -> None:
        """Called with every batch before it is yielded; raising stops the loader (see the mixture loader)."""

    def close(self) -> None:
        """Stop the background threads and end the iteration: every later next() raises StopIteration,
        as for a closed generator (a batch already prepared is dropped), or the failure that stopped the
        loader. Idempotent; returns within a second: a thread inside a long call (one tokenizer call)
        ends when that call returns, and starts no other."""
        self._closed = True
        source = self._source if self._source is not None else getattr(self, "_batches", None)
        if source is not None:
            source.close()

    def __del__(self):
        self.close()


def tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, buffer_size: int = 1000, *,
        data_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        trace_documents: bool = False, attention_info: bool = False, max_docs_per_row: int | None = None,
        long_doc_policy: str = "crop", split_overlap: int = 0) -> DataLoader:
    """Yield (inputs, targets, state_dict) forever: (B, T) int64 batches of BOS-aligned best-fit rows.

    tokenizer: anything with get_bos_token_id() and encode(list_of_str, prepend=bos, num_threads=n)
    returning lists of ints (get_vocab_size(), when present, picks 2-byte storage; encode_to_arrays(),
    when present, is used instead of encode and returns numpy arrays: nanochat's tokenizer has it).
    buffer_size: documents kept to choose from (larger packs better, costs memory and start-up).
    data_dir: read shards from here instead of the dataset directory.
    rank/world_size: default to torchrun's RANK/WORLD_SIZE.
    prefetch: batches prepared ahead on background threads (0 runs everything in the caller).
    attention_info: also yield, per batch, a dict of doc_ids, position_ids and cu_seqlens (padded to
    B * max_docs_per_row + 1; default bound T, a row with more documents is an error).
    long_doc_policy: what to do with tokens that do not fit a row. "crop" (the seeds'): discard them
    (about a third of all tokens at T=2048 on FineWeb). "split": cut documents longer than a row
    into pieces that each start with BOS and are packed like documents; later pieces repeat the
    split_overlap tokens before them, with those targets set to -100. "split_reuse": also put the
    cropped rest of a row's last document back into the buffer as a piece; nothing is discarded.
    Every row starts with BOS under every policy; the bench prints each policy's waste.
    """
    doc_batches, tracker, position = _setup(
        "bestfit", tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict, data_dir,
        rank, world_size, prefetch, allow_state_mismatch, buffer_size=buffer_size,
        policy=(long_doc_policy, split_overlap))
    max_docs = _max_docs(attention_info, max_docs_per_row, T)
    batches = _pipeline(doc_batches, tracker.encoder, prefetch, lambda tokens: _bestfit_batches(
        tokens, tracker, position, B, T, buffer_size, trace_documents, max_docs))
    return DataLoader(batches, _DeviceBatches(B, T, device), _row_split, prefetch, with_state, attention_info)


def _row_split(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rows[:, :-1], rows[:, 1:]


def _max_docs(attention_info: bool, max_docs_per_row: int | None, T: int) -> int | None:
    if not attention_info:
        return None
    if max_docs_per_row is None:
        return T  # every document has at least its BOS in the inputs: never more than T per row
    _check_positive(max_docs_per_row=max_docs_per_row)
    return max_docs_per_row


def tokenizing_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


def tokenizing_distributed_data_loader_with_state(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, *, data_dir: str | None = None,
        rank: int | None = None, world_size: int | None = None, prefetch: int = 4,
        with_state: bool = True, allow_state_mismatch: bool = False) -> DataLoader:
    """The older concatenating loader: documents back to back (each after its BOS), each batch the
    next B*T+1 tokens of the stream (inputs the first B*T, targets the last B*T), advancing by B*T: the
    last target of a batch is the first input of the next, and no token is skipped. Wastes nothing,
    but rows start mid-document and attend across unrelated documents; for small data or very long
    documents. Yields (inputs, targets, state_dict).

    stats: tokens_emitted counts tokens consumed, B*T per batch (each token of the stream once, as an
    input); buffer_tokens those tokenized and not yet consumed (a batch's last target among them), so
    tokens_tokenized == tokens_emitted + buffer_tokens. The state's emitted["tokens"] counts the
    B*T+1 tokens of every batch that its hash covers."""
    doc_batches, tracker, position = _setup(
        "concat", tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict, data_dir,
        rank, world_size, prefetch, allow_state_mismatch)
    batches = _pipeline(doc_batches, tracker.encoder, prefetch,
                        lambda tokens: _concat_batches(tokens, tracker, position, B, T, False))
    return DataLoader(batches, _DeviceBatches(B, T, device),
                      lambda flat: (flat[:-1].reshape(B, T), flat[1:].reshape(B, T)), prefetch, with_state)


def tokenizing_distributed_data_loader(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state(*args, with_state=False, **kwargs)


# -----------------------------------------------------------------------------
# The pretokenized loader: .bin/.idx token shards (nanochat/pretokenize.py), no tokenizer in the loop


_WARNED_NO_VOCAB: set = set()  # directories warned about once already


def _shard_vocab(first_path: str, bos_token, vocab_size, settings_dirs: list[str]) -> tuple[int, int | None, str]:
    """(bos_token, vocab_size or None, where vocab_size comes from), checked up front. The vocabulary
    comes from the vocab_size argument and from pretokenize.json in settings_dirs, which must all agree;
    bos_token (default: the first token of the first shard) must be an id in it, and one that the first
    shard's dtype can hold. With no vocabulary known, ids are bounded only by the shards' dtype (a
    warning, once per directory)."""
    from nanochat.pretokenize import META_FILENAME, TokenShard, recorded_vocab_size
    known = []
    if vocab_size is not None:
        _check_positive(vocab_size=vocab_size)
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
    _check_bos_fits(bos_token, first)
    directory = os.path.dirname(os.path.abspath(first_path))
    if vocab_size is None and directory not in _WARNED_NO_VOCAB:
        _WARNED_NO_VOCAB.add(directory)
        logger.warning("no vocabulary size for the shards in %s (no pretokenize.json with vocab_size next to "
                       "them, no vocab_size argument): their token ids are checked only against their dtype "
                       "(%s); pass vocab_size to catch a damaged shard before the model sees its ids",
                       directory, first.dtype.name)
    return bos_token, vocab_size, where


def _check_bos_fits(bos_token: int, shard) -> None:
    if bos_token > np.iinfo(shard.dtype).max:
        raise ValueError(f"bos_token is {bos_token}, which the {shard.dtype.name} ids of {shard.bin_path} cannot "
                         "hold, so it is not these shards' BOS; pass the BOS id of the tokenizer that wrote them")


def _check_ids(shard, start: int, stop: int, vocab_size: int, where: str) -> None:
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


class _ShardReader:
    """The stream's view of pretokenized shards: units are chunks of `chunk_size` entries (the DDP
    sharding deals chunks out as the parquet loader deals row groups), items are (tokens, overlap),
    the tokens a view into the memory-mapped .bin: shards larger than RAM stream in constant memory.
    vocab is _shard_vocab's result: each chunk's ids are checked against it as the chunk is read."""

    unit_name = "chunk"

    def __init__(self, paths: list[str], chunk_size: int, vocab: tuple[int, int | None, str]):
        self.paths, self.chunk_size = paths, chunk_size
        self.bos_token, self.vocab_size, self.vocab_where = vocab
        self.index = RowGroupIndex(paths, chunk_size)
        self._open: tuple = (None, None)  # one shard mapped at a time: thousands would exhaust file handles

    def shard(self, pq_idx: int):
        from nanochat.pretokenize import TokenShard
        if self._open[0] != pq_idx:
            shard = TokenShard(self.paths[pq_idx])
            _check_bos_fits(self.bos_token, shard)
            self._open = (pq_idx, shard)
        return self._open[1]

    def read(self, pq_idx: int, rg_idx: int):
        shard = self.shard(pq_idx)
        start = rg_idx * self.chunk_size
        stop = min(start + self.chunk_size, len(shard))
        if self.vocab_size is not None:  # (else the dtype bounds the ids, by construction)
            _check_ids(shard, start, stop, self.vocab_size, self.vocab_where)
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


class _ShardDocs:
    """(tokens, overlap) items -> documents that start with BOS (GPT-Simple's EOD-terminated entries
    get one prepended) and their overlaps. Rows are uint32: shards may mix uint16 and uint32."""

    dtype = np.dtype(np.uint32)

    def __init__(self, bos: int):
        self.bos = bos

    def __call__(self, items: list) -> tuple[list[np.ndarray], list[int]]:
        docs = [tokens if len(tokens) and tokens[0] == self.bos else np.concatenate(([self.bos], tokens))
                for tokens, _ in items]
        return docs, [overlap for _, overlap in items]


def pretokenized_distributed_data_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str, bos_token: int | None = None, chunk_size: int = 1024,
        batch_size: int = 128, rank: int | None = None, world_size: int | None = None, prefetch: int = 4,
        with_state: bool = True, allow_state_mismatch: bool = False, trace_documents: bool = False,
        attention_info: bool = False, max_docs_per_row: int | None = None, long_doc_policy: str = "crop",
        split_overlap: int = 0, vocab_size: int | None = None) -> DataLoader:
    """The best-fit loader over pretokenized shards (`python -m nanochat.pretokenize`): the same
    rows, rules, state and resume (exact and elastic) as the parquet loader, with no tokenizer.

    data_dir: the pretokenize output, holding train/ and val/ with .bin/.idx pairs.
    bos_token: the id every document starts with (default: the first token of the first entry, which
    is BOS in shards our writer made; for GPT-Simple's EOD-terminated shards, pass the EOD id and it is
    prepended to each entry). chunk_size: entries per unit dealt to ranks (1024 = the parquet shards'
    row group size, so that with windowing off this yields the parquet loader's batches).
    batch_size: entries added to the buffer per refill (the parquet loader's tokenizer_batch_size).
    Targets that predict a window's overlap with the previous window are -100.
    long_doc_policy, split_overlap: as for the parquet loader (windows longer than a row are split).
    vocab_size: the tokenizer's vocabulary size (default: what data_dir/pretokenize.json records; when
    both are given they must agree). Every id read is checked to be below it, a chunk at a time, so a
    damaged shard is a ValueError naming the shard and entry, not a device-side assert in the
    embedding. With neither, a warning, and ids are only bounded by the shards' dtype.
    """
    from nanochat.pretokenize import list_token_shards
    _check_options(B, T, split, prefetch, buffer_size=buffer_size, chunk_size=chunk_size, batch_size=batch_size)
    check_long_doc_policy(long_doc_policy, split_overlap, T)
    rank, world_size = _resolve_rank(rank, world_size)
    split_dir = os.path.join(data_dir, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"{split_dir} does not exist; pretokenize shards first: "
                                f"python -m nanochat.pretokenize --input <parquet dir> --output {data_dir}")
    paths = [prefix + ".bin" for prefix in list_token_shards(split_dir)]
    if not paths:
        raise FileNotFoundError(f"no .bin/.idx pairs in {split_dir}; pretokenize shards first: "
                                f"python -m nanochat.pretokenize --input <parquet dir> --output {data_dir}")
    vocab = _shard_vocab(paths[0], bos_token, vocab_size, [data_dir])
    bos_token = vocab[0]
    reader = _ShardReader(paths, chunk_size, vocab)
    encoder = _ShardDocs(bos_token)
    config = {"loader": "bestfit", "source": "pretokenized", "split": split, "files": resume.files_fingerprint(paths),
              "num_files": len(paths), "chunk_size": chunk_size, "B": B, "T": T, "buffer_size": buffer_size,
              "tokenizer_batch_size": batch_size, "tokenizer": f"bos:{bos_token}", "rank": rank,
              "world_size": world_size, "long_doc_policy": long_doc_policy, "split_overlap": split_overlap}
    stream, start, position = _start_stream(reader, rank, world_size, batch_size, resume_state_dict, config,
                                            allow_state_mismatch)
    tracker = _Tracker("bestfit", stream, encoder, config, start)
    max_docs = _max_docs(attention_info, max_docs_per_row, T)
    batches = _pipeline(stream.batches(), encoder, prefetch, lambda tokens: _bestfit_batches(
        tokens, tracker, position, B, T, buffer_size, trace_documents, max_docs), tokenizing=False)
    return DataLoader(batches, _DeviceBatches(B, T, device), _row_split, prefetch, with_state, attention_info)


def pretokenized_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_distributed_data_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)
