"""
The loaders: parquet shards (or pretokenized ones) -> token documents -> packed rows -> the device.
Read top to bottom, the main path is: a public loader function checks its arguments and fills a
LoaderSpec; `assemble` starts the rank's walk (nanochat/data/loader/order.py) and the state recorder
(nanochat/data/loader/rows.py); `build_loader` runs reading, tokenizing and packing ahead on
background threads (nanochat/data/loader/prefetch.py); DataLoader hands each batch to the device
through one staging buffer. The mixture loader (nanochat/mixture.py) assembles each of its buckets
with `assemble` too. Walk-through: docs/ARCHITECTURE.md. Resume and its states: docs/resume.md.

May import: torch, numpy, nanochat.data.loader.order, nanochat.data.pretokenized.token_reader,
nanochat.data.loader.rows, nanochat.data.base.packing, nanochat.data.base.state,
nanochat.data.loader.prefetch, nanochat.data.loader.options, nanochat.data.base.checks,
nanochat.data.base.shuffle, nanochat.data.streaming.cache, nanochat.data.streaming.catalog,
nanochat.data.loader.parquet_files, nanochat.data.fetch.limits, nanochat.data.streaming.budget,
nanochat.data.loader.figures, nanochat.data.base.state_checks.
"""

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from nanochat.data.streaming.budget import copies_estimate, read_ahead_span
from nanochat.data.streaming.catalog import streamed_files
from nanochat.data.base.checks import check_int
from nanochat.data.loader.parquet_files import split_parquet_files
from nanochat.data.fetch.limits import Limits
from nanochat.data.loader.figures import LoaderFigures, Mark, start_counters, stretch
from nanochat.data.loader.options import (check_options, check_shuffle, check_stream, resolve_rank,
                              resolve_workers)
from nanochat.data.loader.order import ParquetReader, RankOrder, start_order
from nanochat.data.base.packing import check_long_doc_policy
from nanochat.data.loader.prefetch import (Job, WorkerBatches, WorkerUnavailable, maybe_prefetch,
                                           noting_logs)
from nanochat.data.loader.rows import (Encoder, EntryDocuments, RowBatch, bestfit_batches,
                                       concat_batches, token_batches)
from nanochat.data.streaming.cache import ShardCache, local_peers, peer_starts
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.base.state import (Position, StateRecorder, decode_keys, loader_config,
                                      tokenizer_fingerprint)
from nanochat.data.base.state_checks import check_resume
from nanochat.data.pretokenized.token_reader import TokenShardReader, shard_paths, shard_vocab

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# The spec and the one builder


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
    where: str = "resume_state_dict"  # what messages call the state
    cache: ShardCache | None = None  # streaming: fetches each shard just before the walk reads it
    # what only a whole loader uses (build_loader)
    device: Any = "cuda"
    prefetch: int = 4  # batches prepared ahead on background threads (0: all in the caller)
    with_state: bool = True
    trace_documents: bool = False
    max_docs_per_row: int | None = None  # attention_info's bound; None: no attention outputs


class Assembled(NamedTuple):
    order: RankOrder  # the rank's walk, fresh or resumed
    recorder: StateRecorder  # builds each batch's state, restores a packer from the resumed one
    position: Position  # nanochat's keys (pq_idx, rg_idx, epoch) of the last batch consumed


def assemble(spec: LoaderSpec, resume_state_dict: dict | None) -> Assembled:
    """Start the walk from the state (fresh when None) and the recorder of its states; a streaming
    loader starts fetching what the walk reads first, the resumed buffer's shards first."""
    order, resumed, position = start_order(
        spec.reader, spec.rank, spec.world_size, spec.batch_size, resume_state_dict, spec.config,
        allow_state_mismatch=spec.allow_state_mismatch, epochs=spec.epochs, where=spec.where,
        shuffle=spec.shuffle)
    watch = None
    if spec.cache is not None:
        peers = peer_starts(resume_state_dict, spec.rank, spec.world_size)
        buffered = decode_keys(resumed["buffer"]) if resumed else ()
        spec.cache.start(order, buffered=buffered, peers=peers)
        watch = spec.cache.hold  # keeps on disk what a resume from a yielded state reads
    recorder = StateRecorder(spec.kind, order, spec.encoder, spec.config, resumed, watch)
    return Assembled(order, recorder, position)


