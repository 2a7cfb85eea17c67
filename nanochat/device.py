"""
The device end of a loader: DeviceBatches copies each packed batch to the device through preallocated
`[inputs | targets]` buffers (on CUDA, pinned staging and one non-blocking copy a batch), and DataLoader,
what every loader function returns, pulls packed batches from a background thread and yields them as
tensors, with their state and statistics.

May import: torch, numpy, nanochat.prefetch.
"""

import contextlib
import threading
import time

import numpy as np
import torch

from nanochat.prefetch import maybe_prefetch

IGNORE_INDEX = -100  # cross_entropy's default ignore_index


class DeviceBatches:
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


def row_split(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rows[:, :-1], rows[:, 1:]


class DataLoader:
    """What the loader functions return: an iterator of (inputs, targets, state_dict) (or of
    (inputs, targets) without state), with `stats` and `close()`.

    Background threads start at the first `next()` (a streaming loader's shard fetching at the call, so
    that the first shard is on its way) and stop on `close()`, on garbage collection, or when the loader
    fails; a failure is raised again by every later `next()`.
    `stats` describes the batches yielded so far (not the read-ahead): tokens tokenized, emitted
    and cropped, crop_share (cropped / (emitted + cropped)), documents per row, buffer occupancy,
    masked targets, and wait_seconds, the time `next()` spent waiting for a batch (the stall a GPU
    would feel). With attention_info, each batch has a fourth element: a dict of doc_ids,
    position_ids and cu_seqlens on the device (see nanochat.rows.attention_info).
    """

    def __init__(self, batches, transfer: DeviceBatches, split_rows, prefetch: int, with_state: bool,
                 attention_info: bool = False, also_close=None):
        self._batches = batches  # generator of (packed, state_dict, stats, extras)
        self._also_close = also_close  # closed first by close(): a streaming loader's shard cache
        self._attention_info = attention_info
        self._transfer = transfer
        self._split_rows = split_rows
        self._prefetch = prefetch
        self._with_state = with_state
        self._source = None
        self._closed = False
        # close() from another thread while next() starts the threads: it must see the prefetcher that owns the
        # generator, not close the generator under it ("generator already executing")
        self._lock = threading.Lock()
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
        with self._lock:
            if self._closed:
                raise StopIteration  # as a closed generator: nothing comes out after close()
            if self._source is None:
                self._source = maybe_prefetch(self._batches, self._prefetch, "nanochat-packing")
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

    def cache_status(self):
        """A streaming loader's shard cache figures (nanochat.cache_status.CacheStatus): what is on
        disk against cache_limit, who needs which shard and why; None when not streaming."""
        cache = getattr(self, "_also_close", None)
        return None if cache is None else cache.status()

    def _check(self, extras: dict) -> None:
        """Called with every batch before it is yielded; raising stops the loader (see the mixture loader)."""

    def close(self) -> None:
        """Stop the background threads and end the iteration: every later next() raises StopIteration,
        as for a closed generator (a batch already prepared is dropped), or the failure that stopped the
        loader. Idempotent; returns within a second: a thread inside a long call (one tokenizer call)
        ends when that call returns, and starts no other."""
        self._closed = True
        if getattr(self, "_also_close", None) is not None:  # first: it wakes a reader waiting for a shard
            self._also_close.close()
        lock = getattr(self, "_lock", None)  # (None: __del__ of an object whose __init__ failed)
        with lock or contextlib.nullcontext():
            source = self._source if self._source is not None else getattr(self, "_batches", None)
        if source is not None:
            source.close()

    def __del__(self):
        self.close()
