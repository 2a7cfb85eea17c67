"""
Tokenize parquet shards or jsonl files once, into the `.bin`/`.idx` pairs of token_shards.py.
Training then memory-maps tokens, decoding no parquet and running no tokenizer. Long documents may
be cut into overlapping windows: nanochat's ([BOS] + document) or GPT-Simple's (document + EOD).

    python -m nanochat.pretokenize --input DATA_DIR --output DATA_DIR_tokens --num-workers 8

--input may also be a store's address (s3://bucket/prefix, gs://, az://, hf://): each shard is
downloaded and verified into OUTPUT/.inputs/, tokenized, and removed once its pair is written.
Cost: one tokenizer pass, several MB of text per second per worker; a rerun skips written pairs.
Design: docs/pretokenized.md, docs/streaming.md (stores)

May import: nanochat.common, nanochat.tokenizer, nanochat.data.base, nanochat.data.fetch,
nanochat.data.pretokenized, nanochat.data.loader.parquet_files.
"""

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from filelock import FileLock, Timeout

from nanochat.data.fetch import stores
from nanochat.data.base.cli import run
from nanochat.common import get_dist_info
from nanochat.data.base.parquet import open_parquet, read_row_group_texts
from nanochat.data.fetch.listing import read_listing
from nanochat.data.fetch.repackage import read_jsonl_texts
from nanochat.data.loader.parquet_files import split_parquet_files
from nanochat.data.fetch.download import download_file
from nanochat.data.fetch.errors import DownloadError
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.records import lock_path, record_path
from nanochat.data.base.files import progress_bar, remove_if_exists
from nanochat.data.pretokenized.layout import check_kind
from nanochat.data.base.packing import next_cut
from nanochat.tokenizer import TOKENIZER_FILENAME, RustBPETokenizer, get_tokenizer_dir
from nanochat.data.pretokenized.token_shards import (CONVENTIONS, MAGIC, MAX_OVERLAP, META_FILENAME,
                                                     VERSION, write_token_pairs)

logger = logging.getLogger(__name__)

LOCK_TIMEOUT = 10.0  # seconds a run waits for another run on its output to finish (--lock-timeout)
PARENT_POLL_SECONDS = 0.2  # how often a worker checks that the main process is still alive
JSONL_SUFFIXES = (".jsonl.gz", ".jsonl")
TEXTS_PER_BATCH = 1024  # texts per encode call: a parquet row group, and as many jsonl lines
# what a mixture's buckets must share: it reads all of their ids as one vocabulary
SHARED_KEYS = ("tokenizer_sha256", "vocab_size", "bos_token_id", "dtype", "convention")
# a store's shards are downloaded under OUTPUT/.inputs/<split>/[<bucket>/]: hidden, so that no
# listing of pairs or buckets sees it, and per split and bucket, so that two buckets' shards of one
# name never meet
STAGING = ".inputs"

# -----------------------------------------------------------------------------
# Windowing long documents