def build_loader(spec: LoaderSpec, resume_state_dict: dict | None) -> "DataLoader":
    """A whole loader: the walk, then tokenizing and packing, each ahead of the next on its own
    thread when prefetch > 0, then the device."""
    order, recorder, position = assemble(spec, resume_state_dict)
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
    batches = _pipeline(order.document_batches(), spec.encoder, depth, pack)
    return DataLoader(batches, DeviceBatches(B, T, spec.device), split_rows, depth,
                      spec.with_state, attention_info=spec.max_docs_per_row is not None,
                      cache=spec.cache, start_counters=start_counters(spec.kind, [recorder]))


class Prepared(NamedTuple):
    """What a public loader function makes at its call, every argument checked."""
    walks: list  # [(LoaderSpec, the state it resumes from or None)]: one, or a mixture's buckets
    build: Any  # () -> the loader, built in this process


def make_loader(cls, function, args: dict, prepare) -> "DataLoader":
    """The loader `function(**args)` returns. prepare() checks every argument at the call and
    returns a Prepared. Then the loader runs in a worker process (nanochat/data/loader/prefetch.py's
    WorkerBatches), handed to the device here by a `cls` (DataLoader or a subclass), or, where it
    cannot (workers=0, or a job that cannot run there), it is built here. For a worker, each walk's
    resume state is checked here first, against the data's names and sizes (its units are checked
    in the worker, which reads them), so that a mistake found before data is read is raised here,
    at the call: docs/loaders.md."""
    workers = resolve_workers(args["workers"], args["prefetch"])
    transfer = None
    if workers:  # no CUDA: refused at once, before a listing or a catalog is read
        check_options(args["B"], args["T"], args["split"], args["prefetch"])  # (B, T: its size)
        transfer = DeviceBatches(args["B"], args["T"], args["device"])
    with noting_logs(__package__) as said:  # (the worker runs the same checks: it says them once)
        prepared = prepare()
        for spec, state in prepared.walks if workers else ():
            if state is not None:
                check_resume(spec.reader, spec.rank, spec.world_size, state, spec.config,
                             allow_state_mismatch=spec.allow_state_mismatch, where=spec.where,
                             shuffle=spec.shuffle, data=False)
    loader = worker_loader(cls, function, args, transfer, tuple(said)) if workers else None
    return prepared.build() if loader is None else loader


def worker_loader(cls, function, args: dict, transfer: "DeviceBatches", said: tuple[str, ...]):
    """The loader `function(**args)` makes, run in a worker process and handed to the device here
    by a `cls` through `transfer`; None when the job cannot run there (the caller then builds the
    loader here). said: what the checks at the call logged here."""
    B, T = args["B"], args["T"]
    # in the worker: no threads of its own beyond the loader's, no device
    kwargs = args | {"workers": 0, "device": "cpu"}
    job = Job(f"{function.__module__}:{function.__name__}", kwargs, slots=args["prefetch"] + 1,
              slot_bytes=2 * B * T * 8,  # [inputs | targets] of int64, as yielded
              log_level=logging.getLogger(__package__).getEffectiveLevel(), said=said)
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
    return cls(worker, transfer, None, 0, args["with_state"],
               attention_info=info["attention_info"], cache=worker if info["streaming"] else None,
               start_counters=info["start_counters"], **info["extras"])


def one_walk(spec: LoaderSpec, resume_state_dict: dict | None) -> Prepared:
    """A loader of one walk (not a mixture): built by build_loader."""
    return Prepared([(spec, resume_state_dict)], lambda: build_loader(spec, resume_state_dict))


_FALLBACKS: set[str] = set()


def _pipeline(doc_batches, encoder, depth: int, pack):
    """Yield what pack(token batches) yields, reading and tokenizing ahead on threads
    (depth > 0)."""
    stages = []  # a prefetcher closes its source itself, on its thread (which may still run it)
    try:
        # reading runs a few row groups ahead, so the tokenizer's pool never waits on parquet
        stages.append(maybe_prefetch(doc_batches, 4 * depth, "nanochat-read"))
        # a second encode call starts before the first returns, so the pool never idles on a tail
        overlap_calls = depth > 0 and getattr(encoder, "thread_safe", False)
        stages.append(maybe_prefetch(token_batches(stages[-1], encoder, overlap_calls), depth,
                                     "nanochat-tokenize"))
        yield from pack(stages[-1])
    finally:
        for stage in reversed(stages):  # downstream first: it may be waiting on the one before
            stage.close()


