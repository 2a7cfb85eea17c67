"""
The builder: a LoaderSpec (one walk, checked at the call) -> a DataLoader yielding device batches.
Read top to bottom, in the order a batch is made: `make_loader` picks where the loader runs (a
worker process, by default, built there from this same spec, pickled); `build_loader` opens the
shard cache when streaming, `assemble` starts the rank's walk (order.py) and the state recorder
(rows.py), `_pipeline` reads, tokenizes and packs ahead on threads (prefetch.py), and DataLoader
hands each batch to the device through DeviceBatches. The loader functions that fill a LoaderSpec:
nanochat/dataloader.py; a mixture's buckets: nanochat/mixture.py. Walk-through:
docs/ARCHITECTURE.md.

Imported only when needed: nanochat.data.streaming.cache (stream=True: the shard cache, and with it
the downloader), torch (DeviceBatches: a worker process, which only makes rows, starts without it).
May import: torch, numpy, nanochat.data.base, nanochat.data.fetch.limits, nanochat.data.loader,
nanochat.data.streaming.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from nanochat.data.base.packing import BestFitPacker, ConcatPacker
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.base.state import Position, StateRecorder, decode_keys
from nanochat.data.base.state_checks import check_resume
from nanochat.data.fetch.limits import Limits
from nanochat.data.loader.figures import LoaderFigures, Mark, stretch
from nanochat.data.loader.order import ParquetReader, RankOrder, start_order
from nanochat.data.loader.prefetch import Prefetcher
from nanochat.data.loader.tokenize_procs import encoded_on_processes
from nanochat.data.loader.rows import (Encoder, RowBatch, bestfit_batches, concat_batches,
                                       token_batches)
from nanochat.data.loader.worker import Job, WorkerBatches, WorkerUnavailable, noting_logs

logger = logging.getLogger(__name__)
PACKAGE = __name__.split(".")[0]  # nanochat: the loggers whose level a worker takes on

# -----------------------------------------------------------------------------
# Where the loader runs: a worker process, or this one


class Run(NamedTuple):
    """What make_loader needs of a loader call before its spec is made."""
    B: int
    T: int
    split: str
    device: Any
    prefetch: int  # batches prepared ahead (0: all in the caller, and no worker)
    with_state: bool
    workers: int  # 1: the loader runs in a worker process; 0: here, on threads


class Walk(NamedTuple):
    spec: "LoaderSpec"
    state: dict | None  # the resume state of this walk (a mixture's: of its bucket); None: fresh


class Prepared(NamedTuple):
    """What a loader call makes at the call, every argument checked."""
    walks: list[Walk]  # one, or a mixture's buckets
    # device -> the loader. Picklable (a builder of ours and its specs, functools.partial): a
    # worker process builds the loader from it too
    build: Callable[[Any], "DataLoader"]


def make_loader(cls, run: Run, prepare: Callable[[], Prepared]) -> "DataLoader":
    """The loader a call returns. prepare() checks every argument at the call and returns a
    Prepared. The loader runs in a worker process (run.workers=1: worker_loader), handed to the
    device here by a `cls` (DataLoader or a subclass), or, where it cannot (workers=0, or a spec
    that cannot be pickled), it is built here."""
    if not run.workers:
        return prepare().build(run.device)
    # no CUDA: refused at once, before a listing or a catalog is read
    transfer = DeviceBatches(run.B, run.T, run.device)
    prepared, said = checked_for_worker(prepare)
    loader = worker_loader(cls, run, prepared, transfer, said)
    return prepared.build(run.device) if loader is None else loader


def checked_for_worker(prepare: Callable[[], Prepared]) -> tuple[Prepared, tuple[str, ...]]:
    """(prepare(), what it logged). Each walk's resume state is checked here too, against the
    data's names and sizes (its units are checked in the worker, which reads them), and a streamed
    walk's cache budget, so that a mistake found before data is read is raised here, at the call,
    and not in the worker: docs/loaders.md."""
    with noting_logs(PACKAGE) as said:  # (the worker checks the states again: it says them once)
        prepared = prepare()
        for spec, state in prepared.walks:
            if spec.stream is not None:
                open_stream(spec.stream)  # its budget checked here; the worker opens its own
            if state is not None:
                check_resume(spec.reader, spec.rank, spec.world_size, state, spec.config,
                             allow_state_mismatch=spec.allow_state_mismatch,
                             state_name=spec.state_name, shuffle=spec.shuffle, data=False)
    return prepared, tuple(said)


def worker_loader(cls, run: Run, prepared: Prepared, transfer: "DeviceBatches",
                  said: tuple[str, ...]):
    """The prepared loader, built in a worker process and handed to the device here by a `cls`
    through `transfer`; None when it cannot run there (the caller then builds it here). said: what
    the checks at the call logged here."""
    # in the worker: no device, and its own batches written into shared memory
    job = Job(functools.partial(prepared.build, "cpu"), slots=run.prefetch + 1,
              slot_bytes=2 * run.B * run.T * 8,  # [inputs | targets] of int64, as yielded
              log_level=logging.getLogger(PACKAGE).getEffectiveLevel(), said=said)
    try:
        worker = WorkerBatches(job)
    except WorkerUnavailable as e:
        if str(e) not in _FALLBACKS:  # once per reason, not once per loader
            _FALLBACKS.add(str(e))
            logger.warning("the loader runs in this process, on threads, not in a worker process: "
                           "%s. Pass workers=0 to choose this without a warning", e)
        return None
    info = worker.info
    # (no split_rows: the worker writes the rows as they are yielded, DeviceBatches.from_host)
    return cls(worker, transfer, None, 0, run.with_state, attention_info=info["attention_info"],
               streaming=info["streaming"], start_counters=info["start_counters"],
               **info["extras"])


_FALLBACKS: set[str] = set()

# -----------------------------------------------------------------------------
# The spec, and the one builder


@dataclass(frozen=True, kw_only=True)
class LoaderSpec:
    """What `assemble` and `build_loader` need to put one loader (or one bucket) together."""
    kind: str  # "bestfit": rows packed best-fit; "concat": documents back to back, cut every B*T
    reader: Any  # ParquetReader or TokenShardReader: the split's units and their documents
    encoder: Any  # Encoder (texts -> documents) or EntryDocuments (pretokenized entries)
    config: dict  # what every state records: nanochat.data.base.state.loader_config
    rank: int
    world_size: int
    batch_size: int  # documents per document batch (tokenizer_batch_size)
    B: int
    T: int
    buffer_size: int | None = None  # documents to choose from (best-fit only)
    shuffle: Shuffle | None = None
    allow_state_mismatch: bool = False
    epochs: int | None = None  # None: forever; 1: one pass (a mixture's bucket)
    state_name: str = "resume_state_dict"  # what messages call the resume state
    # streaming: the shard cache, opened where the loader is built (reader then has no cache)
    stream: "Stream | None" = None
    # what only a whole loader uses (build_loader)
    prefetch: int = 4  # batches prepared ahead on background threads (0: all in the caller)
    with_state: bool = True
    trace_documents: bool = False
    max_docs_per_row: int | None = None  # attention_info's bound; None: no attention outputs
    tokenizer_processes: int = 0  # processes the texts are encoded on (0: the encoder's threads)


class Stream(NamedTuple):
    """A streamed split's shard cache, as ShardCache takes it (docs/streaming.md)."""
    data_dir: str  # the cache
    paths: list[str]
    urls: list[str]
    catalog: list[dict]  # per shard: its size and row-group counts, before it is fetched
    keep: dict[str, int]  # never evicted: the val shard's name and size
    limits: Limits
    prefetch_shards: int
    cache_limit: int | None
    prefetch: int  # the loader's
    copies: int  # what copies of the buffered documents may take (catalog.copies_estimate)
    packing: tuple  # budget.ReadAhead: what the documents read and not yet packed span
    read_ahead: int  # documents read and not yet packed, at most


