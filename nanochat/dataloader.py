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
  3. packing (nanochat/packing.py, pure): best-fit BOS-aligned rows, or the concatenated stream;
  4. transfer: one pinned `[inputs | targets]` staging buffer -> one non-blocking copy to the device.
Stages 1-2 and 3 each run `prefetch` items ahead on a background thread, so reading, tokenizing,
packing and the training step overlap; the state yielded with a batch describes what that batch
consumed, never what was read ahead.

The yielded tensors are views into one device buffer that the next batch overwrites (in stream
order on CUDA, so a training step that has already been queued is safe); clone them to keep them.

`state_dict` = {"pq_idx", "rg_idx", "epoch"}: the parquet file, row group and epoch of the last
document batch the packer consumed. Passing it back as `resume_state_dict` restarts after that row
group; this resume is approximate, as nanochat's: no document repeats, but documents still in the
buffer, and the rest of that row group, are skipped.
"""

import queue
import threading
import time
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from nanochat.common import get_dist_info
from nanochat.dataset import SPLITS, read_row_group_texts, split_parquet_files
from nanochat.packing import BestFitPacker, ConcatPacker, token_dtype

Position = tuple[int, int, int]  # (pq_idx, rg_idx, epoch)

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


def _check_resume_state(state, paths: list[str]) -> Position:
    """Validate a seeds-form state against the split's files; returns (pq_idx, rg_idx, epoch)."""
    if not isinstance(state, dict):
        raise TypeError(f"resume_state_dict must be a dict, got {type(state).__name__}")
    missing = {"pq_idx", "rg_idx"} - state.keys()
    if missing:
        raise ValueError(f"resume_state_dict is missing {sorted(missing)}")
    # "epoch" is optional: the older concatenating loader's states do not carry it
    values = {"pq_idx": state["pq_idx"], "rg_idx": state["rg_idx"], "epoch": state.get("epoch", 1)}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"resume_state_dict[{key!r}] must be an int, got {value!r}")
    pq_idx, rg_idx, epoch = values["pq_idx"], values["rg_idx"], values["epoch"]
    if epoch < 1:
        raise ValueError(f"resume_state_dict['epoch'] must be >= 1 (epochs count from 1), got {epoch}")
    if not 0 <= pq_idx < len(paths):
        raise ValueError(f"resume_state_dict['pq_idx']={pq_idx} points past the data: "
                         f"the split has {len(paths)} file(s)")
    num_row_groups = pq.ParquetFile(paths[pq_idx]).num_row_groups
    if not 0 <= rg_idx < num_row_groups:
        raise ValueError(f"resume_state_dict['rg_idx']={rg_idx} points past the data: "
                         f"{paths[pq_idx]} has {num_row_groups} row group(s)")
    return pq_idx, rg_idx, epoch


# -----------------------------------------------------------------------------
# Stage 1: documents


def _document_batches(paths: list[str], tokenizer_batch_size: int, rank: int, world_size: int,
                      resume: Position | None = None) -> Iterator[tuple[list[str], Position]]:
    """Yield (texts, (pq_idx, rg_idx, epoch)) forever: for each file in order, row groups
    rank, rank + world_size, ..., each cut into slices of tokenizer_batch_size texts."""
    pq_idx, resume_rg_idx, epoch = resume if resume is not None else (0, None, 1)
    while True:  # one epoch per pass
        docs_this_pass = 0
        full_pass = pq_idx == 0 and resume_rg_idx is None
        while pq_idx < len(paths):
            path = paths[pq_idx]
            pf = pq.ParquetFile(path)
            if resume_rg_idx is not None:
                # skip the row group we saved: it was consumed before the checkpoint
                rg_idx = (resume_rg_idx // world_size + 1) * world_size + rank
                resume_rg_idx = None
            else:
                rg_idx = rank
            while rg_idx < pf.num_row_groups:
                texts = read_row_group_texts(pf, rg_idx, path)
                docs_this_pass += len(texts)
                for i in range(0, len(texts), tokenizer_batch_size):
                    yield texts[i:i + tokenizer_batch_size], (pq_idx, rg_idx, epoch)
                rg_idx += world_size
            pq_idx += 1
        if full_pass and docs_this_pass == 0:
            # the reference loops here forever; a rank with nothing to read is a configuration error
            raise ValueError(
                f"rank {rank} of world size {world_size} receives no documents: the split's "
                f"{len(paths)} file(s) have too few (non-empty) row groups for this many ranks "
                f"(row groups are dealt out rank, rank+{world_size}, ...); use fewer ranks or "
                "shards with more, smaller row groups")
        pq_idx, epoch = 0, epoch + 1


# -----------------------------------------------------------------------------
# Stage 2: tokens


def _to_documents(token_lists, bos: int, dtype: np.dtype) -> list[np.ndarray]:
    """Check the tokenizer's output and store each document compactly."""
    if not isinstance(token_lists, (list, tuple)):
        raise TypeError(f"tokenizer.encode must return a list of token-id lists, got {type(token_lists).__name__}")
    limit = np.iinfo(dtype).max
    docs = []
    for ids in token_lists:
        if not isinstance(ids, (list, tuple, np.ndarray)):
            raise TypeError(f"tokenizer.encode must return lists of ints, got an element of type {type(ids).__name__}")
        arr = np.asarray(ids)  # free for arrays
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"tokenizer.encode must return lists of ints, got an array of {arr.dtype}")
        if arr.size == 0 or arr[0] != bos:
            raise ValueError("tokenizer.encode(texts, prepend=bos) returned a document that does not start "
                             f"with the BOS token {bos}; every document must start with BOS")
        if arr.min() < 0 or arr.max() > limit:
            raise ValueError(f"token id out of range [0, {limit}] for {dtype} storage: "
                             "tokenizer.get_vocab_size() is smaller than the ids it produces")
        docs.append(arr.astype(dtype))
    return docs


