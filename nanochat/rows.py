"""
Packed rows: the packing stage between a stream's tokenized documents and the device. It feeds the
pure packers of nanochat/packing.py (best-fit BOS-aligned rows, or the concatenated stream), keeps the
state that goes with each batch (Tracker: what the batch consumed, never what was read ahead), restores
a packer from a state, and builds the per-row attention outputs (doc_ids, position_ids, cu_seqlens).

May import: nanochat.packing, nanochat.state, nanochat.stream.
"""

import itertools

import numpy as np

from nanochat.packing import BestFitPacker, ConcatPacker
from nanochat.state import (EMPTY_HASH, VERSION, Unit, decode_keys, decode_pieces, encode_keys, encode_plan,
                            hash_tokens, seal)
from nanochat.stream import Position, Stream


class Source:
    """Pulls document batches for a packer as (document, key) pairs, and remembers where the stream
    stands after the last batch pulled (what a state must describe: consumed, not read ahead)."""

    def __init__(self, token_batches, stream: Stream, position: Position):
        self.token_batches = token_batches
        self.stream = stream
        self.after = stream.first_position
        self.position = position  # the seeds' keys of the last batch pulled
        self.where = stream.where

    def __call__(self):
        docs, keys, self.after, overlaps = next(self.token_batches)
        epoch, pq_idx, rg_idx, _ = self.stream.place(keys[-1])
        self.position = (pq_idx, rg_idx, epoch)
        if self.after[0] == "plan":  # an elastic plan may deal single pieces of split documents
            for doc, key in zip(docs, keys):
                if len(key) == 5 and key[4] >= len(doc):
                    raise ValueError(f"{self.where}['plan'] deals document {key[:4]} from token {key[4]}, but it has "
                                     f"{len(doc)}: the state does not match the data or the tokenizer")
            return [(doc, key[:4], overlap, key[4] if len(key) == 5 else None)
                    for doc, key, overlap in zip(docs, keys, overlaps)]
        return zip(docs, keys, overlaps, itertools.repeat(None))


class Tracker:
    """Builds the state yielded with each batch, and restores a packer from one."""

    def __init__(self, kind: str, stream: Stream, encoder, config: dict, start: dict | None, watch=None):
        self.kind, self.stream, self.encoder, self.config = kind, stream, encoder, config
        self.watch = watch  # called with each state's buffered keys and the file (epoch, pq_idx) its stream goes on
        # in (a streaming loader keeps what a resume from it reads)
        self.start = start  # a version-2 state that continues this stream, or None
        emitted = start["emitted"] if start else {"batches": 0, "tokens": 0, "hash": EMPTY_HASH}
        self.batches, self.tokens, self.hash = emitted["batches"], emitted["tokens"], emitted["hash"]
        self._plan_cache: tuple = (None, None)

    def restore(self, packer) -> None:
        """Re-read and re-tokenize the buffered documents (each once, however many of its pieces are
        buffered), rebuild the buffer in arrival order, and restore the counters."""
        if not self.start:
            return
        where = self.stream.where
        keys = decode_keys(self.start["buffer"])  # (its size was checked: state.check_fields)
        starts = decode_pieces(self.start.get("pieces", []), len(keys))
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
        # the encoded tail of a long plan changes only when a unit is finished or begun (a shuffled plan lists
        # a begun unit first, the others in file order): cache it
        key = (len(units), units[0][:3], units[0][3] is None)
        if self._plan_cache[0] != key:
            self._plan_cache = (key, encode_plan(units[1:], self.stream.index))
        return encode_plan(units[:1], self.stream.index) + self._plan_cache[1]

    def state(self, packer, source: Source, tokens: np.ndarray) -> dict:
        self.batches += 1
        self.tokens += tokens.size
        self.hash = hash_tokens(self.hash, tokens)
        units, cursor = self.stream.remaining_plan(source.after)
        pq_idx, rg_idx, epoch = source.position
        counters = {name: getattr(packer, name) for name in packer.COUNTERS}
        keys = packer.buffered_keys()
        if self.watch is not None:
            self.watch(keys, (units[0][0], units[0][1]) if units else (cursor[0], cursor[1]))
        return seal({
            "version": VERSION, "loader": self.kind,
            "pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch,
            "plan": self._plan_items(units) if units else [], "next": list(cursor),
            "buffer": encode_keys(keys), "pieces": packer.buffered_pieces(),
            "offset": packer.offset if self.kind == "concat" else 0,
            "config": self.config,
            "emitted": {"batches": self.batches, "tokens": self.tokens, "hash": self.hash},
            "counters": counters,
        })


def attention_info(starts: list[list[int]], T: int, max_docs_per_row: int) -> dict[str, np.ndarray]:
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


def bestfit_batches(token_batches, tracker: Tracker, position: Position, B: int, T: int, buffer_size: int,
                     trace: bool, max_docs_per_row: int | None = None):
    """Yield (rows (B, T+1), state, stats, extras) packed best-fit; rows are a fresh array each batch.
    extras: the trace, the target ranges to mask (window overlaps) and, when max_docs_per_row is set,
    the attention outputs."""
    # T + 1 so that inputs and targets can both be sliced from one row
    packer = BestFitPacker(T + 1, tracker.config["long_doc_policy"], tracker.config["split_overlap"])
    tracker.restore(packer)
    source = Source(token_batches, tracker.stream, position)
    while True:
        rows = np.empty((B, T + 1), dtype=tracker.encoder.dtype)  # token dtype: the transfer widens it
        packer.trace = [] if trace else None
        packer.fill(rows, source, buffer_size)
        extras = {"trace": None, "masked": packer.masked}
        if trace:  # where a document is, or (*where, start) for a piece of a split document
            place = tracker.stream.place
            extras["trace"] = [[place(key) if start is None else (*place(key), start) for key, start in row]
                               for row in packer.trace]
        if max_docs_per_row is not None:
            extras["info"] = attention_info(packer.starts, T, max_docs_per_row)
        yield rows, tracker.state(packer, source, rows), packer.stats(), extras


def concat_batches(token_batches, tracker: Tracker, position: Position, B: int, T: int, trace: bool):
    """Yield (tokens (B*T+1,), state, stats, extras): the next B*T+1 tokens of the concatenated stream,
    of which B*T are consumed: the last (the last target) is the next batch's first token too."""
    packer = ConcatPacker()
    tracker.restore(packer)
    source = Source(token_batches, tracker.stream, position)
    while True:
        tokens = np.empty(B * T + 1, dtype=tracker.encoder.dtype)  # +1: the last target
        packer.take(tokens, source)
        yield tokens, tracker.state(packer, source, tokens), packer.stats(), {"trace": None, "masked": ()}
