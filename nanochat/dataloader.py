"""
The public loaders: parquet shards (or pretokenized ones) -> token documents -> packed rows -> the
device. Read top to bottom: each loader function records its arguments (ParquetCall,
PretokenizedCall), checks every one at the call, fills a LoaderSpec, and hands it to make_loader
(nanochat/data/loader/build.py), which builds the loader in a worker process or in this one. The
argument checks and streaming's settings from the environment follow. Walk-through:
docs/ARCHITECTURE.md. Resume and its states: docs/resume.md.

May import: nanochat.common, nanochat.dataset, nanochat.data.base.checks,
nanochat.data.base.shuffle, nanochat.data.base.packing, nanochat.data.base.state,
nanochat.data.fetch.download, nanochat.data.loader.build, nanochat.data.loader.order,
nanochat.data.loader.rows, nanochat.data.pretokenized.token_reader,
nanochat.data.streaming.cache, nanochat.data.streaming.catalog.
"""

import math
import os
import re
from typing import Any, NamedTuple

from nanochat.common import get_dist_info
from nanochat.data.base.checks import check_int
from nanochat.data.base.packing import check_long_doc_policy
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.base.state import loader_config, tokenizer_fingerprint
from nanochat.data.fetch.download import Limits
from nanochat.data.loader.build import (DataLoader, LoaderSpec, Run, Stream, make_loader,
                                        one_walk)
from nanochat.data.loader.order import ParquetReader
from nanochat.data.loader.rows import Encoder, EntryDocuments
from nanochat.data.pretokenized.token_reader import TokenShardReader, shard_paths, shard_vocab
from nanochat.data.streaming.cache import local_peers
from nanochat.data.streaming.catalog import copies_estimate, read_ahead_span, streamed_files
from nanochat.dataset import SPLITS, split_parquet_files

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
    call = ParquetCall(**locals())
    return make_loader(DataLoader, checked_run(call),
                       lambda: one_walk(_tokenizing_spec("bestfit", call), resume_state_dict))


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
    call = ParquetCall(**locals())
    return make_loader(DataLoader, checked_run(call),
                       lambda: one_walk(_tokenizing_spec("concat", call), resume_state_dict))


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
    call = PretokenizedCall(**locals())
    return make_loader(DataLoader, checked_run(call),
                       lambda: one_walk(_pretokenized_spec(call), resume_state_dict))


