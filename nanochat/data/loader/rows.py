"""
Tokens to packed rows: the stage between the walk's document batches and the device.
Texts are
tokenized into numpy documents that start with BOS (2 bytes a token up to 65,536 ids); the pure
packers of nanochat/data/base/packing.py fill best-fit BOS-aligned rows (or cut the documents,
concatenated, into rows), and the StateRecorder of nanochat/data/base/state.py builds the state of
each batch (what it consumed, never what was read ahead). A resumed packer's buffer is read and
tokenized again here. Pretokenized entries skip the tokenizer: EntryDocuments only prepends BOS
where needed.

May import: numpy, nanochat.data.base.packing, nanochat.data.base.state, nanochat.data.loader.order.
"""

import itertools
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from nanochat.data.base.packing import BestFitPacker, ConcatPacker, Piece, token_dtype
from nanochat.data.base.state import PieceKey, Position, Progress, StateRecorder
from nanochat.data.loader.order import RankOrder


# -----------------------------------------------------------------------------
# Texts to documents

def token_batches(doc_batches, encoder, overlap_calls: bool = False):
    """Yield a TokenBatch for each DocBatch: the texts tokenized with BOS prepended (or, for
    pretokenized shards, the entries as they are).

    overlap_calls: start the next batch's encode call before this one returns, so the tokenizer's
    thread pool does not idle on the tail of each call (its last, longest documents). Only for a
    tokenizer that returns arrays and may be called from two threads at once (ours)."""
    if not overlap_calls:
        for batch in doc_batches:
            yield TokenBatch(*encoder(batch.items), batch.keys, batch.after, batch.starts)
        return
    # 2 workers: the call whose result is awaited and the next, already running
    with ThreadPoolExecutor(2, thread_name_prefix="nanochat-encode-call") as calls:
        pending: deque = deque()
        for batch in doc_batches:
            pending.append((calls.submit(encoder, batch.items), batch))
            if len(pending) == 2:  # the newer call keeps running while this batch goes on
                future, done = pending.popleft()
                yield TokenBatch(*future.result(), done.keys, done.after, done.starts)
        while pending:
            future, done = pending.popleft()
            yield TokenBatch(*future.result(), done.keys, done.after, done.starts)


class TokenBatch(NamedTuple):
    """A DocBatch tokenized: its documents (numpy, BOS first) and what goes with them."""
    docs: list  # numpy arrays of token ids, each starting with BOS
    overlaps: list[int]  # per document: leading tokens a window repeats from the one before
    keys: list  # as the DocBatch's
    after: object  # as the DocBatch's: where the walk goes on after this batch
    starts: tuple | None  # as the DocBatch's: a plan's pieces