def open_stream(stream: Stream) -> tuple:
    """(the streamed split's reader, the ShardCache it waits on); the cache checks its budget
    here."""
    from nanochat.data.streaming.cache import ShardCache  # (late: stream=True only)
    cache = ShardCache(
        stream.data_dir, [os.path.basename(path) for path in stream.paths], stream.urls,
        [entry["size"] for entry in stream.catalog], limits=stream.limits, keep=stream.keep,
        prefetch_shards=stream.prefetch_shards, cache_limit=stream.cache_limit,
        prefetch=stream.prefetch, copies=stream.copies, packing=stream.packing,
        read_ahead=stream.read_ahead)
    return ParquetReader(stream.paths, stream.catalog, cache), cache


def one_walk(spec: LoaderSpec, resume_state_dict: dict | None) -> Prepared:
    """A loader of one walk (not a mixture): built by build_loader."""
    return Prepared([Walk(spec, resume_state_dict)],
                    functools.partial(build_loader, spec, resume_state_dict))


def build_loader(spec: LoaderSpec, resume_state_dict: dict | None, device) -> "DataLoader":
    """A whole loader: the walk, then tokenizing and packing, each ahead of the next on its own
    thread when prefetch > 0, then the device."""
    cache = None
    if spec.stream is not None:
        reader, cache = open_stream(spec.stream)
        spec = dataclasses.replace(spec, reader=reader)
    order, recorder, position = assemble(spec, resume_state_dict, cache)
    B, T = spec.B, spec.T
    if spec.kind == "bestfit":
        def pack(tokens):
            return bestfit_batches(tokens, recorder, position, B=B, T=T,
                                   buffer_size=spec.buffer_size, trace=spec.trace_documents,
                                   max_docs_per_row=spec.max_docs_per_row)
        split_rows = row_split
    else:
        def pack(tokens):
            return concat_batches(tokens, recorder, position, B, T)
        split_rows = flat_split(B, T)
    # pretokenized shards: reading is a slice of a memory map and packing holds the GIL, so both
    # run in the caller (in a worker: its main thread); a packing thread made the loader ~1.5x
    # slower (scripts/bench_pretokenized)
    tokenizing = isinstance(spec.encoder, Encoder)
    depth = spec.prefetch if tokenizing else 0
    processes = spec.tokenizer_processes if depth else 0
    batches = _pipeline(order.document_batches(), spec.encoder, depth, pack, processes)
    return DataLoader(batches, DeviceBatches(B, T, device), split_rows, depth,
                      spec.with_state, attention_info=spec.max_docs_per_row is not None,
                      shard_cache=cache, start_counters=start_counters(spec.kind, [recorder]))