def pretokenized_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_distributed_data_loader_with_state_bos_bestfit, yielding (inputs,
    targets)."""
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False,
                                                                       **kwargs)


# -----------------------------------------------------------------------------
# What a call records, and where it runs


class ParquetCall(NamedTuple):
    """The arguments of a tokenizing loader call (best-fit or concatenating), by name."""
    tokenizer: Any
    B: int
    T: int
    split: str
    tokenizer_threads: int
    tokenizer_batch_size: int
    device: Any
    resume_state_dict: dict | None
    data_dir: str | None
    rank: int | None
    world_size: int | None
    prefetch: int
    with_state: bool
    allow_state_mismatch: bool
    shuffle: bool
    seed: int
    shuffle_window: int
    stream: bool | None
    cache_limit: int | str | None
    prefetch_shards: int
    num_shards: int | None
    base_url: str | None
    download_limits: Limits | None
    workers: int | None
    # the best-fit loader's own (the concatenating loader has none of these)
    buffer_size: int | None = None
    trace_documents: bool = False
    attention_info: bool = False
    max_docs_per_row: int | None = None
    long_doc_policy: str = "crop"
    split_overlap: int = 0


class PretokenizedCall(NamedTuple):
    """The arguments of a pretokenized loader call, by name."""
    B: int
    T: int
    split: str
    device: Any
    resume_state_dict: dict | None
    buffer_size: int
    data_dir: str
    bos_token: int | None
    chunk_size: int
    batch_size: int
    rank: int | None
    world_size: int | None
    prefetch: int
    with_state: bool
    allow_state_mismatch: bool
    trace_documents: bool
    attention_info: bool
    max_docs_per_row: int | None
    long_doc_policy: str
    split_overlap: int
    vocab_size: int | None
    shuffle: bool
    seed: int
    shuffle_window: int
    workers: int | None


def checked_run(call) -> Run:
    """Where a call's loader runs (workers: the argument or NANOCHAT_LOADER_WORKERS), and what it
    yields; with a worker, the arguments that size its shared memory are checked at once."""
    workers = resolve_workers(call.workers, call.prefetch)
    if workers:  # (B, T: its size)
        check_options(call.B, call.T, call.split, call.prefetch)
    return Run(call.B, call.T, call.split, call.device, call.prefetch, call.with_state, workers)


# -----------------------------------------------------------------------------
# The spec of a call, every argument checked first


def _tokenizing_spec(kind: str, call: ParquetCall) -> LoaderSpec:
    """The spec of a tokenizing loader (best-fit or concatenating), every argument checked first, so
    that bad input fails at the call and not inside a thread or after fetching has started."""
    B, T, buffer_size, tokenizer = call.B, call.T, call.buffer_size, call.tokenizer
    shuffle = check_shuffle(call.shuffle, call.seed, call.shuffle_window)
    settings = check_stream(call.stream, call.cache_limit, call.prefetch_shards, call.num_shards,
                            shuffle)
    max_docs = _max_docs(call.attention_info, call.max_docs_per_row, T)
    check_options(B, T, call.split, call.prefetch, tokenizer_threads=call.tokenizer_threads,
                  tokenizer_batch_size=call.tokenizer_batch_size, buffer_size=buffer_size)
    policy = None
    if kind == "bestfit":
        if buffer_size is None:
            raise ValueError("buffer_size must be an integer >= 1")
        policy = (call.long_doc_policy, call.split_overlap)
        check_long_doc_policy(*policy, T)
    for method in ("get_bos_token_id", "encode"):
        if not callable(getattr(tokenizer, method, None)):
            raise TypeError(f"tokenizer must have a {method}() method, got "
                            f"{type(tokenizer).__name__}")
    rank, world_size = resolve_rank(call.rank, call.world_size)
    batch_size = call.tokenizer_batch_size
    if settings is None:  # the shards on disk
        reader, stream = ParquetReader(split_parquet_files(call.split, call.data_dir)), None
    else:
        stream = _stream(call, settings, (rank, world_size),
                         buffer_size if kind == "bestfit" else batch_size)
        reader = ParquetReader(stream.paths, stream.catalog)  # (its cache: where it is built)
    config = loader_config(kind, "parquet", call.split, reader.paths, B=B, T=T,
                           buffer_size=buffer_size, batch_size=batch_size,
                           tokenizer=tokenizer_fingerprint(tokenizer), rank=rank,
                           world_size=world_size, policy=policy, shuffle=shuffle,
                           sizes=reader.sizes)
    return LoaderSpec(kind=kind, reader=reader, encoder=Encoder(tokenizer, call.tokenizer_threads),
                      config=config, rank=rank, world_size=world_size, batch_size=batch_size,
                      B=B, T=T, buffer_size=buffer_size, shuffle=shuffle,
                      allow_state_mismatch=call.allow_state_mismatch, stream=stream,
                      prefetch=call.prefetch, with_state=call.with_state,
                      trace_documents=call.trace_documents, max_docs_per_row=max_docs)


def _stream(call: ParquetCall, settings: "Streaming", ranks: tuple[int, int],
            buffer_docs: int) -> Stream:
    """A streamed split: the dataset's shards, each fetched into data_dir just before it is read,
    within the cache's budget (docs/streaming.md). ranks: (rank, world_size); buffer_docs: the
    documents a buffer holds."""
    rank, world_size = ranks
    limits = Limits() if call.download_limits is None else call.download_limits
    data_dir, paths, urls, val, catalog = streamed_files(
        call.split, call.data_dir, settings.num_shards, call.base_url, limits)
    # documents read and not yet packed, at most: the pipeline's queues, a batch in each stage's
    # hands and one more in the tokenizer's (overlap_calls)
    docs = (5 * call.prefetch + 3) * call.tokenizer_batch_size
    return Stream(data_dir, paths, urls, catalog, keep=val, limits=limits,
                  prefetch_shards=settings.prefetch_shards, cache_limit=settings.cache_limit,
                  prefetch=call.prefetch, copies=copies_estimate(catalog, buffer_docs),
                  # (every local rank's: they share the cache, and the one whose shards hold
                  # fewest of its documents spans the most)
                  packing=read_ahead_span(catalog, local_peers(rank, world_size), world_size,
                                          docs),
                  read_ahead=docs)


def _pretokenized_spec(call: PretokenizedCall) -> LoaderSpec:
    """The spec of the pretokenized loader, every argument checked first."""
    B, T, split, chunk_size = call.B, call.T, call.split, call.chunk_size
    buffer_size, batch_size = call.buffer_size, call.batch_size
    policy = (call.long_doc_policy, call.split_overlap)
    check_options(B, T, split, call.prefetch, buffer_size=buffer_size, chunk_size=chunk_size,
                  batch_size=batch_size)
    check_long_doc_policy(*policy, T)
    shuffle = check_shuffle(call.shuffle, call.seed, call.shuffle_window)
    rank, world_size = resolve_rank(call.rank, call.world_size)
    data_dir = os.path.expanduser(os.fspath(call.data_dir))
    paths = shard_paths(data_dir, split)
    vocab = shard_vocab(paths[0], call.bos_token, call.vocab_size, [data_dir])
    config = loader_config("bestfit", "pretokenized", split, paths, B=B, T=T,
                           buffer_size=buffer_size, batch_size=batch_size,
                           tokenizer=f"bos:{vocab.bos_token}", rank=rank, world_size=world_size,
                           chunk_size=chunk_size, policy=policy, shuffle=shuffle)
    max_docs = _max_docs(call.attention_info, call.max_docs_per_row, T)
    encoder = EntryDocuments(vocab.bos_token, always=vocab.convention == "gpt-simple")
    return LoaderSpec(kind="bestfit", reader=TokenShardReader(paths, chunk_size, vocab),
                      encoder=encoder, config=config, rank=rank, world_size=world_size,
                      batch_size=batch_size, B=B, T=T, buffer_size=buffer_size,
                      shuffle=shuffle, allow_state_mismatch=call.allow_state_mismatch,
                      prefetch=call.prefetch, with_state=call.with_state,
                      trace_documents=call.trace_documents, max_docs_per_row=max_docs)


def _max_docs(attention_info: bool, max_docs_per_row: int | None, T: int) -> int | None:
    if not attention_info:
        return None
    if max_docs_per_row is None:
        return T  # every document has at least its BOS in the inputs: never more than T per row
    return check_int("max_docs_per_row", max_docs_per_row, 1)


# -----------------------------------------------------------------------------
# The argument checks, and streaming's settings from the environment



def check_options(B, T, split, prefetch, **more) -> None:
    """The arguments every loader takes; `more`: other counts that must be >= 1 (None: not
    given)."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    check_int("B", B, 1)
    check_int("T", T, 1)
    for name, value in more.items():
        if value is not None:  # not given: the loader's default
            check_int(name, value, 1)
    check_int("prefetch", prefetch, 0, hint=" (0 = no background threads)")


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size), each defaulting to torchrun's RANK / WORLD_SIZE, checked."""
    if rank is None or world_size is None:  # (the environment is read only for a default)
        _, env_rank, _, env_world_size = get_dist_info()
        rank = env_rank if rank is None else rank
        world_size = env_world_size if world_size is None else world_size
    world_size = check_int("world_size", world_size, 1)
    return check_int("rank", rank, 0, world_size - 1), world_size