def _parquet_reader(split: str, data_dir, streaming, read_ahead: dict):
    """(reader, shard cache or None) of a split's parquet shards: those on disk, or (streaming)
    the dataset's, each fetched just before it is read (docs/streaming.md). read_ahead: rank,
    world_size, prefetch, and the documents a buffer and the read-ahead hold (the cache's
    budget)."""
    if streaming.settings is None:
        return ParquetReader(split_parquet_files(split, data_dir)), None
    limits = Limits() if streaming.limits is None else streaming.limits
    files = streamed_files(split, data_dir, streaming.settings.num_shards, streaming.base_url,
                           limits)
    catalog = files.entries
    cache = ShardCache(
        files.data_dir, [os.path.basename(path) for path in files.paths], files.urls,
        [entry["size"] for entry in catalog], limits=limits, keep=files.val,
        prefetch_shards=streaming.settings.prefetch_shards,
        cache_limit=streaming.settings.cache_limit, prefetch=read_ahead["prefetch"],
        copies=copies_estimate(catalog, read_ahead["buffer_docs"]),
        # (every local rank's: they share the cache, and the one whose shards hold fewest of its
        # documents spans the most)
        packing=read_ahead_span(catalog, local_peers(read_ahead["rank"], read_ahead["world_size"]),
                                read_ahead["world_size"], read_ahead["docs"]),
        read_ahead=read_ahead["docs"])
    return ParquetReader(files.paths, catalog, cache), cache


class _Streaming(NamedTuple):
    settings: Any  # nanochat.data.loader.options.Streaming, or None: read the shards on disk
    base_url: str | None
    limits: Limits | None


def _max_docs(attention_info: bool, max_docs_per_row: int | None, T: int) -> int | None:
    if not attention_info:
        return None
    if max_docs_per_row is None:
        return T  # every document has at least its BOS in the inputs: never more than T per row
    return check_int("max_docs_per_row", max_docs_per_row, 1)


def _tokenizing_spec(kind: str, tokenizer, B: int, T: int, split: str, args: dict) -> LoaderSpec:
    """The spec of a tokenizing loader (best-fit or concatenating), every argument checked first, so
    that bad input fails at the call and not inside a thread or after fetching has started."""
    buffer_size = args.get("buffer_size")
    shuffle = check_shuffle(args["shuffle"], args["seed"], args["shuffle_window"])
    settings = check_stream(args["stream"], args["cache_limit"], args["prefetch_shards"],
                            args["num_shards"], shuffle)
    streaming = _Streaming(settings, args["base_url"], args["download_limits"])
    max_docs = _max_docs(args.get("attention_info", False), args.get("max_docs_per_row"), T)
    check_options(B, T, split, args["prefetch"], tokenizer_threads=args["tokenizer_threads"],
                  tokenizer_batch_size=args["tokenizer_batch_size"], buffer_size=buffer_size)
    policy = None
    if kind == "bestfit":
        if buffer_size is None:
            raise ValueError("buffer_size must be an integer >= 1")
        policy = (args["long_doc_policy"], args["split_overlap"])
        check_long_doc_policy(*policy, T)
    for method in ("get_bos_token_id", "encode"):
        if not callable(getattr(tokenizer, method, None)):
            raise TypeError(f"tokenizer must have a {method}() method, got "
                            f"{type(tokenizer).__name__}")
    rank, world_size = resolve_rank(args["rank"], args["world_size"])
    batch_size = args["tokenizer_batch_size"]
    # documents read and not yet packed, at most: the pipeline's queues, a batch in each stage's
    # hands and one more in the tokenizer's (overlap_calls)
    read_ahead = {"rank": rank, "world_size": world_size, "prefetch": args["prefetch"],
                  "buffer_docs": buffer_size if kind == "bestfit" else batch_size,
                  "docs": (5 * args["prefetch"] + 3) * batch_size}
    reader, cache = _parquet_reader(split, args["data_dir"], streaming, read_ahead)
    config = loader_config(kind, "parquet", split, reader.paths, B=B, T=T,
                           buffer_size=buffer_size, batch_size=batch_size,
                           tokenizer=tokenizer_fingerprint(tokenizer), rank=rank,
                           world_size=world_size, policy=policy, shuffle=shuffle,
                           sizes=reader.sizes)
    encoder = Encoder(tokenizer, args["tokenizer_threads"])
    return LoaderSpec(kind=kind, reader=reader, encoder=encoder,
                      config=config, rank=rank, world_size=world_size, batch_size=batch_size,
                      B=B, T=T, buffer_size=buffer_size, shuffle=shuffle,
                      allow_state_mismatch=args["allow_state_mismatch"], cache=cache,
                      device=args["device"], prefetch=args["prefetch"],
                      with_state=args["with_state"],
                      trace_documents=args.get("trace_documents", False),
                      max_docs_per_row=max_docs)