class Assembled(NamedTuple):
    order: RankOrder  # the rank's walk, fresh or resumed
    recorder: StateRecorder  # builds each batch's state, restores a packer from the resumed one
    position: Position  # nanochat's keys (pq_idx, rg_idx, epoch) of the last batch consumed


def assemble(spec: LoaderSpec, resume_state_dict: dict | None,
             cache=None) -> Assembled:
    """Start the walk from the state (fresh when None) and the recorder of its states; a streaming
    loader's cache (a ShardCache) starts fetching what the walk reads first, the resumed buffer's
    shards first."""
    order, resumed, position = start_order(
        spec.reader, spec.rank, spec.world_size, spec.batch_size, resume_state_dict, spec.config,
        allow_state_mismatch=spec.allow_state_mismatch, epochs=spec.epochs,
        state_name=spec.state_name, shuffle=spec.shuffle)
    watch = None
    if cache is not None:
        from nanochat.data.streaming.cache import peer_first_reads  # (late: stream=True only)
        peers = peer_first_reads(resume_state_dict, spec.rank, spec.world_size)
        buffered = decode_keys(resumed["buffer"]) if resumed else ()
        cache.begin(order, buffered=buffered, peers=peers)
        watch = cache.hold  # keeps on disk what a resume from a yielded state reads
    recorder = StateRecorder(spec.kind, order, spec.encoder, spec.config, resumed, watch)
    return Assembled(order, recorder, position)


def _pipeline(doc_batches, encoder, depth: int, pack, processes: int = 0):
    """Yield what pack(token batches) yields, reading and tokenizing ahead on threads (depth > 0),
    the texts encoded on `processes` processes when there are any."""
    stages = []  # a prefetcher closes its source itself, on its thread (which may still run it)
    try:
        # reading runs a few row groups ahead, so the tokenizer's pool never waits on parquet
        stages.append(run_ahead(doc_batches, 4 * depth, "nanochat-read"))
        if processes:  # each encodes whole batches, back in order (tokenize_procs.py)
            tokenized = encoded_on_processes(stages[-1], encoder, processes)
        else:  # a second encode call starts before the first returns: the pool never idles
            tokenized = token_batches(stages[-1], encoder,
                                      depth > 0 and getattr(encoder, "thread_safe", False))
        stages.append(run_ahead(tokenized, depth, "nanochat-tokenize"))
        yield from pack(stages[-1])
    finally:
        for stage in reversed(stages):  # downstream first: it may be waiting on the one before
            stage.close()