def resolve_workers(workers: int | None, prefetch: int) -> int:
    """Worker processes a loader runs in: the argument, else NANOCHAT_LOADER_WORKERS, else 1; none
    when prefetch=0 (everything in the caller)."""
    if workers is None:
        value = os.environ.get("NANOCHAT_LOADER_WORKERS") or "1"
        if value not in ("0", "1"):
            raise ValueError(f"NANOCHAT_LOADER_WORKERS must be 0 or 1, got {value!r}")
        workers = int(value)
    check_int("workers", workers, 0, 1, hint=" (0 = the loader's threads run in this process)")
    # (a bad prefetch is refused by check_options, in this process)
    return workers if isinstance(prefetch, int) and prefetch > 0 else 0


def check_shuffle(shuffle, seed, shuffle_window, bucket: str = "") -> Shuffle | None:
    """The Shuffle of a loader's shuffle=, seed=, shuffle_window= arguments (None: not shuffled)."""
    if not isinstance(shuffle, bool):  # "false" is truthy: only a bool says what was meant
        raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
    seed = check_int("seed", seed)
    shuffle_window = check_int("shuffle_window", shuffle_window, 1)
    return Shuffle(seed, shuffle_window, bucket) if shuffle else None


# -----------------------------------------------------------------------------
# Streaming from the hub (stream=True): the settings, from the arguments or the environment