def _pretokenized_spec(args: dict) -> LoaderSpec:
    """The spec of the pretokenized loader, every argument checked first."""
    B, T, split, chunk_size = args["B"], args["T"], args["split"], args["chunk_size"]
    buffer_size, batch_size = args["buffer_size"], args["batch_size"]
    policy = (args["long_doc_policy"], args["split_overlap"])
    check_options(B, T, split, args["prefetch"], buffer_size=buffer_size, chunk_size=chunk_size,
                  batch_size=batch_size)
    check_long_doc_policy(*policy, T)
    shuffle = check_shuffle(args["shuffle"], args["seed"], args["shuffle_window"])
    rank, world_size = resolve_rank(args["rank"], args["world_size"])
    data_dir = os.path.expanduser(os.fspath(args["data_dir"]))
    paths = shard_paths(data_dir, split)
    vocab = shard_vocab(paths[0], args["bos_token"], args["vocab_size"], [data_dir])
    config = loader_config("bestfit", "pretokenized", split, paths, B=B, T=T,
                           buffer_size=buffer_size, batch_size=batch_size,
                           tokenizer=f"bos:{vocab.bos_token}", rank=rank, world_size=world_size,
                           chunk_size=chunk_size, policy=policy, shuffle=shuffle)
    max_docs = _max_docs(args["attention_info"], args["max_docs_per_row"], T)
    encoder = EntryDocuments(vocab.bos_token, always=vocab.convention == "gpt-simple")
    return LoaderSpec(kind="bestfit", reader=TokenShardReader(paths, chunk_size, vocab),
                      encoder=encoder, config=config, rank=rank, world_size=world_size,
                      batch_size=batch_size, B=B, T=T, buffer_size=buffer_size,
                      shuffle=shuffle, allow_state_mismatch=args["allow_state_mismatch"],
                      device=args["device"], prefetch=args["prefetch"],
                      with_state=args["with_state"], trace_documents=args["trace_documents"],
                      max_docs_per_row=max_docs)


# -----------------------------------------------------------------------------
# The public loaders: nanochat's names and signatures


def tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4,
        tokenizer_batch_size: int = 128, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str | None = None, rank: int | None = None,
        world_size: int | None = None, prefetch: int = 4, with_state: bool = True,
        allow_state_mismatch: bool = False, trace_documents: bool = False,
        attention_info: bool = False, max_docs_per_row: int | None = None,
        long_doc_policy: str = "crop", split_overlap: int = 0, shuffle: bool = False,
        seed: int = 0, shuffle_window: int = 8, stream: bool | None = None,
        cache_limit: int | str | None = None, prefetch_shards: int = 2,
        num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None, workers: int | None = None) -> "DataLoader":
    """Yield (inputs, targets, state_dict) forever: (B, T) int64 batches of BOS-aligned best-fit
    rows.

    tokenizer: anything with get_bos_token_id() and encode(list_of_str, prepend=bos, num_threads=n)
    returning lists of ints (get_vocab_size(), when present, picks 2-byte storage;
    encode_to_arrays(), when present, is used instead and returns numpy arrays).
    buffer_size: documents kept to choose from (larger packs better, costs memory and start-up).
    data_dir: read shards from here instead of the dataset directory.
    rank/world_size: default to torchrun's RANK/WORLD_SIZE.
    prefetch: batches prepared ahead (0 runs everything in the caller).
    workers: 1 (the default, or NANOCHAT_LOADER_WORKERS) runs reading, tokenizing and packing in a
    worker process, so that they never take the trainer's GIL (docs/loaders.md); 0 runs them on
    threads of this process. The tokenizer must then pickle, or the loader warns and runs here.
    attention_info: also yield a dict of doc_ids, position_ids and cu_seqlens (padded to
    B * max_docs_per_row + 1; default bound T).
    long_doc_policy: tokens that do not fit a row are "crop"ped (nanochat's way: about a third at
    T=2048), "split" into BOS-led pieces (later pieces repeat split_overlap tokens, their targets
    -100), or "split_reuse" (the cropped rest goes back into the buffer). Every row starts with BOS.
    shuffle, seed, shuffle_window: read each epoch's row groups, and the documents of every window
    of them, in a seeded order (default: file order, as nanochat).
    stream: fetch the shards while training (default: NANOCHAT_STREAM=1); data_dir is then the
    cache, bounded by cache_limit; prefetch_shards, num_shards, base_url, download_limits: see
    docs/streaming.md. Batches and states equal those of the same shards on disk.
    """
    args = dict(locals())
    return make_loader(DataLoader, tokenizing_distributed_data_loader_with_state_bos_bestfit, args,
                       lambda: one_walk(_tokenizing_spec("bestfit", tokenizer, B, T, split, args),
                                        resume_state_dict))


