"""
Distributed data loaders: parquet shards -> token documents -> packed rows -> device.

    for inputs, targets, state_dict in tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, B, T, "train", device="cuda"):
        ...  # inputs, targets: (B, T) int64 on the device

This module composes the stages; each lives in its own module:
  1. documents (nanochat/readers.py, nanochat/stream.py): the split's shards, units (row groups, or
     chunks of pretokenized shards) rank, rank+world_size, ... (DDP sharding), cut into batches of
     `tokenizer_batch_size` documents, forever (epochs count from 1);
  2. tokens (nanochat/tokens.py): `tokenizer.encode(texts, prepend=bos)` -> numpy documents (2
     bytes/token when the vocabulary allows);
  3. packed rows (nanochat/rows.py over the pure nanochat/packing.py): best-fit BOS-aligned rows (long
     documents cropped as the seeds do, or split into BOS-led pieces: long_doc_policy), or the
     concatenated stream, with the state of each batch (format: nanochat/state.py);
  4. device (nanochat/device.py): one pinned `[inputs | targets]` staging buffer -> one non-blocking
     copy to the device.
Reading, tokenizing and packing each run ahead on a background thread (`prefetch`,
nanochat/prefetch.py), so they overlap with each other and with the training step; the state yielded
with a batch describes what that batch consumed, never what was read ahead.

The yielded tensors are views into one device buffer that the next batch overwrites (in stream
order on CUDA, so a training step that has already been queued is safe); clone them to keep them.

`state_dict` is the exact position of the stream: passed back as `resume_state_dict`, it makes a new
loader yield the very batches the uninterrupted run would have. It keeps nanochat's keys {"pq_idx",
"rg_idx", "epoch"} (the last document batch consumed), and a dict with only those keys still resumes
approximately, after that row group, as nanochat does.

May import: the stage modules (nanochat.readers, nanochat.shard_cache, nanochat.stream, nanochat.tokens,
nanochat.rows, nanochat.packing, nanochat.state, nanochat.prefetch, nanochat.device), nanochat.options,
nanochat.dataset, nanochat.download.
"""

import os

from nanochat.dataset import split_parquet_files
from nanochat.device import DataLoader, DeviceBatches, row_split
from nanochat.download import Limits
from nanochat.options import check_options, check_positive, check_shuffle, check_stream, resolve_rank
from nanochat.packing import check_long_doc_policy
from nanochat.prefetch import EXIT_TIMEOUT, maybe_prefetch  # noqa: F401 (EXIT_TIMEOUT: the README shows it here)
from nanochat.readers import ParquetReader, ShardReader, shard_paths, shard_vocab
from nanochat.rows import Tracker, bestfit_batches, concat_batches
from nanochat.shard_cache import ShardCache, copies_estimate, packing_shards, streamed_files
from nanochat.state import decode_keys, stream_config, tokenizer_fingerprint
from nanochat.stream import start_stream
from nanochat.tokens import Encoder, ShardDocs, token_batches


def _pipeline(doc_batches, encoder, prefetch: int, pack, tokenizing: bool = True):
    """Reading, tokenizing and packing, each on its own thread when prefetch > 0: reading runs a few
    row groups ahead of the tokenizer (so its pool never waits on parquet), tokenizing `prefetch`
    document batches ahead of packing. Yields what `pack(token_batches)` yields. Without a tokenizer
    (pretokenized shards) reading is a slice of a memory map: it stays on the packing thread, since
    handing each batch between threads would cost more than the work."""
    depth = prefetch if tokenizing else 0
    stages = []  # a prefetcher closes its source itself, on its thread (which may still be running it)
    try:
        stages.append(maybe_prefetch(doc_batches, 4 * depth, "nanochat-read"))
        overlap_calls = depth > 0 and getattr(encoder, "thread_safe", False)
        stages.append(maybe_prefetch(token_batches(stages[-1], encoder, overlap_calls), depth, "nanochat-tokenize"))
        yield from pack(stages[-1])
    finally:
        for stage in reversed(stages):  # downstream first: it may be waiting on the one before
            stage.close()


