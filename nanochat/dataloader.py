"""
nanochat's dataloader.py: the public loaders, each call's arguments as a record, and its spec.
Parquet shards (or pretokenized ones) -> token documents -> packed rows -> the device. Read top to
bottom: each loader function records its arguments (ParquetCall, PretokenizedCall), checks every
one at the call (nanochat/data/base/checks.py), fills a LoaderSpec, and hands it to make_loader
(nanochat/data/loader/build.py), which builds the loader in a worker process or in this one.
Walk-through: docs/ARCHITECTURE.md. Resume and its states: docs/resume.md.

Imported only when needed: nanochat.data.streaming.budget (stream=True),
nanochat.data.streaming.cache (stream=True), nanochat.data.streaming.catalog (stream=True).
May import: nanochat.data.base, nanochat.data.fetch.limits, nanochat.data.loader,
nanochat.data.pretokenized.token_reader, nanochat.data.streaming.
"""

import os
from typing import Any, NamedTuple

from nanochat.data.base.checks import (Streaming, check_int, check_options, check_shuffle,
                                       check_stream, resolve_rank, resolve_tokenizer_processes,
                                       resolve_tokenizer_threads, resolve_workers)
from nanochat.data.base.packing import check_long_doc_policy
from nanochat.data.base.state import loader_config, tokenizer_fingerprint
from nanochat.data.fetch.limits import Limits
from nanochat.data.loader.build import (DataLoader, LoaderSpec, Run, Stream, make_loader,
                                        one_walk)
from nanochat.data.loader.order import ParquetReader
from nanochat.data.loader.rows import Encoder, EntryDocuments
from nanochat.data.loader.tokenize_procs import IN_FLIGHT
from nanochat.data.pretokenized.token_reader import TokenShardReader, shard_paths, shard_vocab
from nanochat.data.base.datasets import split_parquet_files

# -----------------------------------------------------------------------------
# The public loaders: nanochat's names and signatures


def tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int | None = None,
        tokenizer_batch_size: int = 128, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str | None = None, rank: int | None = None,
        world_size: int | None = None, prefetch: int = 4, with_state: bool = True,
        allow_state_mismatch: bool = False, trace_documents: bool = False,
        attention_info: bool = False, max_docs_per_row: int | None = None,
        long_doc_policy: str = "crop", split_overlap: int = 0, shuffle: bool = False,
        seed: int = 0, shuffle_window: int = 8, stream: bool | None = None,
        cache_limit: int | str | None = None, prefetch_shards: int = 2,
        num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None, workers: int | None = None,
        tokenizer_processes: int | None = None) -> "DataLoader":
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
    tokenizer_processes: processes the worker tokenizes on, each with its own copy of the
    tokenizer (0: the tokenizer's threads, tokenizer_threads of them). Default: the CPUs this rank
    may use (affinity mask / LOCAL_WORLD_SIZE) less one for the trainer, when that is at least 2.
    tokenizer_threads: on threads, how many: default, the rank's share less one, from 1 to 4.
    Batches are the same at any count (docs/loaders.md).
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
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int | None = None,
        tokenizer_batch_size: int = 128, device="cuda", resume_state_dict: dict | None = None, *,
        data_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        shuffle: bool = False, seed: int = 0, shuffle_window: int = 8,
        stream: bool | None = None, cache_limit: int | str | None = None,
        prefetch_shards: int = 2, num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None, workers: int | None = None,
        tokenizer_processes: int | None = None) -> "DataLoader":
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
    tokenizer_threads: int | None
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
    tokenizer_processes: int | None
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
    check_options(B, T, call.split, call.prefetch,
                  tokenizer_batch_size=call.tokenizer_batch_size, buffer_size=buffer_size)
    threads = resolve_tokenizer_threads(call.tokenizer_threads)  # (checked there)
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
    processes = resolve_tokenizer_processes(call.tokenizer_processes,
                                            resolve_workers(call.workers, call.prefetch))
    if settings is None:  # the shards on disk
        reader, stream = ParquetReader(split_parquet_files(call.split, call.data_dir)), None
    else:
        stream = _stream(call, settings, (rank, world_size),
                         buffer_size if kind == "bestfit" else batch_size, processes)
        reader = ParquetReader(stream.paths, stream.catalog)  # (its cache: where it is built)
    config = loader_config(kind, "parquet", call.split, reader.paths, B=B, T=T,
                           buffer_size=buffer_size, batch_size=batch_size,
                           tokenizer=tokenizer_fingerprint(tokenizer), rank=rank,
                           world_size=world_size, policy=policy, shuffle=shuffle,
                           sizes=reader.sizes)
    return LoaderSpec(kind=kind, reader=reader, encoder=Encoder(tokenizer, threads),
                      config=config, rank=rank, world_size=world_size, batch_size=batch_size,
                      B=B, T=T, buffer_size=buffer_size, shuffle=shuffle,
                      allow_state_mismatch=call.allow_state_mismatch, stream=stream,
                      prefetch=call.prefetch, with_state=call.with_state,
                      trace_documents=call.trace_documents, max_docs_per_row=max_docs,
                      tokenizer_processes=processes)


def _stream(call: ParquetCall, settings: Streaming, ranks: tuple[int, int],
            buffer_docs: int, processes: int) -> Stream:
    """A streamed split: the dataset's shards, each fetched into data_dir just before it is read,
    within the cache's budget (docs/streaming.md). ranks: (rank, world_size); buffer_docs: the
    documents a buffer holds."""
    # (late: a loader over shards on disk never loads the streaming cache, nor the downloader)
    from nanochat.data.streaming.budget import copies_estimate, read_ahead_span
    from nanochat.data.streaming.cache import local_peers
    from nanochat.data.streaming.catalog import streamed_files
    rank, world_size = ranks
    limits = Limits() if call.download_limits is None else call.download_limits
    files = streamed_files(call.split, call.data_dir, settings.num_shards, call.base_url, limits)
    catalog = files.entries
    # documents read and not yet packed, at most: the pipeline's queues, a batch in each stage's
    # hands and one more in the tokenizer's (overlap_calls), or those out to tokenizing processes
    docs = (5 * call.prefetch + 3 + IN_FLIGHT * processes) * call.tokenizer_batch_size
    return Stream(files.data_dir, files.paths, files.urls, catalog, keep=files.val, limits=limits,
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
