"""
Checking a loader's arguments at the call, through one integer check.
check_int is the one check every argument, field and setting goes through: bad input gets the same
kind of message everywhere (the name, the range, the value and, where it helps, a hint). Then the
options every loader takes, torchrun's rank, the worker and tokenizing process counts, the
shuffle, and streaming's settings from the arguments or the environment (NANOCHAT_STREAM,
NANOCHAT_CACHE_LIMIT, NANOCHAT_STREAM_SHARDS, NANOCHAT_LOADER_WORKERS,
NANOCHAT_TOKENIZER_PROCESSES).

May import: nanochat.common, nanochat.data.base.datasets, nanochat.data.base.shuffle.
"""

import math
import os
import re
import reprlib
from typing import NamedTuple

import numpy as np

from nanochat.common import get_dist_info
from nanochat.data.base.datasets import SPLITS
from nanochat.data.base.shuffle import Shuffle

# below this, a rank's spare CPUs tokenize on threads: one process costs its pickling and gains
# little over the tokenizer's own threads (docs/loaders.md, the measurement)
MIN_TOKENIZER_PROCESSES = 2
# the most tokenizer threads by default (nanochat's 4): past 2-4, they only fight over the GIL
MAX_TOKENIZER_THREADS = 4


def is_int(value, numpy: bool = False) -> bool:
    """An int (numpy: or a numpy integer); a bool is not one (True == 1 would slip through as a
    count). A numpy integer is refused by default: a loader's B or T of np.int64 would fail later,
    deep inside (JSON cannot write it), instead of here."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, low: int | None = None, high: int | None = None, *,
              hint: str = "", error: type[Exception] = ValueError) -> int:
    """Return value as an int if it is one in [low, high] (either bound may be None), else raise
    `error` naming `name`. hint: words put after the range, e.g. " (0 = no background threads)"."""
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):
        return int(value)
    if low is not None and high is not None:
        bounds = f" in [{low}, {high}]"
    elif low is not None:
        bounds = f" >= {low}"
    elif high is not None:
        bounds = f" <= {high}"
    else:
        bounds = ""
    # reprlib: a state's field can be a long list; the message shows its start
    raise error(f"{name} must be an integer{bounds}{hint}, got {reprlib.repr(value)}")


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


def resolve_tokenizer_processes(processes: int | None, workers: int) -> int:
    """Processes a tokenizing loader encodes on (0: threads of the loader's own process). The
    argument, else NANOCHAT_TOKENIZER_PROCESSES, else the CPUs this rank may use (its affinity
    mask, shared among the machine's LOCAL_WORLD_SIZE ranks) less one for the trainer, when that
    leaves at least MIN_TOKENIZER_PROCESSES. Only a loader in its worker process starts them
    (workers=1): workers=0 keeps all of a loader's work in the trainer's process."""
    if processes is None and _env("NANOCHAT_TOKENIZER_PROCESSES"):
        processes = _env_count("NANOCHAT_TOKENIZER_PROCESSES", 0, " (0: tokenize on threads)")
        return processes if workers else 0  # (a loader in the caller tokenizes on threads)
    if processes is None:
        spare = rank_cpus() - 1  # (one for the trainer)
        return spare if workers and spare >= MIN_TOKENIZER_PROCESSES else 0
    check_int("tokenizer_processes", processes, 0, hint=" (0: tokenize on threads)")
    if processes and not workers:
        raise ValueError(f"tokenizer_processes={processes} needs the loader's worker process: "
                         "pass workers=1 (the default) and prefetch > 0, or tokenizer_processes=0")
    return processes


def resolve_tokenizer_threads(threads: int | None) -> int:
    """Threads a loader tokenizes on when it does not use processes: the argument, else the CPUs
    this rank may use less one for the trainer, from 1 to MAX_TOKENIZER_THREADS. On a rank of 1
    or 2 CPUs that is one thread: more take the trainer's core and, on one core, slow the
    tokenizing itself (docs/benchmarks.md, tokenizing by cores)."""
    if threads is not None:
        return check_int("tokenizer_threads", threads, 1)
    return min(MAX_TOKENIZER_THREADS, max(1, rank_cpus() - 1))


def rank_cpus() -> int:
    """The CPUs this rank may use: its affinity mask (taskset, a cpuset, a scheduler's binding),
    shared among the machine's ranks."""
    return len(os.sched_getaffinity(0)) // local_ranks()


def local_ranks() -> int:
    """The ranks of this machine (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return 1
    return _env_count("LOCAL_WORLD_SIZE", 1, " (torchrun sets it)")


def _env_count(name: str, low: int, hint: str) -> int:
    """The count an environment variable holds, checked (a string that is no count is refused as
    it is, in check_int's words)."""
    value = os.environ[name]
    return check_int(name, int(value) if value.isdigit() else value, low, hint=hint)


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