def _parquet_reader(split, data_dir, rank, world_size, prefetch, buffer_docs, read_ahead, streaming, base_url,
                    download_limits):
    """(reader, shard cache or None) of a split's parquet shards: those on disk, or (streaming) the dataset's,
    each fetched just before it is read (nanochat/shard_cache.py)."""
    if streaming is None:
        return ParquetReader(split_parquet_files(split, data_dir)), None
    limits = Limits() if download_limits is None else download_limits
    data_dir, paths, urls, val, catalog = streamed_files(split, data_dir, streaming.num_shards, base_url, limits)
    cache = ShardCache(data_dir, [os.path.basename(path) for path in paths], urls, [entry["size"] for entry in catalog],
                       limits=limits, keep=val, prefetch_shards=streaming.prefetch_shards,
                       cache_limit=streaming.cache_limit, prefetch=prefetch,
                       copies=copies_estimate(catalog, buffer_docs),
                       packing=packing_shards(catalog, rank, world_size, read_ahead))
    return ParquetReader(paths, catalog, cache), cache


def _setup(kind, tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict,
           data_dir, rank, world_size, prefetch, allow_state_mismatch, shuffle, streaming, buffer_size=None,
           policy=None):
    """Validate everything up front (so bad input fails at the call, not deep in a thread), then
    build the document stream and the state tracker, resuming if asked; streaming (settings, base_url,
    download limits): start fetching what the stream reads first, the buffered documents' shards first.
    Returns (document batches, tracker, seeds position, shard cache or None)."""
    check_options(B, T, split, prefetch, tokenizer_threads=tokenizer_threads,
                  tokenizer_batch_size=tokenizer_batch_size, buffer_size=buffer_size)
    if buffer_size is None and kind == "bestfit":
        raise ValueError("buffer_size must be an integer >= 1")
    if policy is not None:
        check_long_doc_policy(*policy, T)
    for method in ("get_bos_token_id", "encode"):
        if not callable(getattr(tokenizer, method, None)):
            raise TypeError(f"tokenizer must have a {method}() method, got {type(tokenizer).__name__}")
    rank, world_size = resolve_rank(rank, world_size)
    buffer_docs = buffer_size if kind == "bestfit" else tokenizer_batch_size  # (what a state's buffer holds)
    # documents read and not yet packed, at most: the queues of _pipeline, a batch in each stage's hands and one
    # more in the tokenizer's (overlap_calls)
    read_ahead = (5 * prefetch + 3) * tokenizer_batch_size
    reader, cache = _parquet_reader(split, data_dir, rank, world_size, prefetch, buffer_docs, read_ahead, *streaming)
    encoder = Encoder(tokenizer, tokenizer_threads)
    config = stream_config(kind, "parquet", split, reader.paths, B, T, buffer_size, tokenizer_batch_size,
                           tokenizer_fingerprint(tokenizer), rank, world_size, policy=policy, shuffle=shuffle,
                           sizes=reader.sizes)
    stream, start, position = start_stream(reader, rank, world_size, tokenizer_batch_size, resume_state_dict,
                                           config, allow_state_mismatch, shuffle=shuffle)
    if cache is not None:
        cache.start(stream.file_order(), buffered=decode_keys(start["buffer"]) if start else ())
    return stream.batches(), Tracker(kind, stream, encoder, config, start, cache and cache.hold), position, cache


def _max_docs(attention_info: bool, max_docs_per_row: int | None, T: int) -> int | None:
    if not attention_info:
        return None
    if max_docs_per_row is None:
        return T  # every document has at least its BOS in the inputs: never more than T per row
    check_positive(max_docs_per_row=max_docs_per_row)
    return max_docs_per_row


def tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, buffer_size: int = 1000, *,
        data_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        trace_documents: bool = False, attention_info: bool = False, max_docs_per_row: int | None = None,
        long_doc_policy: str = "crop", split_overlap: int = 0, shuffle: bool = False, seed: int = 0,
        shuffle_window: int = 8, stream: bool | None = None, cache_limit: int | str | None = None,
        prefetch_shards: int = 2, num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None) -> DataLoader:
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
    shuffle: read each epoch's row groups in a seeded order (a permutation dealt to the ranks), and the
    documents of every shuffle_window row groups of a rank's share in a seeded order (default: file order,
    as the seeds; for shards that are not shuffled already). seed: picks both orders.
    stream: fetch the dataset's shards while training, each just before it is read, through the downloader
    (default: NANOCHAT_STREAM=1; not with shuffle). data_dir is then the cache; cache_limit (bytes or e.g.
    "20GB", default NANOCHAT_CACHE_LIMIT, else none) bounds its shards; prefetch_shards are fetched ahead;
    num_shards (default NANOCHAT_STREAM_SHARDS, else all) train shards make the split; base_url (default
    NANOCHAT_DATA_URL, else the hub) serves them; download_limits: the downloader's retries and time bounds.
    Batches and states are those of a loader over the same shards on disk (see nanochat/shard_cache.py).
    """
    order = check_shuffle(shuffle, seed, shuffle_window)
    streaming = (check_stream(stream, cache_limit, prefetch_shards, num_shards, order), base_url, download_limits)
    max_docs = _max_docs(attention_info, max_docs_per_row, T)  # (every check before _setup starts fetching)
    doc_batches, tracker, position, cache = _setup(
        "bestfit", tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict, data_dir,
        rank, world_size, prefetch, allow_state_mismatch, order, streaming, buffer_size=buffer_size,
        policy=(long_doc_policy, split_overlap))
    batches = _pipeline(doc_batches, tracker.encoder, prefetch, lambda tokens: bestfit_batches(
        tokens, tracker, position, B, T, buffer_size, trace_documents, max_docs))
    return DataLoader(batches, DeviceBatches(B, T, device), row_split, prefetch, with_state, attention_info, cache)


def tokenizing_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


def tokenizing_distributed_data_loader_with_state(
        tokenizer, B: int, T: int, split: str, tokenizer_threads: int = 4, tokenizer_batch_size: int = 128,
        device="cuda", resume_state_dict: dict | None = None, *, data_dir: str | None = None,
        rank: int | None = None, world_size: int | None = None, prefetch: int = 4,
        with_state: bool = True, allow_state_mismatch: bool = False, shuffle: bool = False, seed: int = 0,
        shuffle_window: int = 8, stream: bool | None = None, cache_limit: int | str | None = None,
        prefetch_shards: int = 2, num_shards: int | None = None, base_url: str | None = None,
        download_limits: Limits | None = None) -> DataLoader:
    """The older concatenating loader: documents back to back (each after its BOS), each batch the
    next B*T+1 tokens of the stream (inputs the first B*T, targets the last B*T), advancing by B*T: the
    last target of a batch is the first input of the next, and no token is skipped. Wastes nothing,
    but rows start mid-document and attend across unrelated documents; for small data or very long
    documents. Yields (inputs, targets, state_dict).

    stats: tokens_emitted counts tokens consumed, B*T per batch (each token of the stream once, as an
    input); buffer_tokens those tokenized and not yet consumed (a batch's last target among them), so
    tokens_tokenized == tokens_emitted + buffer_tokens. The state's emitted["tokens"] counts the
    B*T+1 tokens of every batch that its hash covers. shuffle, seed, shuffle_window, stream, cache_limit,
    prefetch_shards, num_shards, base_url, download_limits: as for the best-fit loader."""
    order = check_shuffle(shuffle, seed, shuffle_window)
    streaming = (check_stream(stream, cache_limit, prefetch_shards, num_shards, order), base_url, download_limits)
    doc_batches, tracker, position, cache = _setup(
        "concat", tokenizer, B, T, split, tokenizer_threads, tokenizer_batch_size, resume_state_dict, data_dir,
        rank, world_size, prefetch, allow_state_mismatch, order, streaming)
    batches = _pipeline(doc_batches, tracker.encoder, prefetch,
                        lambda tokens: concat_batches(tokens, tracker, position, B, T, False))
    return DataLoader(batches, DeviceBatches(B, T, device),
                      lambda flat: (flat[:-1].reshape(B, T), flat[1:].reshape(B, T)), prefetch, with_state,
                      also_close=cache)


def tokenizing_distributed_data_loader(*args, **kwargs):
    """Like tokenizing_distributed_data_loader_with_state, yielding (inputs, targets)."""
    return tokenizing_distributed_data_loader_with_state(*args, with_state=False, **kwargs)


# -----------------------------------------------------------------------------
# The pretokenized loader: .bin/.idx token shards (nanochat/token_shards.py), no tokenizer in the loop


def pretokenized_distributed_data_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str, bos_token: int | None = None, chunk_size: int = 1024,
        batch_size: int = 128, rank: int | None = None, world_size: int | None = None, prefetch: int = 4,
        with_state: bool = True, allow_state_mismatch: bool = False, trace_documents: bool = False,
        attention_info: bool = False, max_docs_per_row: int | None = None, long_doc_policy: str = "crop",
        split_overlap: int = 0, vocab_size: int | None = None, shuffle: bool = False, seed: int = 0,
        shuffle_window: int = 8) -> DataLoader:
    """The best-fit loader over pretokenized shards (`python -m nanochat.pretokenize`): the same
    rows, rules, state and resume (exact and elastic) as the parquet loader, with no tokenizer.

    data_dir: the pretokenize output, holding train/ and val/ with .bin/.idx pairs.
    bos_token: the id every document starts with, prepended to each entry that does not start with it
    (default: what data_dir/pretokenize.json records, the BOS, or the EOD of --convention gpt-simple
    shards, prepended to every entry; with no such file a ValueError: pass it, for GPT-Simple's own
    EOD-terminated shards their EOD id).
    chunk_size: entries per unit dealt to ranks (1024 = the parquet shards' row group size, so that
    with windowing off this yields the parquet loader's batches).
    batch_size: entries added to the buffer per refill (the parquet loader's tokenizer_batch_size).
    Targets that predict a window's overlap with the previous window are -100.
    long_doc_policy, split_overlap: as for the parquet loader (windows longer than a row are split).
    vocab_size: the tokenizer's vocabulary size (default: what data_dir/pretokenize.json records; when
    both are given they must agree). Every id read is checked to be below it, a chunk at a time, so a
    damaged shard is a ValueError naming the shard and entry, not a device-side assert in the
    embedding. With neither, a warning, and ids are only bounded by the shards' dtype.
    shuffle: read each epoch's chunks in a seeded order (a permutation dealt to the ranks), and the entries
    of every shuffle_window chunks of a rank's share in a seeded order, so that the windows of one long
    document land far apart (default: file order). seed: picks both orders. The state stays a position.
    """
    check_options(B, T, split, prefetch, buffer_size=buffer_size, chunk_size=chunk_size, batch_size=batch_size)
    check_long_doc_policy(long_doc_policy, split_overlap, T)
    order = check_shuffle(shuffle, seed, shuffle_window)
    rank, world_size = resolve_rank(rank, world_size)
    data_dir = os.path.expanduser(os.fspath(data_dir))
    paths = shard_paths(data_dir, split)
    vocab = shard_vocab(paths[0], bos_token, vocab_size, [data_dir])
    bos_token = vocab.bos_token
    reader = ShardReader(paths, chunk_size, vocab)
    encoder = ShardDocs(bos_token, always=vocab.convention == "gpt-simple")
    config = stream_config("bestfit", "pretokenized", split, paths, B, T, buffer_size, batch_size, f"bos:{bos_token}",
                           rank, world_size, chunk_size=chunk_size, policy=(long_doc_policy, split_overlap),
                           shuffle=order)
    stream, start, position = start_stream(reader, rank, world_size, batch_size, resume_state_dict, config,
                                           allow_state_mismatch, shuffle=order)
    tracker = Tracker("bestfit", stream, encoder, config, start)
    max_docs = _max_docs(attention_info, max_docs_per_row, T)
    batches = _pipeline(stream.batches(), encoder, prefetch, lambda tokens: bestfit_batches(
        tokens, tracker, position, B, T, buffer_size, trace_documents, max_docs), tokenizing=False)
    return DataLoader(batches, DeviceBatches(B, T, device), row_split, prefetch, with_state, attention_info)


def pretokenized_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_distributed_data_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)