def check_window_args(max_length: int, overlap: int) -> None:
    """Raise ValueError unless max_length and overlap make valid windows (docs/pretokenized.md)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a BOS and one token), got {max_length}")
    if not 0 <= overlap <= max_length // 2:
        raise ValueError(f"overlap_size {overlap} must be between 0 and max_length // 2 = "
                         f"{max_length // 2} (max_length {max_length})")
    if overlap > max_length - 2:
        # only max_length=2, overlap=1: a window of BOS + 1 old token would bring nothing new
        raise ValueError(f"overlap_size {overlap} leaves no new token per window at max_length "
                         f"{max_length}; use overlap_size <= max_length - 2 = {max_length - 2}")
    if overlap > MAX_OVERLAP:
        raise ValueError(f"overlap_size {overlap} does not fit the format's uint16 overlap prefix "
                         f"(at most {MAX_OVERLAP}; max_length {max_length})")


def window_document(tokens: np.ndarray, max_length: int,
                    overlap: int) -> list[tuple[np.ndarray, int]]:
    """Cut one document into entries of at most max_length tokens: [(entry_tokens, overlap_prefix),
    ...]. tokens is the document as the tokenizer encodes it with prepend=BOS: tokens[0] is the BOS
    that starts every window. An entry that fits comes back whole, [(tokens, 0)]; window 0 is a view
    into tokens, later windows are new arrays of the same dtype."""
    check_window_args(max_length, overlap)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError("a document is a 1-D array that starts with BOS, got shape "
                         f"{tokens.shape}")
    if len(tokens) <= max_length:
        return [(tokens, 0)]
    windows, start = [], 0
    # the loader's split policy cuts on the same grid (packing.next_cut), so a pretokenized window
    # and a split row of the same document hold the same tokens
    while start < len(tokens):
        end = min(len(tokens), next_cut(start, max_length, overlap))
        # later windows: the BOS again, then the last `overlap` old tokens as context
        windows.append((tokens[:end], 0) if start == 0 else
                       (np.concatenate((tokens[:1], tokens[start - overlap:end])), overlap))
        start = end
    return windows


def window_gpt_simple(tokens: np.ndarray, max_length: int,
                      overlap: int) -> list[tuple[np.ndarray, int]]:
    """GPT-Simple's convention: cut one document, its tokens followed by EOD and no BOS, into
    entries of at most max_length tokens: [(entry_tokens, overlap_prefix), ...], all views into
    tokens. Window k starts at k * (max_length - overlap); every window after the first repeats the
    overlap tokens before its new ones, and its overlap prefix counts them (from the entry's start:
    there is no BOS). Only the last window holds the EOD, and each window brings at least one new
    token."""
    check_window_args(max_length, overlap)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(f"a document is a 1-D array that ends with EOD, got shape {tokens.shape}")
    windows = [(tokens[:max_length], 0)]
    # start: the window's first new token. Stopping at len(tokens) writes no window of old tokens
    # only, which GPT-Simple's own writer can make
    for start in range(max_length, len(tokens), max_length - overlap):
        windows.append((tokens[start - overlap:start - overlap + max_length], overlap))
    return windows


# -----------------------------------------------------------------------------
# Pretokenizing input shards


def _strip_suffix(name: str) -> str:
    for suffix in (".parquet",) + JSONL_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def _expand_jsonl(paths: list[str], flag: str) -> list[str]:
    """The .jsonl/.jsonl.gz files named by paths: files as given, directories' files sorted."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path)
                           if f.endswith(JSONL_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"{flag} directory {path} holds no .parquet, .jsonl or "
                                        ".jsonl.gz files")
            files.extend(found)
        elif os.path.isfile(path):
            if not path.endswith(JSONL_SUFFIXES):
                raise ValueError(f"{flag} file {path} is not .jsonl or .jsonl.gz; for parquet "
                                 "shards pass their directory (one --input DIR), which also picks "
                                 "the val shard")
            files.append(path)
        else:
            raise FileNotFoundError(f"{flag} path {path} does not exist")
    return files


class Job(NamedTuple):
    """One input to tokenize into one pair."""
    source: str  # a local file, or a store's address (s3://bucket/prefix/name.parquet, ...)
    prefix: str  # the pair's path without .bin/.idx
    staged: str | None = None  # a store's shard: where it is downloaded to before tokenizing


def is_store(path: str) -> bool:
    """Whether an --input is an address (s3://, gs://, az://, hf://; http(s):// is refused), whose
    shards are downloaded to be read; file:// and plain paths are read in place."""
    return stores.scheme_of(path) not in ("", "file")


def local_input(path: str) -> str:
    """A plain path for a local --input: "~" expanded, file:///x read as /x; a store's address
    unchanged."""
    return stores.path_in_store(path) if stores.scheme_of(path) == "file" else \
        os.path.expanduser(path)