def _token_batches(doc_batches, tokenizer, tokenizer_threads: int):
    """Yield (documents, position) for each document batch: the texts tokenized with BOS prepended."""
    bos = tokenizer.get_bos_token_id()
    vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
    dtype = token_dtype(vocab_size)
    # a tokenizer that can return numpy arrays (ours can) skips building a Python int per token
    encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
    for texts, position in doc_batches:
        token_lists = encode(texts, prepend=bos, num_threads=tokenizer_threads)
        yield _to_documents(token_lists, bos, dtype), position


# -----------------------------------------------------------------------------
# Stage 3: packing (the pure core is in nanochat/packing.py)


def _state(position: Position) -> dict:
    pq_idx, rg_idx, epoch = position
    return {"pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch}


class _Source:
    """Pulls document batches for a packer and remembers the position of the last one pulled."""

    def __init__(self, token_batches):
        self.token_batches = token_batches
        self.position: Position = (0, 0, 1)

    def __call__(self) -> list[np.ndarray]:
        docs, self.position = next(self.token_batches)
        return docs


def _bestfit_batches(token_batches, B: int, T: int, buffer_size: int):
    """Yield (rows (B, T+1), state, stats) packed best-fit; rows are a fresh array each batch."""
    packer = BestFitPacker(T + 1)  # +1 so that inputs and targets can both be sliced from one row
    source = _Source(token_batches)
    while True:
        rows = np.empty((B, T + 1), dtype=np.int64)
        packer.fill(rows, source, buffer_size)
        yield rows, _state(source.position), packer.stats()


def _concat_batches(token_batches, B: int, T: int):
    """Yield (tokens (B*T+1,), state, stats): the next B*T+1 tokens of the concatenated stream."""
    packer = ConcatPacker()
    source = _Source(token_batches)
    while True:
        tokens = np.empty(B * T + 1, dtype=np.int64)  # +1: the last target
        packer.take(tokens, source)
        yield tokens, _state(source.position), packer.stats()


# -----------------------------------------------------------------------------
# Running a stage ahead on a background thread


class _Prefetcher:
    """Runs an iterator on a daemon thread, up to `depth` items ahead, through a bounded queue.
    An exception in the thread is raised by the consumer's next `next()` (and every one after);
    `close()` stops the thread, and closes the source from inside it."""

    def __init__(self, source, depth: int, name: str):
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.wait_seconds = 0.0  # time the consumer spent blocked in next(): the stall it felt
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put((True, item)):
                    return
            self._put((False, StopIteration()))
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
        ok, item = self._queue.get()
        self.wait_seconds += time.perf_counter() - t0
        if ok:
            return item
        self._error = item
        raise item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def _maybe_prefetch(source, depth: int, name: str):
    return _Prefetcher(source, depth, name) if depth > 0 else source


def _prefetched(token_batches, prefetch: int, pack):
    """The packing stage over a tokenization stage that runs `prefetch` batches ahead on its own thread."""
    tokens = None
    try:
        tokens = _maybe_prefetch(token_batches, prefetch, "nanochat-tokenize")
        yield from pack(tokens)
    finally:
        (tokens if tokens is not None else token_batches).close()


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

    def __call__(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        BT = self.B * self.T
        i = self.count % len(self.staging)
        self.count += 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        host = self.staging[i].numpy()
        np.copyto(host[:BT].reshape(self.B, self.T), inputs)
        np.copyto(host[BT:].reshape(self.B, self.T), targets)
        if self.buffer is not self.staging[i]:
            self.buffer.copy_(self.staging[i], non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
                self.copied[i] = event
        return self.buffer[:BT].view(self.B, self.T), self.buffer[BT:].view(self.B, self.T)


# -----------------------------------------------------------------------------
# The loaders


def _setup(tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict,
           data_dir, rank, world_size, prefetch, **checks):
    """Validate everything up front (so bad input fails at the call, not deep in a thread) and
    build the tokenized document stream."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    _check_positive(B=B, T=T, tokenizer_threads=tokenizer_threads,
                    tokenizer_batch_size=tokenizer_batch_size, **checks)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0 (0 = no background threads), got {prefetch!r}")
    for method in ("get_bos_token_id", "encode"):
        if not callable(getattr(tokenizer, method, None)):
            raise TypeError(f"tokenizer must have a {method}() method, got {type(tokenizer).__name__}")
    rank, world_size = _resolve_rank(rank, world_size)
    paths = split_parquet_files(split, data_dir)
    resume = _check_resume_state(resume_state_dict, paths) if resume_state_dict is not None else None
    doc_batches = _document_batches(paths, tokenizer_batch_size, rank, world_size, resume)
    return _token_batches(doc_batches, tokenizer, tokenizer_threads)


class DataLoader:
    """What the loader functions return: an iterator of (inputs, targets, state_dict) (or of
    (inputs, targets) without state), with `stats` and `close()`.

    Background threads start at the first `next()` and stop on `close()`, on garbage collection,
    or when the loader fails; a failure is raised again by every later `next()`.
    `stats` describes the batches yielded so far (not the read-ahead): tokens tokenized, emitted
    and cropped, crop_share (cropped / (emitted + cropped)), documents per row, buffer occupancy,
    and wait_seconds, the time `next()` spent waiting for a batch (the stall a GPU would feel).
    """

    def __init__(self, batches, transfer: _DeviceBatches, split_rows, prefetch: int, with_state: bool):
        self._batches = batches  # generator of (packed, state_dict, stats)
        self._transfer = transfer
        self._split_rows = split_rows
        self._prefetch = prefetch
        self._with_state = with_state
        self._source = None
        self._error: BaseException | None = None
        self._wait_seconds = 0.0
        self.stats: dict = {}

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        if self._source is None:
            self._source = _maybe_prefetch(self._batches, self._prefetch, "nanochat-packing")
        t0 = time.perf_counter()
        try:
            packed, state_dict, stats = next(self._source)
        except BaseException as e:
            self._error = e
            self.close()
            raise
        self._wait_seconds += time.perf_counter() - t0
        inputs, targets = self._transfer(*self._split_rows(packed))
        self.stats = stats | {"wait_seconds": self._wait_seconds}
        return (inputs, targets, state_dict) if self._with_state else (inputs, targets)

    def close(self) -> None:
        """Stop the background threads (idempotent)."""
        source = self._source if self._source is not None else getattr(self, "_batches", None)
        if source is not None:
            source.close()

    def __del__(self):
        self.close()


def tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, buffer_size: int = 1000, *,
        data_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True) -> DataLoader:
    """Yield (inputs, targets, state_dict) forever: (B, T) int64 batches of BOS-aligned best-fit rows.

    tokenizer: anything with get_bos_token_id() and encode(list_of_str, prepend=bos, num_threads=n)
    returning lists of ints (get_vocab_size(), when present, picks 2-byte storage; encode_to_arrays(),
    when present, is used instead of encode and returns numpy arrays: nanochat's tokenizer has it).
    buffer_size: documents kept to choose from (larger packs better, costs memory and start-up).
    data_dir: read shards from here instead of the dataset directory.
    rank/world_size: default to torchrun's RANK/WORLD_SIZE.
    prefetch: batches prepared ahead on background threads (0 runs everything in the caller).
    """
    token_batches = _setup(tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size,
                           resume_state_dict, data_dir, rank, world_size, prefetch, buffer_size=buffer_size)
    batches = _prefetched(token_batches, prefetch, lambda tokens: _bestfit_batches(tokens, B, T, buffer_size))
    return DataLoader(batches, _DeviceBatches(B, T, device), lambda rows: (rows[:, :-1], rows[:, 1:]),
                      prefetch, with_state)


def tokenizing_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


def tokenizing_distributed_data_loader_with_state(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, *, data_dir: str | None = None,
        rank: int | None = None, world_size: int | None = None, prefetch: int = 4,
        with_state: bool = True) -> DataLoader:
    """The older concatenating loader: documents back to back (each after its BOS), each batch the
    next B*T+1 tokens of the stream. Wastes nothing, but rows start mid-document and attend across
    unrelated documents; for small data or very long documents. Yields (inputs, targets, state_dict)."""
    token_batches = _setup(tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size,
                           resume_state_dict, data_dir, rank, world_size, prefetch)
    batches = _prefetched(token_batches, prefetch, lambda tokens: _concat_batches(tokens, B, T))
    return DataLoader(batches, _DeviceBatches(B, T, device),
                      lambda flat: (flat[:-1].reshape(B, T), flat[1:].reshape(B, T)), prefetch, with_state)


def tokenizing_distributed_data_loader(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state(*args, with_state=False, **kwargs)