# decimal units are powers of 10 (a disk's "GB"), binary ones powers of 2
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "cache_limit") -> int:
    """Bytes from an int or a string such as "20GB", "500 MB", "1.5TiB"."""
    given = value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be a number of bytes or a string like '20GB', got {value!r}")
    if isinstance(value, str):
        # a number, an optional fraction, then a unit (case ignored); spaces anywhere between
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r}: expected bytes or a size like "
                             "'20GB', '500MB', '1.5TiB'")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    # nan and inf (an int cannot hold them), or a string of 309 digits (a float's inf)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of bytes, got {given!r}: pass a size "
                         "like '20GB', or leave it unset for no limit")
    if value <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return int(value)


class Streaming(NamedTuple):
    cache_limit: int | None  # bytes; None: no limit
    prefetch_shards: int
    num_shards: int | None  # train shards of the dataset; None: all


def _env(name: str) -> str | None:
    return os.environ.get(name) or None  # an empty variable counts as unset


def check_stream(stream, cache_limit, prefetch_shards, num_shards, shuffle) -> Streaming | None:
    """A parquet loader's streaming settings (None: it reads the shards on disk). stream=None reads
    NANOCHAT_STREAM (1 or 0), cache_limit=None NANOCHAT_CACHE_LIMIT, num_shards=None
    NANOCHAT_STREAM_SHARDS."""
    if stream is None:
        value = _env("NANOCHAT_STREAM") or "0"
        if value not in ("0", "1"):
            raise ValueError(f"NANOCHAT_STREAM must be 1 (stream the shards) or 0, got {value!r}")
        stream = value == "1"
    if not isinstance(stream, bool):
        raise ValueError(f"stream must be True, False or None (NANOCHAT_STREAM), got {stream!r}")
    if not stream:
        return None
    if shuffle:
        raise ValueError("stream=True reads the shards in file order, fetching each just before "
                         "it is read; shuffle=True reads a row group of every shard in turn, "
                         "which needs them all on disk. The hosted shards are shuffled already: "
                         "pass shuffle=False, or fetch the shards first "
                         "(python -m nanochat.dataset -n N) and read them without stream")
    if cache_limit is None and _env("NANOCHAT_CACHE_LIMIT"):
        cache_limit = parse_bytes(_env("NANOCHAT_CACHE_LIMIT"), "NANOCHAT_CACHE_LIMIT")
    elif cache_limit is not None:
        cache_limit = parse_bytes(cache_limit)
    prefetch_shards = check_int("prefetch_shards", prefetch_shards, 0,
                                hint=" (shards fetched ahead)")
    if num_shards is None and _env("NANOCHAT_STREAM_SHARDS"):
        value = _env("NANOCHAT_STREAM_SHARDS")
        if not value.isdigit():  # a count: no sign, no fraction, no unit
            raise ValueError("NANOCHAT_STREAM_SHARDS must be a number of train shards, "
                             f"got {value!r}")
        num_shards = int(value)
    return Streaming(cache_limit, prefetch_shards, num_shards)