def plan_jobs(inputs: list[str], output: str, val_inputs: list[str] | None = None,
              bucket: str | None = None) -> list[Job]:
    """[Job(input, output_prefix), ...]: train inputs, then val inputs, to output/<split>/ (with a
    bucket: output/<split>/<bucket>/). One --input directory of parquet shards, or one store
    address, is split as on disk (its last shard in sorted order is val); otherwise the inputs are
    jsonl files or directories of them, all train, with val_inputs going to val."""
    address = next((p for p in inputs if is_store(p)), None)
    if address is not None:
        splits = _store_splits(address, inputs, val_inputs)
    elif len(inputs) == 1 and os.path.isdir(inputs[0]) and any(
            f.endswith(".parquet") for f in os.listdir(inputs[0])):
        if val_inputs:
            raise ValueError(f"{inputs[0]} is a parquet dataset, whose last shard is val already; "
                             "drop --val-input")
        splits = {s: split_parquet_files(s, inputs[0]) for s in ("train", "val")}
    else:
        splits = {"train": _expand_jsonl(inputs, "--input"),
                  "val": _expand_jsonl(val_inputs, "--val-input") if val_inputs else []}
    jobs = []
    for split, paths in splits.items():
        names = [_strip_suffix(os.path.basename(p)) for p in paths]
        # a.jsonl and a.jsonl.gz, or one name in two directories, would overwrite each other's pair
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"{split} inputs {dupes} would write the same output pair; rename or "
                             "drop one")
        within = split if bucket is None else os.path.join(split, bucket)
        directory, staging = os.path.join(output, within), os.path.join(output, STAGING, within)
        jobs += [Job(p, os.path.join(directory, n),
                     os.path.join(staging, os.path.basename(p)) if address else None)
                 for p, n in zip(paths, names)]
    return jobs


def _store_splits(address: str, inputs: list[str], val_inputs: list[str] | None) -> dict:
    """{"train": [address, ...], "val": [address]}: the parquet shards the store lists under
    address, split by the on-disk rule (the last name in sorted order is val)."""
    if stores.is_http(address):
        raise ValueError(f"--input {address}: pretokenize reads a local directory or a store "
                         "(s3://, gs://, az://, hf://); download over HTTP first (python -m "
                         "nanochat.dataset --base-url URL --data-dir DIR) and pass --input DIR")
    if len(inputs) > 1 or val_inputs:
        raise ValueError(f"--input {address} is a store's dataset, whose last shard is val "
                         "already: pass it alone, without other --input paths or --val-input")
    stores.check_address(address)
    names = read_listing(address, Limits())  # retried while the store asks to slow down
    paths = [stores.join(address, name) for name in names]
    return {"train": paths[:-1], "val": paths[-1:]}


def _read_text_batches(path: str, text_field: str):
    """Lists of up to TEXTS_PER_BATCH texts from a parquet shard (one row group each) or a jsonl
    file."""
    if path.endswith(".parquet"):
        pf = open_parquet(path)
        for rg_idx in range(pf.num_row_groups):
            yield read_row_group_texts(pf, rg_idx, path)
        return
    batch = []
    for text in read_jsonl_texts(path, text_field):
        batch.append(text)
        if len(batch) == TEXTS_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def pretokenize_file(tokenizer, path: str, prefix: str, *, max_length: int | None = None,
                     overlap: int = 0, text_field: str = "text", num_threads: int = 4,
                     convention: str = "nanochat") -> dict:
    """Tokenize one input shard into the pair at prefix; returns counts {documents, entries, tokens,
    windowed} (windowed: documents longer than max_length, cut into windows). convention
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
        for texts in _read_text_batches(path, text_field):
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


# one tokenizer per worker process, loaded by _init_worker: loading it for each job would read and
# parse tokenizer.json again for every input
_worker_tokenizer = None
_worker_options: dict = {}


def _init_worker(tokenizer_dir: str, options: dict, parent_pid: int) -> None:
    global _worker_tokenizer, _worker_options
    # Ctrl-C reaches the whole process group: between jobs the main process alone acts on it (an
    # idle worker would print a traceback); within one, _run_job lets it stop the job. It was
    # blocked since this process started (_results): one sent meanwhile is dropped now
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # (POSIX)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _exit_with_parent(parent_pid)
    _worker_tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    _worker_options = options


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when the main process ends, however it ends (kill -9 included). Left alive, a
    worker would go on writing pairs, under the same temporary names as a rerun's workers."""
    if sys.platform.startswith("linux"):
        # the kernel kills us the moment the process that started us is gone (the pool is made and
        # used on one thread: the signal comes when that thread ends)
        PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch():  # elsewhere, and if the parent was gone before the line above ran
        while os.getppid() == parent_pid:  # an orphan is adopted: its parent id changes
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # at once: no cleanup that could finish a half-written pair

    threading.Thread(target=watch, name="nanochat-parent-watch", daemon=True).start()