def run_ahead(source, depth: int, name: str):
    """`source` run `depth` items ahead on a daemon thread (prefetch.py), or itself when depth is
    0: then no thread at all, and everything runs in the caller."""
    return Prefetcher(source, depth, name) if depth > 0 else source


def start_counters(kind: str, recorders) -> dict:
    """The packers' running totals before the first batch, summed over `recorders` (a mixture's
    buckets): zero, or what the resumed state restores (rows.restore_buffer)."""
    packer = BestFitPacker if kind == "bestfit" else ConcatPacker
    return sum_counters([dict.fromkeys(packer.COUNTERS, 0)]
                        + [r.resumed["counters"] for r in recorders if r.resumed])


def sum_counters(counters) -> dict:
    """The sum, name by name, of packers' running totals (dicts of name -> count)."""
    total: dict = {}
    for one in counters:
        for name, value in one.items():
            total[name] = total.get(name, 0) + value
    return total

# -----------------------------------------------------------------------------
# The device end: what every loader function returns

class DataLoader:
    """What the loader functions return: an iterator of (inputs, targets, state_dict) (or of
    (inputs, targets) without state), with `stats` and `close()`.

    A worker process (the default) starts its work at the call; background threads in this
    process (workers=0) start at the first `next()` (a streaming loader's shard fetching at the
    call, so that the first shard is on its way). Either stops on `close()`, on garbage
    collection, or when the loader fails; a failure is raised again by every later `next()`.
    `stats` describes the batches yielded so far (not the read-ahead): tokens tokenized, emitted
    and cropped, crop_share (cropped / (emitted + cropped)), documents per row, buffer occupancy,
    masked targets, and wait_seconds, the time `next()` spent waiting for a batch (the stall a GPU
    would feel). `figures()` gives rates and shares since its last call and in total, for a
    training log. With attention_info, each batch has a fourth element: a dict of doc_ids,
    position_ids and cu_seqlens on the device (see nanochat.data.loader.rows.attention_info).
    """

    def __init__(self, batches, transfer: "DeviceBatches", split_rows, prefetch: int,
                 with_state: bool, *, attention_info: bool = False,
                 shard_cache=None, streaming: bool = False,
                 start_counters: dict | None = None):
        self._batches = batches  # generator of RowBatch, or the worker that runs the loader
        self._worker = batches if isinstance(batches, WorkerBatches) else None
        self._shard_cache = shard_cache  # a streaming loader's ShardCache, when it runs here
        # streaming: the shard cache's status comes from the shard cache, or from the worker
        self._streaming = shard_cache is not None or streaming
        self._attention_info = attention_info
        self._transfer = transfer
        self._split_rows = split_rows
        self._prefetch = prefetch
        self._with_state = with_state
        self._source = None
        self._closed = False
        # close() from another thread while next() starts the threads: it must see the prefetcher
        # that owns the generator, not close the generator under it ("generator already executing")
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._wait_seconds = 0.0
        self.stats: dict = {}
        # figures(): the packers' totals after the last batch, the batches yielded, and the marks
        # of the loader's start and of the last call
        self._start_counters = start_counters or {}
        self._counters = self._start_counters
        self._yielded = 0
        self._cache_seen = None  # the last cache status figures() read (a closed worker has none)
        nothing = 0 if self._streaming else None  # (the cache is this loader's own: from 0)
        self._first_mark = self._last_mark = Mark(time.perf_counter(), 0.0, 0, self._counters,
                                                   nothing, nothing)
        # with trace_documents=True: per row of the last batch, the (epoch, pq_idx, rg_idx,
        # doc_index) of every document placed in it, in order (a debugging aid: which documents
        # did a step see?)
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
                self._source = run_ahead(self._batches, self._prefetch, "nanochat-packing")
        t0 = time.perf_counter()
        try:
            batch = next(self._source)
            self._check(batch)
        except BaseException as e:
            self._error = e
            self.close()
            raise
        self._wait_seconds += time.perf_counter() - t0
        self.documents = batch.trace
        if self._worker is not None:  # rows written as they are yielded
            inputs, targets = self._transfer.from_host(batch.rows)
        else:
            inputs, targets = self._transfer(*self._split_rows(batch.rows), batch.masked)
        self.stats = batch.stats | {"wait_seconds": self._wait_seconds}
        self._counters = self._packer_counters(batch)
        self._yielded += 1
        out = (inputs, targets, batch.state) if self._with_state else (inputs, targets)
        if self._attention_info:
            out += (self._transfer.info(batch.info),)
        return out

    def figures(self) -> LoaderFigures:
        """What this loader did since the last call and since it was made: next()'s wait, tokens
        per second in and out, crop and masked shares, documents per row, and for a streaming loader
        its downloads, evictions and cache use. `str()` of it is one line for a log. Cheap, except
        that a streaming loader reads its cache's status (a listing and the ledger)."""
        now = self._mark()
        last, self._last_mark = self._last_mark, now
        BT = self._transfer.B * self._transfer.T
        status = self._cache_seen
        return LoaderFigures(stretch(last, now, BT), stretch(self._first_mark, now, BT),
                             None if status is None else status.used_bytes,
                             None if status is None else status.cache_limit)

    def _mark(self) -> Mark:
        if self._streaming and not self._closed:  # (a closed worker has no cache to ask)
            self._cache_seen = self.cache_status()
        status = self._cache_seen
        return Mark(time.perf_counter(), self._wait_seconds, self._yielded, self._counters,
                     None if status is None else status.fetched_bytes,
                     None if status is None else status.own_evictions)

    def _packer_counters(self, batch: RowBatch) -> dict:
        """The packer's running totals after this batch (a mixture sums its buckets')."""
        return batch.state["counters"]

    def row_batches(self):
        """The RowBatches this loader's pipeline makes, for a worker process that hands them on
        (its threads start when it is first iterated)."""
        return self._batches

    def write_batch(self, batch: RowBatch, host: np.ndarray) -> RowBatch:
        """For a worker: write the batch's rows as the trainer yields them into host (2 * B * T
        int64), and return what else it sends (its state, stats...)."""
        if batch.rows is not None:  # (None: a mixture's end)
            write_host_rows(host, *self._split_rows(batch.rows), batch.masked)
        return batch._replace(rows=None, masked=())

    def worker_info(self) -> dict:
        """What the trainer's end of a worker needs to know of this loader: whether it yields
        attention_info and streams, and its class's own arguments."""
        return {"attention_info": self._attention_info, "streaming": self._streaming,
                "start_counters": self._start_counters, "extras": {}}

    @property
    def worker_pid(self) -> int | None:
        """The pid of the worker process that runs this loader's work; None: it runs here."""
        return None if self._worker is None else self._worker.pid

    def cache_status(self):
        """A streaming loader's shard cache, for a person: what is on disk against cache_limit, who
        needs which shard and why (a nanochat.data.streaming.cache_status.CacheStatus); None when
        not streaming."""
        if not self._streaming:
            return None
        return (self._worker or self._shard_cache).status()

    def _check(self, batch: RowBatch) -> None:
        """Called with every batch before it is yielded; raising stops the loader (the mixture
        loader's way to stop every rank at one step)."""

    def close(self) -> None:
        """Stop the background threads and end the iteration: every later next() raises
        StopIteration, as for a closed generator (a batch already prepared is dropped), or the
        failure that stopped the loader. Idempotent; returns within a second: a thread inside a long
        call (one tokenizer call) ends when that call returns, and starts no other."""
        self._closed = True
        # the shard cache first: closing it wakes a reader waiting for a shard (a worker's ends
        # with the worker, the source below)
        if getattr(self, "_shard_cache", None) is not None:  # (None: __init__ failed early)
            self._shard_cache.close()
        lock = getattr(self, "_lock", None)  # (None: __del__ of an object whose __init__ failed)
        with lock or contextlib.nullcontext():
            source = self._source if self._source is not None else getattr(self, "_batches", None)
        if source is not None:
            source.close()

    def __del__(self):
        worker = getattr(self, "_worker", None)  # (None: __init__ failed before setting it)
        if worker is not None:
            worker.close(wait=False)  # garbage collection asks a worker to stop, and goes on
        self.close()


