"""
One input (a parquet shard or a jsonl file) tokenized into its .bin/.idx pair.
Tokenize one input (a parquet shard or a jsonl file) into its .bin/.idx pair, under the pair's
lock: a store's shard is downloaded and verified first and removed once its pair is written; a bad
input fails alone. The tokenizer is the caller's (anything with encode_to_arrays,
get_vocab_size and get_bos_token_id). Cost: one tokenizer pass over the input.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.processing.inputs,
nanochat.data.processing.parts, nanochat.data.pretokenized.token_shards,
nanochat.data.processing.windows.
"""

import logging
import os
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from filelock import FileLock

from nanochat.data.fetch.address import redact
from nanochat.data.fetch.errors import DownloadError
from nanochat.data.fetch.download import download_file
from nanochat.data.fetch.records import lock_path, record_path
from nanochat.data.base.files import remove_if_exists
from nanochat.data.base.layout import part_name, whole_name
from nanochat.data.processing.inputs import PairToWrite, is_store, unit_name
from nanochat.data.processing.parts import plain_copy, text_batches
from nanochat.data.pretokenized.token_shards import CONVENTIONS, write_token_pairs
from nanochat.data.processing.windows import window_document, window_gpt_simple

logger = logging.getLogger(__name__)


class PairResult(NamedTuple):
    """What became of one unit of work."""
    source: str  # its input, and which part of it: "a.jsonl (part 2 of 4)"
    stats: dict | None  # pretokenize_file's counts; None: not written by this call
    error: str | None  # why the input failed; None with stats None: another run wrote the pair


def write_pair(tokenizer, options: dict, pair: PairToWrite) -> PairResult:
    """Write one pair (options: pretokenize_file's keyword arguments): its counts, the error of a
    bad input (it fails alone), or neither when another run on this output wrote it meanwhile."""
    path, prefix, staged, part, parts = pair
    source = unit_name(pair)
    try:
        # no timeout: the holder is a live process writing this pair (the lock ends with it)
        with pair_lock(prefix):
            # written while we waited; the output is deterministic, so it is the pair we would write
            if os.path.exists(prefix + ".idx"):
                _unstage(pair)
                return PairResult(source, None, None)
            if staged is not None and is_store(path):  # a verified copy (a rerun may find one)
                download_file(path, staged, progress=False)
            elif staged is not None:  # a part of a .jsonl.gz reads its plain copy
                plain_copy(path, staged)
            stats = pretokenize_file(tokenizer, path if staged is None else staged, prefix,
                                     part=part, parts=parts, **options)
            _unstage(pair)
            return PairResult(source, stats, None)
    # BadGzipFile is an OSError, and so is a store's error
    except (ValueError, OSError, EOFError, pa.ArrowException, DownloadError) as e:
        return PairResult(source, None, f"{type(e).__name__}: {redact(str(e))}")


def pair_lock(prefix: str) -> FileLock:
    """The lock a writer holds while it writes the pair at prefix. Runs on one output at once (a
    plain run and the ranks of a --world-size N run) may have a pair in common, and would share its
    temporary files. A hidden name beside the pair, .<name>.lock, that no listing of pairs matches;
    left in place, since removing a lock file another process may be waiting on would let a third
    take a new one."""
    directory, name = os.path.split(prefix)
    os.makedirs(directory or ".", exist_ok=True)
    return FileLock(os.path.join(directory, f".{name}.lock"))


def pretokenize_file(tokenizer, path: str, prefix: str, *, max_length: int | None = None,
                     overlap: int = 0, text_field: str = "text", num_threads: int = 4,
                     convention: str = "nanochat", part: int = 0, parts: int = 1) -> dict:
    """Tokenize one input shard (or its part `part` of `parts`: parts.py) into the pair at prefix;
    returns counts {documents, entries, tokens, windowed} (windowed: documents longer than
    max_length, cut into windows). convention
    "nanochat": an entry is [BOS] + the document; "gpt-simple": the document + EOD, where EOD is the
    tokenizer's BOS id (nanochat has no end-of-text token: <|bos|> is its document delimiter)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {list(CONVENTIONS)}, got {convention!r}")
    # 2 bytes a token while every id fits; the format's dtype codes allow only uint16 and uint32
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    bos = tokenizer.get_bos_token_id()
    gpt_simple = convention == "gpt-simple"
    eod = np.array([bos], dtype=dtype)
    window = window_gpt_simple if gpt_simple else window_document
    stats = {"documents": 0, "entries": 0, "tokens": 0, "windowed": 0}

    def pairs():  # a generator: one batch of documents in memory at a time, not the whole shard
        for texts in text_batches(path, text_field, part, parts):
            docs = tokenizer.encode_to_arrays(texts, prepend=None if gpt_simple else bos,
                                              num_threads=num_threads)
            for doc in docs:
                if gpt_simple:
                    doc = np.concatenate((doc, eod))
                windows = [(doc, 0)] if max_length is None else window(doc, max_length, overlap)
                stats["documents"] += 1
                stats["windowed"] += int(len(windows) > 1)
                for entry, overlap_prefix in windows:
                    stats["entries"] += 1
                    stats["tokens"] += len(entry)
                    yield entry.astype(dtype, copy=False), overlap_prefix

    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    write_token_pairs(prefix, pairs(), dtype)
    logger.info("%s -> %s: %d documents, %d entries, %d tokens", path, prefix, stats["documents"],
                stats["entries"], stats["tokens"])
    return stats


def _unstage(pair: PairToWrite) -> None:
    """Remove the staged copy of a unit's input (a store's shard, a split .jsonl.gz's plain copy)
    once every pair made from it is written: the pairs are the product, and a rerun skips them, so
    the copy would not be read again. Its lock goes too: only the input's writers take it, and they
    are done."""
    if pair.staged is None:
        return
    # (a whole input's one pair was just written or found: only a split's siblings are looked at)
    directory, name = os.path.split(pair.prefix)
    if pair.parts == 1 or all(
            os.path.exists(os.path.join(directory, part_name(whole_name(name), k, pair.parts))
                           + ".idx") for k in range(pair.parts)):
        for path in (pair.staged, record_path(pair.staged), lock_path(pair.staged)):
            remove_if_exists(path)