def _run_job(job: Job) -> tuple[str, dict | None, str | None]:
    # Ctrl-C stops the job at once, its temporary files removed (write_token_pairs); the main
    # process, stopped too, says so
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _try_job(_worker_tokenizer, _worker_options, job)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _try_job(tokenizer, options: dict, job: Job) -> tuple[str, dict | None, str | None]:
    """(input, counts, None), (input, None, error message): a bad input fails alone, or
    (input, None, None): another run on this output wrote the pair meanwhile."""
    path, prefix, staged = job
    try:
        # no timeout: the holder is a live process writing this pair (the lock ends with it)
        with _pair_lock(prefix):
            # written while we waited; the output is deterministic, so it is the pair we would write
            if os.path.exists(prefix + ".idx"):
                _unstage(staged)
                return path, None, None
            if staged is not None:  # a verified copy (a rerun finds one left by a failed run)
                download_file(path, staged, progress=False)
            stats = pretokenize_file(tokenizer, path if staged is None else staged, prefix,
                                     **options)
            _unstage(staged)
            return path, stats, None
    # BadGzipFile is an OSError, and so is a store's error
    except (ValueError, OSError, EOFError, pa.ArrowException, DownloadError) as e:
        return path, None, f"{type(e).__name__}: {stores.redact(str(e))}"


def _unstage(staged: str | None) -> None:
    """Remove a store's shard downloaded for a pair now written: the pair is the product, and a
    rerun skips it, so the copy would not be read again. Its download lock goes too: only the
    holder of the pair's lock ever takes it, so nobody can be waiting on it."""
    if staged is not None:
        for path in (staged, record_path(staged), lock_path(staged)):
            remove_if_exists(path)


def _settings(tokenizer, tokenizer_dir: str, max_length: int | None, overlap: int,
              convention: str = "nanochat") -> dict:
    # the file's hash, not the vocabulary size: two tokenizers of one size give other ids
    with open(os.path.join(tokenizer_dir, TOKENIZER_FILENAME), "rb") as f:
        tokenizer_sha256 = hashlib.sha256(f.read()).hexdigest()
    return {
        "format": MAGIC.decode(), "version": VERSION,
        "dtype": "uint16" if tokenizer.get_vocab_size() <= 2**16 else "uint32",
        "vocab_size": tokenizer.get_vocab_size(), "bos_token_id": tokenizer.get_bos_token_id(),
        "tokenizer_sha256": tokenizer_sha256,
        "max_length": max_length, "overlap_size": overlap if max_length is not None else 0,
        # the loaders take the BOS to prepend from here: the BOS, or for gpt-simple the EOD (the
        # same id)
        "convention": convention,
        "eod_token_id": tokenizer.get_bos_token_id() if convention == "gpt-simple" else None,
    }


def _read_settings(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"{path} (pretokenize's settings) is not valid JSON: {e}; restore it, or "
                         "remove it together with the shards beside it and run again") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} holds a JSON {type(settings).__name__}, not pretokenize's "
                         "settings")
    return {"convention": "nanochat", **settings}  # a file without the field: nanochat's convention


def _check_or_write_settings(directories: list[str], settings: dict, instead: str) -> None:
    """Write pretokenize.json into each directory (the output, or a bucket's directory in each
    split), or refuse to add shards made with other settings to one of them (instead: where else to
    write them)."""
    # every directory is checked before any is written, so a refusal leaves nothing half-recorded
    for directory in directories:
        path = os.path.join(directory, META_FILENAME)
        if not os.path.exists(path):
            continue
        old = _read_settings(path)
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if changed:
            what = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"{path} records other settings than this run's ({what}); the shards "
                             f"there would mix, so use {instead} or the same settings")
    for directory in directories:
        path = os.path.join(directory, META_FILENAME)
        if os.path.exists(path):
            continue
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"  # several ranks may write it at once, all the same bytes
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)  # atomic: a reader sees no file or a whole one


def _check_other_buckets(output: str, bucket: str, settings: dict) -> None:
    """Refuse a bucket made with another tokenizer than the buckets already in output: a mixture
    reads all of its buckets' ids as one vocabulary. (Windowing may differ from bucket to
    bucket.)"""
    for split in ("train", "val"):
        split_dir = os.path.join(output, split)
        for name in sorted(os.listdir(split_dir)) if os.path.isdir(split_dir) else []:
            path = os.path.join(split_dir, name, META_FILENAME)
            if name == bucket or not os.path.isfile(path):
                continue
            old = _read_settings(path)
            changed = [f"{k} {old.get(k)!r} -> {settings[k]!r}" for k in SHARED_KEYS
                       if old.get(k) != settings[k]]
            if changed:
                raise ValueError(f"{path} records another tokenizer than this run's "
                                 f"({', '.join(changed)}); the buckets of one mixture are read as "
                                 "one vocabulary, so pretokenize with the tokenizer of the others, "
                                 "or into a new --output directory")