IGNORE_INDEX = -100  # cross_entropy's default ignore_index


class DeviceBatches:
    """Copies packed batches to the device through preallocated `[inputs | targets]` buffers.

    On CUDA: two pinned host staging buffers used alternately, one device buffer, exactly one
    non-blocking host-to-device copy per batch. Before a staging buffer is rewritten we wait on the
    event recorded after the copy that last read it (two batches ago), so an in-flight copy never
    reads half-written data. On CPU the staging buffer is the yielded memory; on other devices
    (MPS) nothing is pinned and one blocking copy lands the batch.

    The buffers, and torch with them, come at the first batch (another device than "cpu": at the
    call, which refuses a missing GPU): a worker process builds a loader on "cpu" and never yields
    from it, so it starts without torch (~1.2 s sooner).
    """

    def __init__(self, B: int, T: int, device):
        self.B, self.T = B, T
        self.where = device
        self.count = 0
        self.staging: list | None = None  # made by _buffers()
        if device != "cpu":
            self._buffers()

    def __call__(self, inputs: np.ndarray, targets: np.ndarray, masked=()) -> tuple:
        i = self._next_staging()
        write_host_rows(self.staging[i].numpy(), inputs, targets, masked)
        return self._to_device(i)

    def from_host(self, host: np.ndarray) -> tuple:
        """A batch a worker wrote (write_host_rows) into shared memory: on CPU, views of it
        (valid until the next batch, as the staging buffer's are); else copied as any batch."""
        import torch
        self._buffers()
        BT = self.B * self.T
        if self.device.type == "cpu":
            flat = torch.from_numpy(host)
            return flat[:BT].view(self.B, self.T), flat[BT:].view(self.B, self.T)
        i = self._next_staging()
        np.copyto(self.staging[i].numpy(), host)
        return self._to_device(i)

    def info(self, arrays: dict) -> dict:
        """A batch's attention_info arrays as tensors on the device."""
        import torch
        self._buffers()
        return {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}

    def _buffers(self) -> None:
        if self.staging is not None:
            return
        import torch
        self.device = torch.device(self.where)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.where!r} but no CUDA GPU is available; pass "
                             "device='cpu'")
        n = 2 * self.B * self.T
        num_staging = 2 if self.cuda else 1
        self.copied: list = [None] * num_staging  # CUDA events: copy from staging[i] finished
        staging = [torch.empty(n, dtype=torch.long, pin_memory=self.cuda)
                   for _ in range(num_staging)]
        if self.device.type == "cpu":
            self.buffer = staging[0]
        else:
            self.buffer = torch.empty(n, dtype=torch.long, device=self.device)
        self.staging = staging

    def _next_staging(self) -> int:
        self._buffers()
        i = self.count % len(self.staging)
        self.count += 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        return i

    def _to_device(self, i: int) -> tuple:
        BT = self.B * self.T
        if self.buffer is not self.staging[i]:
            self.buffer.copy_(self.staging[i], non_blocking=self.cuda)
            if self.cuda:
                import torch
                event = torch.cuda.Event()
                event.record()
                self.copied[i] = event
        return self.buffer[:BT].view(self.B, self.T), self.buffer[BT:].view(self.B, self.T)


def write_host_rows(host: np.ndarray, inputs: np.ndarray, targets: np.ndarray, masked) -> None:
    """A batch's `[inputs | targets]` as int64 into host (2 * B * T), the targets that predict a
    window's repeated tokens set to IGNORE_INDEX: those tokens are trained once."""
    BT = inputs.size
    np.copyto(host[:BT].reshape(inputs.shape), inputs)
    host_targets = host[BT:].reshape(targets.shape)
    np.copyto(host_targets, targets)
    for r, start, end in masked:
        host_targets[r, start:end] = IGNORE_INDEX


def row_split(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rows[:, :-1], rows[:, 1:]


def flat_split(B: int, T: int):
    def split_rows(flat):  # B*T+1 tokens: inputs the first B*T, targets the last B*T
        return flat[:-1].reshape(B, T), flat[1:].reshape(B, T)
    return split_rows