def tokenizing_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state_bos_bestfit, yielding (inputs,
    targets)."""
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False,
                                                                     **kwargs)


def tokenizing_distributed_data_loader_with_state(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4,
        tokenizer_batch_size: int = 128, device="cuda", resume_state_dict: dict | None = None, *,
        data_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        shuffle: bool = False, seed: int = 0, shuffle_window: int = 8,
        stream: bool | None = None, cache_limit: int | str | None = None,
        prefetch_shards: int = 2, num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None, workers: int | None = None) -> "DataLoader":
    """The concatenating loader: documents back to back (each after its BOS), each batch the next
    B*T+1 tokens of the concatenated documents, advancing by B*T, so no token is skipped. Wastes
    nothing, but rows start mid-document. Yields (inputs, targets, state_dict).

    stats: tokens_emitted counts B*T per batch; buffer_tokens those tokenized and not yet consumed,
    so tokens_tokenized == tokens_emitted + buffer_tokens. The state's emitted["tokens"] counts the
    B*T+1 tokens of every batch that its hash covers. The other arguments: as for the best-fit
    loader."""
    args = dict(locals())
    return make_loader(DataLoader, tokenizing_distributed_data_loader_with_state, args,
                       lambda: one_walk(_tokenizing_spec("concat", tokenizer, B, T, split, args),
                                        resume_state_dict))


def tokenizing_distributed_data_loader(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state(*args, with_state=False, **kwargs)


def pretokenized_distributed_data_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str, bos_token: int | None = None,
        chunk_size: int = 1024, batch_size: int = 128, rank: int | None = None,
        world_size: int | None = None, prefetch: int = 4, with_state: bool = True,
        allow_state_mismatch: bool = False, trace_documents: bool = False,
        attention_info: bool = False, max_docs_per_row: int | None = None,
        long_doc_policy: str = "crop", split_overlap: int = 0, vocab_size: int | None = None,
        shuffle: bool = False, seed: int = 0, shuffle_window: int = 8,
        workers: int | None = None) -> "DataLoader":
    """The best-fit loader over pretokenized shards (python -m nanochat.pretokenize): the same
    rows, rules, state and resume as the parquet loader, with no tokenizer.

    data_dir: the pretokenize output, holding train/ and val/ with .bin/.idx pairs.
    bos_token: the id every document starts with (default: what data_dir/pretokenize.json records;
    for GPT-Simple's EOD-terminated shards, their EOD id).
    chunk_size: entries per unit dealt to ranks (1024, the parquet row group size).
    batch_size: entries added to the buffer per refill (the parquet loader's tokenizer_batch_size).
    vocab_size: every id read is checked to be below it (default: pretokenize.json's).
    Targets that predict a window's overlap with the previous window are -100.
    The other arguments: as for the parquet loader. Details: docs/pretokenized.md.
    """
    args = dict(locals())
    return make_loader(DataLoader, pretokenized_distributed_data_loader_with_state_bos_bestfit,
                       args, lambda: one_walk(_pretokenized_spec(args), resume_state_dict))


def pretokenized_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_distributed_data_loader_with_state_bos_bestfit, yielding (inputs,
    targets)."""
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False,
                                                                       **kwargs)


# -----------------------------------------------------------------------------
# The device end: what every loader function returns

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
        self.staging = [torch.empty(n, dtype=torch.long, pin_memory=self.cuda)
                        for _ in range(num_staging)]
        self.copied: list = [None] * num_staging  # CUDA events: copy from staging[i] finished
        if self.device.type == "cpu":
            self.buffer = self.staging[0]
        else:
            self.buffer = torch.empty(n, dtype=torch.long, device=self.device)
        self.count = 0

    def __call__(self, inputs: np.ndarray, targets: np.ndarray,
                 masked=()) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._next_staging()
        write_host_rows(self.staging[i].numpy(), inputs, targets, masked)
        return self._to_device(i)

    def from_host(self, host: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch a worker wrote (write_host_rows) into shared memory: on CPU, views of it
        (valid until the next batch, as the staging buffer's are); else copied as any batch."""
        BT = self.B * self.T
        if self.device.type == "cpu":
            flat = torch.from_numpy(host)
            return flat[:BT].view(self.B, self.T), flat[BT:].view(self.B, self.T)
        i = self._next_staging()
        np.copyto(self.staging[i].numpy(), host)
        return self._to_device(i)

    def _next_staging(self) -> int:
        i = self.count % len(self.staging)
        self.count += 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        return i

    def _to_device(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        BT = self.B * self.T
        if self.buffer is not self.staging[i]:
            self.buffer.copy_(self.staging[i], non_blocking=self.cuda)
            if self.cuda:
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

    def __init__(self, batches, transfer: DeviceBatches, split_rows, prefetch: int,
                 with_state: bool, *, attention_info: bool = False, cache=None,
                 start_counters: dict | None = None):
        self._batches = batches  # generator of RowBatch
        self._cache = cache  # a streaming loader's shard cache (None when not streaming)
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
        nothing = None if cache is None else 0  # (the cache is this loader's own: it starts at 0)
        self._first_mark = self._last_mark = Mark(time.perf_counter(), 0.0, 0, self._counters,
                                                   nothing, nothing)
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
            batch = next(self._source)
            self._check(batch)
        except BaseException as e:
            self._error = e
            self.close()
            raise
        self._wait_seconds += time.perf_counter() - t0
        self.documents = batch.trace
        if isinstance(self._batches, WorkerBatches):  # rows written as they are yielded
            inputs, targets = self._transfer.from_host(batch.rows)
        else:
            inputs, targets = self._transfer(*self._split_rows(batch.rows), batch.masked)
        self.stats = batch.stats | {"wait_seconds": self._wait_seconds}
        self._counters = self._packer_counters(batch)
        self._yielded += 1
        out = (inputs, targets, batch.state) if self._with_state else (inputs, targets)
        if self._attention_info:
            device = self._transfer.device
            out += ({k: torch.from_numpy(v).to(device) for k, v in batch.info.items()},)
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
        if self._cache is not None and not self._closed:  # (a closed worker has no cache to ask)
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
        return {"attention_info": self._attention_info, "streaming": self._cache is not None,
                "start_counters": self._start_counters, "extras": {}}

    @property
    def worker_pid(self) -> int | None:
        """The pid of the worker process that runs this loader's work; None: it runs here."""
        return self._batches.pid if isinstance(self._batches, WorkerBatches) else None

    def cache_status(self):
        """A streaming loader's shard cache, for a person: what is on disk against cache_limit, who
        needs which shard and why (a nanochat.data.streaming.cache_status.CacheStatus); None when
        not streaming."""
        return None if self._cache is None else self._cache.status()

    def _check(self, batch: RowBatch) -> None:
        """Called with every batch before it is yielded; raising stops the loader (the mixture
        loader's way to stop every rank at one step)."""

    def close(self) -> None:
        """Stop the background threads and end the iteration: every later next() raises
        StopIteration, as for a closed generator (a batch already prepared is dropped), or the
        failure that stopped the loader. Idempotent; returns within a second: a thread inside a long
        call (one tokenizer call) ends when that call returns, and starts no other."""
        self._closed = True
        # the shard cache first: closing it wakes a reader waiting for a shard
        if getattr(self, "_cache", None) is not None:  # (None: __init__ failed before setting it)
            self._cache.close()
        lock = getattr(self, "_lock", None)  # (None: __del__ of an object whose __init__ failed)
        with lock or contextlib.nullcontext():
            source = self._source if self._source is not None else getattr(self, "_batches", None)
        if source is not None:
            source.close()

    def __del__(self):
        batches = getattr(self, "_batches", None)  # (None: __init__ failed before setting it)
        if isinstance(batches, WorkerBatches):
            batches.close(wait=False)  # garbage collection asks a worker to stop, and goes on
        self.close()