def _results(tokenizer, tokenizer_dir: str, options: dict, jobs: list, num_workers: int):
    """The results of _try_job for jobs, in completion order, from num_workers processes (1: this
    one)."""
    if num_workers <= 1:
        for job in jobs:
            yield _try_job(tokenizer, options, job)
        return
    # spawn: a forked child would inherit the parent's tokenizer thread pools, and maybe a held
    # lock. A worker that dies (killed, out of memory) raises BrokenProcessPool here instead of
    # hanging.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(tokenizer_dir, options, os.getpid())) as pool:
        with _sigint_blocked():  # (the workers start at the first submits)
            futures = [pool.submit(_run_job, job) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:  # on an error, do not start the inputs still queued
                future.cancel()


@contextlib.contextmanager
def _sigint_blocked():
    """Ctrl-C held back while the block runs, then raised. A process started meanwhile starts
    with it blocked (a signal mask is inherited), so that one still importing prints no traceback:
    the way multiprocessing starts its resource tracker."""
    if not hasattr(signal, "pthread_sigmask"):  # (not POSIX)
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _pair_lock(prefix: str) -> FileLock:
    """The lock a writer holds while it writes the pair at prefix. Runs on one output at once (a
    plain run and the ranks of a --world-size N run) may have a pair in common, and would share its
    temporary files. A hidden name beside the pair, .<name>.lock, that no listing of pairs matches;
    left in place, since removing a lock file another process may be waiting on would let a third
    take a new one."""
    directory, name = os.path.split(prefix)
    os.makedirs(directory or ".", exist_ok=True)
    return FileLock(os.path.join(directory, f".{name}.lock"))


@contextlib.contextmanager
def _output_lock(output: str, rank: int, world_size: int, timeout: float):
    """Hold the lock of this rank's share of output, waiting up to timeout seconds; TimeoutError,
    naming the run that holds it, if it stays held. The lock is the kernel's (flock): it ends with
    its process, so a rerun right after a kill -9 gets it at once (the workers, which do not hold
    it, die then too)."""
    # one lock per rank: the ranks of one job write disjoint inputs and may run at once
    name = (".pretokenize.lock" if world_size == 1
            else f".pretokenize.rank{rank}-of-{world_size}.lock")
    path = os.path.join(output, name)
    os.makedirs(output, exist_ok=True)
    holder = "pid unknown"
    if os.path.exists(path):  # read before FileLock opens it: some filelock versions truncate it
        with open(path, encoding="utf-8", errors="replace") as f:
            holder = f.read().strip() or holder
    lock = FileLock(path, timeout=timeout)
    try:
        lock.acquire(timeout=0)  # free, as it most often is: nothing to say
    except Timeout:
        if timeout > 0:  # a wait of up to 10 s by default: say so when it starts
            print(f"waiting up to {timeout:g}s (--lock-timeout) for another pretokenize run "
                  f"({holder}) that is writing to {output}", flush=True)
        try:
            lock.acquire()
        except Timeout:
            error = TimeoutError(
                f"another pretokenize run ({holder}) is writing to {output}: {path} stayed locked "
                f"for {timeout:g}s; let that run finish (or stop it), then run again: the rerun "
                "skips the pairs it wrote. To run several at once, give each its own share of the "
                "inputs: --rank R --world-size N, with R from 0 to N-1, on one machine or several"
                + (f" (that run is rank {rank} of {world_size} too)" if world_size > 1 else ""))
            raise error from None
    try:
        since = time.strftime('%Y-%m-%d %H:%M:%S')
        _note_holder(path, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
        yield
    finally:
        _note_holder(path, "")  # nobody holds it now: a finished run leaves the file empty
        lock.release()


def _note_holder(path: str, text: str) -> None:
    # who holds the lock, for the message a second run gives; only a note: failing to write it
    # changes nothing
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass


# -----------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.pretokenize",
        description="Tokenize parquet shards or jsonl files into .bin/.idx token shards, one pair "
                    "per input, under OUTPUT/train and OUTPUT/val. Rerun to resume: complete pairs "
                    "are skipped.")
    parser.add_argument("--input", nargs="+", required=True,
                        help="a parquet dataset directory or a store's address "
                             "(s3://bucket/prefix, gs://, az://, hf://datasets/owner/name/folder, "
                             "file://; last shard = val), or .jsonl/.jsonl.gz files or directories "
                             "of them (all train)")
    parser.add_argument("--val-input", nargs="+", default=None,
                        help="jsonl files or directories for val/")
    parser.add_argument("--output", required=True,
                        help="output directory (train/ and val/ go under it)")
    parser.add_argument("--bucket", default=None,
                        help="write a mixture bucket: OUTPUT/train/BUCKET/ and OUTPUT/val/BUCKET/ "
                             "(default: none, OUTPUT/train/ and OUTPUT/val/)")
    parser.add_argument("--tokenizer-dir", default=None, help="default: <base dir>/tokenizer")
    parser.add_argument("--text-field", default="text", help="the jsonl field holding the text")
    parser.add_argument("--max-length", type=int, default=None,
                        help="cut documents into windows of at most this many tokens, BOS included "
                             "(default: no windowing)")
    parser.add_argument("--overlap-size", type=int, default=0,
                        help="document tokens each window repeats from the previous one "
                             "(<= max_length // 2)")
    parser.add_argument("--convention", choices=CONVENTIONS, default="nanochat",
                        help="nanochat: an entry is BOS + the document (default); gpt-simple: the "
                             "document + EOD, no BOS, as GPT-Simple's loader expects (EOD = the "
                             "tokenizer's <|bos|> id)")
    parser.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes tokenizing input shards in parallel (1: this process)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's share: inputs rank, rank + world_size, ... "
                             "(default: $RANK or 0)")
    parser.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE or 1")
    parser.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT,
                        help="seconds to wait for another run on the same --output (and rank) to "
                             f"finish before giving up (default {LOCK_TIMEOUT:g})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.pretokenize --input DIR --output DIR [...]`. Returns 0, or 1 when an
    input failed (the others are still written). Bad arguments exit through argparse; missing or
    unusable inputs, tokenizer or output settings raise FileNotFoundError / ValueError up front."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_length is not None:
        try:
            check_window_args(args.max_length, args.overlap_size)
        except ValueError as e:
            parser.error(f"--max-length {args.max_length} / --overlap-size "
                         f"{args.overlap_size}: {e}")
    elif args.overlap_size:
        parser.error(f"--overlap-size {args.overlap_size} needs --max-length (windowing is off "
                     "without it)")
    if args.num_workers < 1:
        parser.error(f"--num-workers must be >= 1, got {args.num_workers}")
    if not args.lock_timeout >= 0:  # written so that NaN fails too
        parser.error(f"--lock-timeout must be >= 0 seconds, got {args.lock_timeout}")
    if args.bucket is not None and (args.bucket in ("", ".", "..") or "/" in args.bucket
                                    or os.sep in args.bucket):
        parser.error(f"--bucket must be a directory name (no '/'), got {args.bucket!r}")
    # "~" works in every path, also where no shell expanded it (--output=~/x, a subprocess's
    # argument list)
    args.input = [local_input(p) for p in args.input]
    args.val_input = (None if args.val_input is None
                      else [local_input(p) for p in args.val_input])
    args.output = os.path.expanduser(args.output)
    args.tokenizer_dir = (None if args.tokenizer_dir is None
                          else os.path.expanduser(args.tokenizer_dir))
    _, env_rank, _, env_world_size = get_dist_info()
    rank = env_rank if args.rank is None else args.rank
    world_size = env_world_size if args.world_size is None else args.world_size
    if world_size < 1 or not 0 <= rank < world_size:
        parser.error(f"need 0 <= --rank < --world-size, got rank {rank}, world size {world_size}")
    tokenizer_dir = args.tokenizer_dir or get_tokenizer_dir()
    print(f"input={args.input} val_input={args.val_input} output={args.output} "
          f"bucket={args.bucket} tokenizer_dir={tokenizer_dir} text_field={args.text_field} "
          f"max_length={args.max_length} overlap_size={args.overlap_size} "
          f"num_workers={args.num_workers} rank={rank} world_size={world_size} "
          f"convention={args.convention}")

    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    settings = _settings(tokenizer, tokenizer_dir, args.max_length, args.overlap_size,
                         args.convention)
    all_jobs = plan_jobs(args.input, args.output, args.val_input, args.bucket)
    mine = all_jobs[rank::world_size]  # ranks share the work without talking to each other
    # never into a directory of another kind of data (parquet shards, a split's or bucket's own
    # pairs, buckets for a plain run, a plain output for a bucket)
    check_kind(args.output, "output" if args.bucket is None else "bucket output")
    # A plain output keeps its settings and locks at its top. A bucket keeps them in its own
    # directories (the lock in train/<bucket>/, the settings in each split's), so that buckets made
    # by separate runs, windowed differently, share one output, and the mixture loader finds each
    # bucket's vocabulary.
    home = args.output if args.bucket is None else os.path.join(args.output, "train", args.bucket)
    settings_dirs = ([args.output] if args.bucket is None
                     else sorted({os.path.dirname(job.prefix) for job in all_jobs}))
    if args.bucket is not None:
        _check_other_buckets(args.output, args.bucket, settings)
    # a second run of this rank would write the same pairs: refused (the lock is taken after every
    # check, so a mistyped command never waits for it). Other runs on this output (a plain run
    # beside ranks) may still share a pair: _pair_lock keeps its writers apart
    with _output_lock(home, rank, world_size, args.lock_timeout):
        todo = [job for job in mine if not os.path.exists(job.prefix + ".idx")]  # a whole pair
        skipped = len(mine) - len(todo)
        _check_or_write_settings(settings_dirs, settings,
                                 "a new --output directory" if args.bucket is None
                                 else "another --bucket name (or a new --output directory)")
        print(f"{len(all_jobs)} inputs, {len(mine)} for rank {rank}/{world_size}; {skipped} "
              f"already done (their .idx exists), skipped; {len(todo)} to write; "
              f"dtype {settings['dtype']}")

        num_workers = min(args.num_workers, len(todo))
        # spread the CPU between processes; each process's tokenizer encodes a batch on this many
        # threads
        options = {"max_length": args.max_length, "overlap": args.overlap_size,
                   "text_field": args.text_field,
                   "num_threads": max(1, (os.cpu_count() or 1) // max(1, num_workers)),
                   "convention": args.convention}
        totals = {"documents": 0, "entries": 0, "tokens": 0, "windowed": 0}
        failed, written = [], 0
        t0 = time.time()
        # a bar on a terminal, a line per quarter in a log
        with progress_bar(total=len(mine), initial=skipped, unit="shard",
                          desc="pretokenize") as bar:
            for path, stats, error in _results(tokenizer, tokenizer_dir, options, todo,
                                               num_workers):
                if error is not None:
                    failed.append((path, error))
                    bar.write(f"failed: {path}: {error}")  # above the bar, which stays whole
                elif stats is None:  # another run on this output wrote it meanwhile
                    skipped += 1
                else:
                    written += 1
                    for k in totals:
                        totals[k] += stats[k]
                bar.update(1)
                bar.set_postfix(tokens=f"{totals['tokens']:,}")

        seconds = time.time() - t0
        where = args.output if args.bucket is None else f"{args.output} (bucket {args.bucket})"
        print(f"wrote {written}/{len(todo)} shards to {where} in {seconds:.1f}s: "
              f"{totals['documents']:,} documents -> {totals['entries']:,} entries, "
              f"{totals['tokens']:,} tokens; {totals['windowed']:,} documents cut into windows; "
              f"{skipped} skipped (already done)")
        if failed:
            print(f"failed ({len(failed)}): " + ", ".join(os.path.basename(p) for p, _ in failed))
            return 1
        return 0


INTERRUPTED = ("pretokenize stopped; the pairs it wrote are complete and no partial one is left: "
               "rerun the same command to write the rest (it skips the pairs done)")


def command() -> None:
    """`python -m nanochat.pretokenize`: main() with its log on stderr, a bad input and Ctrl-C
    in one line each (nanochat.data.base.cli.run)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores.quiet_clients()
    # FileNotFoundError and a store's error are OSErrors; a store's missing package is one line too
    run(main, INTERRUPTED, (ValueError, OSError, stores.MissingExtra))


if __name__ == "__main__":
    command()