class Encoder:
    """texts -> checked numpy documents, BOS first, in the narrowest dtype the vocabulary allows."""

    def __init__(self, tokenizer, tokenizer_threads: int):
        self.bos = tokenizer.get_bos_token_id()
        # a duck-typed tokenizer may not say its vocabulary: token_dtype then picks uint32
        vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
        self.dtype = token_dtype(vocab_size)
        # a tokenizer that can return numpy arrays (ours can) skips building a Python int per
        # token; ours may also be called from two threads at once (its thread pool is shared and
        # locked). One that returns lists is called one batch at a time, even where two calls
        # would be safe (nanochat's RustBPETokenizer): tiktoken starts a thread pool per call, and
        # two calls at once took 10-30% more CPU per token and lowered the loader's throughput
        # (0.69-0.86 of the tokenizer alone, against 0.86-0.93 one at a time, on 2 cores)
        self.encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
        self.thread_safe = hasattr(tokenizer, "encode_to_arrays")
        self.threads = tokenizer_threads

    def __call__(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        """(documents, overlaps): whole documents repeat nothing."""
        docs = to_documents(self.encode(texts, prepend=self.bos, num_threads=self.threads),
                            self.bos, self.dtype)
        return docs, [0] * len(docs)


# A tokenizer that returns lists (nanochat's, any duck-typed one) costs the loader a conversion
# per token: struct packs a document's Python ints into the storage dtype in one C loop, ~14 ns a
# token inside the loader against ~33 for np.asarray to int64, a min/max and astype, and refuses,
# with struct.error, an id that is not an int (a float, a str) or does not fit the dtype
_FORMATS = {np.dtype(np.uint16): "H", np.dtype(np.uint32): "I"}
# native struct sizes: packed bytes are read back as the dtype, so "H" must be 2 bytes and "I" 4
assert all(struct.calcsize(code) == dtype.itemsize for dtype, code in _FORMATS.items())


def to_documents(token_lists, bos: int, dtype: np.dtype) -> list[np.ndarray]:
    """Check the tokenizer's output and store each document compactly."""
    if not isinstance(token_lists, (list, tuple)):
        raise TypeError("tokenizer.encode must return a list of token-id lists, got "
                        f"{type(token_lists).__name__}")
    limit = np.iinfo(dtype).max
    docs = []
    for ids in token_lists:
        if (isinstance(ids, np.ndarray) and ids.dtype == dtype and ids.ndim == 1 and ids.size
                and ids[0] == bos):
            docs.append(ids)  # already compact (encode_to_arrays): every value fits by its dtype
            continue
        if isinstance(ids, (list, tuple)):
            arr = _list_to_array(ids, dtype, limit)
        elif isinstance(ids, np.ndarray):
            # (an empty array may have any dtype: numpy makes float64 of an empty list)
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise TypeError("tokenizer.encode must return lists of ints, got an array of "
                                f"{ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() > limit):
                raise _out_of_range(dtype, limit)
            arr = ids.astype(dtype)
        else:
            raise TypeError("tokenizer.encode must return lists of ints, got an element of type "
                            f"{type(ids).__name__}")
        if arr.size == 0 or arr[0] != bos:
            raise ValueError("tokenizer.encode(texts, prepend=bos) returned a document that does "
                             f"not start with the BOS token {bos}; every document must start with "
                             "BOS")
        docs.append(arr)
    return docs


def _list_to_array(ids, dtype: np.dtype, limit: int) -> np.ndarray:
    try:
        packed = struct.Struct(f"{len(ids)}{_FORMATS[dtype]}").pack(*ids)
    except (struct.error, OverflowError, TypeError):
        # struct says only that packing failed: a wrong type is a TypeError, a bad id a ValueError
        bad = next((type(i).__name__ for i in ids if not isinstance(i, (int, np.integer))), None)
        if bad is not None:
            raise TypeError("tokenizer.encode must return lists of ints, got a list holding "
                            f"{bad}") from None
        raise _out_of_range(dtype, limit) from None
    # copy: frombuffer's array is read-only and borrows `packed`; astype's (above) owns its memory
    return np.frombuffer(packed, dtype=dtype).copy()


def _out_of_range(dtype: np.dtype, limit: int) -> ValueError:
    return ValueError(f"token id out of range [0, {limit}] for {dtype} storage: "
                      "tokenizer.get_vocab_size() is smaller than the ids it produces")


class EntryDocuments:
    """(tokens, overlap) items -> documents that start with BOS (GPT-Simple's EOD-terminated entries
    get one prepended) and their overlaps. Rows are uint32: shards may mix uint16 and uint32.
    always: prepend BOS to every entry, also to one that starts with that id: for shards known to be
    in GPT-Simple's convention, whose EOD is our BOS id, so an entry that is a lone EOD (an empty
    document, or the last window of one) still trains its EOD."""

    dtype = np.dtype(np.uint32)

    def __init__(self, bos: int, always: bool = False):
        self.bos = bos
        self.always = always

    def __call__(self, items: list) -> tuple[list[np.ndarray], list[int]]:
        # an entry that starts with BOS is used as it is: a view into the shard, no copy
        docs = [tokens if not self.always and len(tokens) and tokens[0] == self.bos
                else np.concatenate(([self.bos], tokens)) for tokens, _ in items]
        return docs, [overlap for _, overlap in items]


# -----------------------------------------------------------------------------
# Documents to rows, with the state of each batch


def bestfit_batches(token_batches, recorder: StateRecorder, position: Position, *, B: int, T: int,
                    buffer_size: int, trace: bool = False, max_docs_per_row: int | None = None):
    """Yield a RowBatch of (B, T+1) rows packed best-fit, a fresh array each batch (trace: where
    each row's documents came from; max_docs_per_row: the attention outputs' bound, None: none)."""
    # T + 1 so that inputs and targets can both be sliced from one row
    packer = BestFitPacker(T + 1, recorder.config["long_doc_policy"],
                           recorder.config["split_overlap"])
    restore_buffer(recorder, packer)
    feed = DocumentFeed(token_batches, recorder.order, position)
    while True:
        # fresh each batch: the ones before may still wait in the prefetch queue; the storage
        # dtype (2 bytes a token up to 65,536 ids), which the transfer widens to int64
        rows = np.empty((B, T + 1), dtype=recorder.encoder.dtype)
        packer.trace = [] if trace else None
        packer.fill(rows, feed, buffer_size)
        documents = None
        if trace:  # where a document is (a DocKey), or a PieceKey for a piece of a split one
            place = recorder.order.place
            documents = [[place(key) if start is None else PieceKey(*place(key), start)
                          for key, start in row] for row in packer.trace]
        info = None if max_docs_per_row is None else attention_info(packer.starts, T,
                                                                    max_docs_per_row)
        state = recorder.state(packer, feed.progress(), rows)
        yield RowBatch(rows, state, packer.stats(), documents, packer.masked, info)


def concat_batches(token_batches, recorder: StateRecorder, position: Position, B: int, T: int):
    """Yield a RowBatch of the next B*T+1 tokens of the documents, concatenated, of which B*T
    are consumed: the last (the last target) is the next batch's first token too."""
    packer = ConcatPacker()
    restore_buffer(recorder, packer)
    feed = DocumentFeed(token_batches, recorder.order, position)
    while True:
        tokens = np.empty(B * T + 1, dtype=recorder.encoder.dtype)  # +1: the last target
        packer.take(tokens, feed)
        yield RowBatch(tokens, recorder.state(packer, feed.progress(), tokens), packer.stats())


def restore_buffer(recorder: StateRecorder, packer) -> None:
    """Refill a packer from the recorder's resumed state: the buffered documents read and tokenized
    again (each once, however many of its pieces are buffered), the buffer rebuilt in arrival
    order, the counters restored."""
    if not recorder.resumed:
        return
    keys, _ = recorder.buffered()
    unique = list(dict.fromkeys(keys))  # a split document may be buffered as several pieces
    items = recorder.order.read_documents(unique, f"{recorder.state_name}['buffer']")
    documents = {}
    for i in range(0, len(items), 1024):  # 1,024 at a time: one tokenizer call stays small
        docs, overlaps = recorder.encoder(items[i:i + 1024])
        documents.update(zip(unique[i:i + 1024], zip(docs, overlaps)))
    recorder.restore(packer, documents)


class DocumentFeed:
    """Hands a packer the next batch's documents as Pieces, and remembers where the walk stands
    after the last batch pulled (what a state must describe: consumed, not read ahead)."""

    def __init__(self, token_batches, order: RankOrder, position: Position):
        self.token_batches = token_batches
        self.order = order
        self.after = order.first_position
        self.position = position  # nanochat's keys of the last batch pulled
        self.state_name = order.state_name

    def progress(self) -> Progress:
        """What the state after the last batch pulled records of the walk."""
        return self.order.progress(self.after, self.position)

    def __call__(self):
        batch = next(self.token_batches)
        self.after = batch.after
        # nanochat's keys name the unit of the batch's last document (a shuffled key, its place)
        last = self.order.place(batch.keys[-1])
        self.position = Position(last.pq_idx, last.rg_idx, last.epoch)
        if batch.starts is None:  # every document whole (start None), made as the packer pulls
            return map(Piece._make, zip(batch.docs, batch.keys, batch.overlaps,
                                        itertools.repeat(None)))
        # an elastic plan may deal single pieces of split documents
        for doc, key, start in zip(batch.docs, batch.keys, batch.starts):
            if start is not None and start >= len(doc):
                raise ValueError(f"{self.state_name}['plan'] deals document {tuple(key)} from "
                                 f"token {start}, but it has {len(doc)}: the state does not "
                                 "match the data or the tokenizer")
        return [Piece(*piece) for piece in
                zip(batch.docs, batch.keys, batch.overlaps, batch.starts)]


class Stop(NamedTuple):
    """Why a mixture must stop: a bucket ran dry ("bucket"), or the curriculum is done
    ("budget")."""
    kind: str
    bucket: str | None = None  # the bucket that ran dry on this rank; None: every bucket, or none


class RowBatch(NamedTuple):
    """One packed batch on its way to the device, with its state and statistics."""
    rows: np.ndarray | None  # (B, T+1) best-fit rows, or (B*T+1,) concatenated tokens
    state: dict | None  # the state after this batch (what it consumed)
    stats: dict  # the packer's running statistics
    trace: list | None = None  # trace_documents: per row, where each document came from
    masked: list = ()  # (row, start, end): targets to set to -100 (a window's repeated tokens)
    info: dict | None = None  # attention_info's arrays
    stop: Stop | None = None  # a mixture that must stop, and why


def attention_info(starts: list[list[int]], T: int, max_docs_per_row: int) -> dict[str, np.ndarray]:
    """Per-batch outputs for document-aware attention, from where each row's documents start:
    doc_ids (B, T) (0, 1, ... within each row), position_ids (B, T) restarting at every document,
    and cu_seqlens (B * max_docs_per_row + 1,) int32: the document boundaries of the flattened B*T
    inputs for variable-length attention kernels, padded with B*T to a fixed size (a fixed shape
    never makes torch.compile recompile)."""
    B = len(starts)
    marker = np.zeros((B, T), dtype=np.int64)
    bounds = []
    for r, row_starts in enumerate(starts):
        inside = [s for s in row_starts if s < T]  # a document starting at T is only a target
        if len(inside) > max_docs_per_row:
            raise ValueError(f"a row holds {len(inside)} documents, more than max_docs_per_row="
                             f"{max_docs_per_row}; raise max_docs_per_row (the padded size of "
                             "cu_seqlens)")
        marker[r, inside[1:]] = inside[1:]  # the first document's start, 0, is the fill value
        bounds += [r * T + s for s in inside]
    # a running maximum carries each start forward to the end of its document
    segment_start = np.maximum.accumulate(marker, axis=1)
    doc_ids = np.cumsum(marker > 0, axis=1).astype(np.int32)
    position_ids = np.arange(T)[None, :] - segment_start
    cu_seqlens = np.full(B * max_docs_per_row + 1, B * T, dtype=np.int32)
    cu_seqlens[:len(bounds)] = bounds
    return {"doc_ids": doc_ids, "position_ids": position_ids, "cu_seqlens": cu_seqlens}
