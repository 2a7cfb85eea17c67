"""
The pretraining shard store: which dataset, where its parquet shards live, reading, downloading
and repackaging them. A dataset is a numbered run of parquet shards (`shard_00000.parquet`, ...)
with one `text` column in row groups of ~1024 documents; its last shard is val, the others train.

    python -m nanochat.dataset -n 240 -w 4     # fetch and verify ~100MB shards (download.py)
    python -m nanochat.dataset -n 8 --base-url s3://bucket/prefix --data-dir DIR   # from a store
    python -m nanochat.dataset --verify        # check the shards on disk, offline
    python -m nanochat.dataset repackage a.jsonl b.txt --out DIR   # your own text, in memory
    python -m nanochat.dataset serve DIR --port 8000   # serve shards to stream (serve.py)

Cost: reading a row group is one pyarrow call, a few ms for ~1024 documents.
Design: docs/downloads.md

May import: nanochat.common, nanochat.data.base.checks, nanochat.data.base.cli,
nanochat.data.base.files, nanochat.data.fetch, nanochat.data.pretokenized.layout.
"""

import argparse
import gzip
import json
import logging
import math
import os
import random
import re
import sys
import time
import urllib.parse
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.contrib.logging import logging_redirect_tqdm

from nanochat.data.base.checks import check_int
from nanochat.data.base.cli import run
from nanochat.common import get_base_dir
from nanochat.data.fetch import stores
from nanochat.data.fetch.download import Report, download_file, download_files, summarize
from nanochat.data.fetch.errors import DownloadError, check_address
from nanochat.data.fetch.limits import (BACKOFF_BASE, DEADLINE, MAX_ATTEMPTS, MIN_RATE, RATE_WINDOW,
                                        REQUEST_TIMEOUT, Limits)
from nanochat.data.fetch.records import record_path, stated_check
from nanochat.data.fetch.small_reads import fetch_small
from nanochat.data.fetch.sources import SOURCE_FIX, check_sources
from nanochat.data.fetch.verify import check_files
from nanochat.data.base.files import progress_bar, remove_if_exists
from nanochat.data.pretokenized.layout import check_kind
from nanochat.data.fetch.serve import LISTING
from nanochat.data.fetch.serve import main as serve_main

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# The datasets we know how to fetch


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo: str  # Hugging Face dataset repo that hosts the shards
    max_shard: int  # index of the last shard, which is the validation shard
    subdir: str  # directory under the base dir

    @property
    def base_url(self) -> str:
        # resolve/main: the file's bytes at the main branch, not its web page
        return f"https://huggingface.co/datasets/{self.repo}/resolve/main"

    @property
    def val_filename(self) -> str:
        return index_to_filename(self.max_shard)


DATASETS = {
    # nanochat's dataset since March 2026: 6543 shards of ~100MB (zstd), ~250M characters each
    "climbmix-400b": DatasetSpec("climbmix-400b", "karpathy/climbmix-400b-shuffle", 6542,
                                 "base_data_climbmix"),
    # nanochat's earlier dataset: ~100B GPT-2 tokens of FineWeb-Edu, shuffled; 1823 shards of
    # ~100MB (zstd)
    "fineweb-edu-100b": DatasetSpec("fineweb-edu-100b", "karpathy/fineweb-edu-100b-shuffle", 1822,
                                    "base_data"),
}
DEFAULT_DATASET = "climbmix-400b"  # what nanochat itself downloads and reads


def index_to_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"  # 5 digits: sorted names are index order


def get_dataset(name: str | None = None) -> DatasetSpec:
    """The dataset named by `name`, else $NANOCHAT_DATASET, else ClimbMix-400B (what the downloader
    fetches)."""
    name = name or os.environ.get("NANOCHAT_DATASET") or DEFAULT_DATASET  # "" counts as unset
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (from --dataset or NANOCHAT_DATASET); "
                         f"choose one of {sorted(DATASETS)}")
    return DATASETS[name]


def get_data_dir(dataset: str | None = None) -> str:
    """Where the shards of a dataset live: <base_dir>/base_data_climbmix for the default dataset."""
    return os.path.join(get_base_dir(), get_dataset(dataset).subdir)


def find_dataset() -> DatasetSpec:
    """The dataset the readers use when given no data_dir: $NANOCHAT_DATASET when set; else the one
    whose directory holds train shards (the downloader's names are nanochat's); when several do, the
    default one (logged once); when none does, the default one."""
    if os.environ.get("NANOCHAT_DATASET"):
        return get_dataset()
    # a directory with no train shard (a failed first download, `-n 0`) hides nothing
    present = [spec for spec in DATASETS.values()
               if _has_train_shards(get_data_dir(spec.name), spec)]
    if len(present) == 1:
        return present[0]
    if len(present) > 1:
        _log_once(logging.WARNING,
                  "found %s; reading %s, the default (set NANOCHAT_DATASET to choose)",
                  " and ".join(get_data_dir(spec.name) for spec in present),
                  get_data_dir(DEFAULT_DATASET))
    return get_dataset(DEFAULT_DATASET)


def _has_train_shards(data_dir: str, spec: DatasetSpec) -> bool:
    return os.path.isdir(data_dir) and any(name.endswith(".parquet")
                                           and name != spec.val_filename
                                           for name in os.listdir(data_dir))


def find_data_dir() -> str:
    """The directory the readers use when given no data_dir: $NANOCHAT_DATA_DIR when set (your own
    shards, or the cache they stream into, for scripts that pass no data_dir, such as nanochat's),
    else the found dataset's (see find_dataset)."""
    if os.environ.get("NANOCHAT_DATA_DIR"):  # "" counts as unset
        return os.path.expanduser(os.environ["NANOCHAT_DATA_DIR"])
    return get_data_dir(find_dataset().name)


_LOGGED: set = set()  # (message, args) already logged by _log_once


def _log_once(level: int, message: str, *args) -> None:
    """Log a message once per process: the loaders list the shards for every split and every
    rank."""
    if (message, args) not in _LOGGED:
        _LOGGED.add((message, args))
        logger.log(level, message, *args)


# -----------------------------------------------------------------------------
# Listing and splitting

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def _get_shards(data_dir: str) -> str:
    """How to fill an empty or missing data_dir: the dataset's shards, or shards of your own; and
    for the directory the readers found by themselves, how it was found."""
    return (f"download some: python -m nanochat.dataset -n 8, or write your own text files "
            f"({', '.join(INPUT_SUFFIXES)}) as shards: python -m nanochat.dataset repackage "
            f"INPUTS --out {data_dir}{_found_words(data_dir)}")


def _found_words(data_dir: str) -> str:
    """Where the directory the readers use when given no data_dir came from, and how to choose
    another; "" for any other directory (one passed by hand)."""
    own = os.environ.get("NANOCHAT_DATA_DIR")  # "" counts as unset
    if own:
        if os.path.abspath(os.path.expanduser(own)) != os.path.abspath(data_dir):
            return ""
        return (". It is $NANOCHAT_DATA_DIR, which the readers use when given no data_dir: "
                "point it at the directory of your shards, or unset it")
    spec = _dataset_of(data_dir)
    if spec is None or (os.path.abspath(os.path.dirname(os.path.normpath(data_dir)))
                        != os.path.abspath(get_base_dir())):
        return ""
    where = ("from NANOCHAT_BASE_DIR" if os.environ.get("NANOCHAT_BASE_DIR")
             else "~/.cache/nanochat, as NANOCHAT_BASE_DIR is unset")
    return (f". Given no data_dir, the readers use <base_dir>/{spec.subdir}, with <base_dir> "
            f"{where}; to read shards elsewhere, pass data_dir (--data-dir), or export "
            "NANOCHAT_DATA_DIR=DIR (the shards' directory) or NANOCHAT_BASE_DIR=DIR (DIR holds "
            f"{spec.subdir}/)")


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Sorted full paths of the `*.parquet` files in data_dir (default: find_data_dir()).
    Partial downloads live under other names (`*.parquet.tmp`, ...) and are never listed. A
    directory of pretokenized shards or buckets, or a file, is a ValueError that says so (an empty
    directory lists nothing)."""
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    if not os.path.isdir(data_dir):
        check_kind(data_dir, "parquet")  # a file (a shard, most often): a ValueError that says so
        raise FileNotFoundError(f"data directory {data_dir} does not exist; "
                                f"{_get_shards(data_dir)}")
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    if not names:  # no parquet: say what the directory holds instead, if anything
        check_kind(data_dir, "parquet")
    return [os.path.join(data_dir, f) for f in names]


def _dataset_of(data_dir: str) -> DatasetSpec | None:
    """The known dataset whose directory this is (by its name, e.g. base_data_climbmix), or
    None."""
    name = os.path.basename(os.path.normpath(data_dir))  # normpath: "dir/" names "dir" too
    return next((spec for spec in DATASETS.values() if spec.subdir == name), None)


def split_parquet_files(split: str, data_dir: str | None = None) -> list[str]:
    """The files of one split: val is the last file in sorted order, train the others (nanochat's
    rule). In a dataset's directory that is its last index, e.g. shard_06542.parquet, however many
    train shards were fetched; if it is not (your own shards there), one warning says which file is
    val and how to fetch the dataset's. Raises when the split would be empty."""
    _check_split(split)
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(f"no parquet shards in {data_dir}; {_get_shards(data_dir)}")
    val_path = paths[-1]  # nanochat's rule, whatever the names: the loaders agree on val
    spec = _dataset_of(data_dir)
    if spec and os.path.basename(val_path) != spec.val_filename:
        if os.path.join(data_dir, spec.val_filename) in paths:
            why = "sorts before it, so it is a train shard here"
        else:
            why = f"is missing (to fetch it: python -m nanochat.dataset --dataset {spec.name} -n 0)"
        _log_once(logging.WARNING,
                  "%s: the last file in sorted order, %s, is val; %s's validation shard %s %s",
                  data_dir, os.path.basename(val_path), spec.name, spec.val_filename, why)
    if split == "val":
        return [val_path]
    train = [p for p in paths if p != val_path]
    if not train:
        raise FileNotFoundError(
            f"{data_dir} holds only the validation shard {os.path.basename(val_path)}, so the "
            "train split is empty; download train shards: python -m nanochat.dataset -n 8")
    return train


def _stream_source(data_dir, base_url) -> tuple[str, DatasetSpec, str]:
    """(data_dir, the dataset, base_url) of a streamed split, the defaults filled in."""
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    spec = _dataset_of(data_dir) or find_dataset()
    base_url = get_base_url(spec.name) if base_url is None else base_url
    check_source(base_url, data_dir)
    return data_dir, spec, base_url


def stream_source(data_dir: str | None, base_url: str | None) -> tuple[str, str]:
    """(data_dir, base_url) of a streamed split: the defaults filled in, the address checked."""
    data_dir, _, base_url = _stream_source(data_dir, base_url)
    return data_dir, base_url


# -----------------------------------------------------------------------------
# Addresses: an http(s) URL (http_transport.py) or a store's (nanochat/data/fetch/stores.py)


def shown(address: str) -> str:
    """address as messages show it: without a URL's user:password@, and no secret of the
    environment in it."""
    parts = urllib.parse.urlsplit(address)
    if "@" in parts.netloc:
        address = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return stores.redact(address)


def check_source(base_url: str, data_dir: str) -> None:
    """check_address, and for a local directory as the source, that it is one, and that data_dir
    (the copies, the cache) is another directory, not inside it: nothing is ever written to or
    deleted from the source."""
    check_address(base_url)
    if not stores.is_local(base_url):
        return
    named = stores.path_in_store(base_url)
    if not os.path.isdir(named):  # most often a URL without its scheme
        raise ValueError(f"base_url {shown(base_url)!r} is not a directory here; a URL must start "
                         f"with http:// or https:// (forms: {stores.ADDRESS_FORMS}); fix "
                         "--base-url or NANOCHAT_DATA_URL")
    source = os.path.realpath(named)
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(data_dir))))
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"data_dir {data_dir} is {'the' if target == source else 'inside the'} source "
            f"directory {named} (base_url): the shards are copied from it into data_dir, and "
            "nothing may be written into the source; pass a data_dir outside it, e.g. "
            f"{named.rstrip(os.sep)}_cache")


LISTING_MAX_BYTES = 16 * 2**20  # a listing of 6,543 shards is ~300 KB


def listing_url(base_url: str) -> str:
    return f"{base_url.rstrip('/')}/{LISTING}"


def listing_source(base_url: str) -> str:
    """What lists base_url's shards, for messages: its index.json (http), else the store's
    listing of the prefix."""
    return listing_url(shown(base_url)) if stores.is_http(base_url) else shown(base_url)


def read_listing(base_url: str, limits: Limits) -> list[str] | None:
    """The sorted names of the parquet files that <base_url>/index.json lists (python -m
    nanochat.dataset serve makes it; docs/streaming.md#your-own-shards gives its format), or None
    when the server has none (the Hugging Face hub); a store's address: the parquet files directly
    under it. Small requests, bounded by limits; a listing that cannot be read is a ConnectionError,
    one that is wrong a ValueError, naming it."""
    if not stores.is_http(base_url):
        return _store_listing(base_url, limits)
    url = listing_url(base_url)
    try:
        body = fetch_small(url, LISTING_MAX_BYTES, limits)
    except DownloadError as e:
        # (the downloader's message starts with the URL, named here already)
        raise ConnectionError(f"could not read the shard listing {url}: "
                              f"{str(e).removeprefix(f'{url}: ')}") from None
    if body is not None:
        return parse_listing(body, url)
    if not _hosted(base_url):
        # a server of your own with no listing: its files must then bear the dataset's names
        _log_once(logging.WARNING, "%s not found: reading the dataset's shard names from %s "
                  "(shard_00000.parquet on, val the dataset's last index). For shards of other "
                  "names, serve them with python -m nanochat.dataset serve DIR, or write an "
                  "index.json beside them (docs/streaming.md, \"Your own shards\")", url, base_url)
    return None


def _hosted(base_url: str) -> bool:
    """Whether base_url is a dataset's own (the Hugging Face hub's repository), not a mirror."""
    return base_url.rstrip("/") in {spec.base_url.rstrip("/") for spec in DATASETS.values()}


def _store_listing(base_url: str, limits: Limits) -> list[str]:
    """The parquet names directly under a store's address (stores.list_names), retried with the
    download limits' backoff while the store says a retry can help, within their deadline; then a
    ConnectionError. One a retry cannot help (not found, no credentials) is raised as it is."""
    deadline = time.monotonic() + limits.deadline
    for attempt in range(1, limits.max_attempts + 1):
        try:
            names = stores.list_names(base_url, limits.timeout)
            break
        except stores.StoreError as e:
            if not e.retry:
                raise
            wait = limits.backoff_base * 2 ** (attempt - 1)
            if attempt == limits.max_attempts or time.monotonic() + wait > deadline:
                raise ConnectionError(f"could not list the shards in {shown(base_url)}: {e}; "
                                      f"gave up after {attempt} attempts") from None
            logger.warning("listing %s, attempt %d/%d: %s; retrying in %gs", shown(base_url),
                           attempt, limits.max_attempts, e, wait)
            time.sleep(wait)
    _check_names(names, f"the shards in {shown(base_url)}")
    return names


def _check_names(names: list[str], what: str) -> None:
    """ValueError unless the names can be a split's: file names, each once, at least 2."""
    bad = [n for n in names if "/" in n or "\\" in n or "\0" in n]
    if bad:  # the cache writes each under data_dir: a path could write anywhere
        raise ValueError(f"{what} names {bad[0]!r}, which is not a file name; "
                         "list the files of one directory")
    if len(set(names)) < len(names):
        raise ValueError(f"{what} names a file twice; list each once")
    if len(names) < 2:  # val is the last name, train the others: one file leaves train empty
        raise ValueError(f"{what} lists {len(names)} parquet files; a loader "
                         "needs at least 2: val is the last in sorted order, train the others")


def parse_listing(body: bytes, url: str) -> list[str]:
    """The sorted parquet names of a listing, {"files": [{"name": ..., "size": ...}, ...]} (size
    optional; names not ending in .parquet are left out, as on disk)."""
    fix = ("; it must be JSON {\"files\": [{\"name\": \"a.parquet\", \"size\": 123}, ...]}, "
           "as python -m nanochat.dataset serve DIR answers")
    try:
        value = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the shard listing {url} is not JSON ({e}){fix}") from None
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                              for f in files):
        raise ValueError(f"the shard listing {url} has no list of files with names{fix}")
    names = [f["name"] for f in files if f["name"].endswith(".parquet")]
    _check_names(names, f"the shard listing {url}")
    return sorted(names)


def streamed_split(split: str, data_dir: str | None = None, num_shards: int | None = None,
                   base_url: str | None = None,
                   listing: list[str] | None = None) -> tuple[str, list[str], list[str], str]:
    """A split of shards read while they stream in (a loader's stream=True), whether the files are
    on disk or not. With a listing (read_listing's names), the rule on disk: val is the last name,
    train the first num_shards others (default: all), the names kept as they are. Without one, the
    dataset's names: val is its last index, train its first num_shards; the dataset is the one
    data_dir is the directory of, else find_dataset()'s. Returns (data_dir, paths, URLs, the val
    shard's name)."""
    _check_split(split)
    data_dir, spec, base_url = _stream_source(data_dir, base_url)
    if listing is None:
        names = [index_to_filename(i) for i in range(spec.max_shard + 1)]
        where = f" (the train shards of {spec.name})"
    else:
        names, where = listing, f" (the train shards {listing_source(base_url)} lists)"
        _check_own(listing, data_dir, listing_source(base_url))
    if num_shards is None:
        num_shards = len(names) - 1  # every train shard
    check_int("num_shards (or NANOCHAT_STREAM_SHARDS)", num_shards, 1, len(names) - 1, hint=where)
    # val is the last name even when few train shards are streamed
    chosen = names[-1:] if split == "val" else names[:num_shards]
    return (data_dir, [os.path.join(data_dir, name) for name in chosen],
            [stores.join(base_url, name) for name in chosen], names[-1])


def _check_own(listing: list[str], data_dir: str, source: str) -> None:
    """ValueError when a listing of shards of your own would go into a dataset's directory."""
    own = _dataset_of(data_dir)
    if own and (listing[-1] != own.val_filename
                or any(_shard_index(name, own) is None for name in listing)):
        raise ValueError(
            f"{source} lists shards of your own (val {listing[-1]}), and "
            f"data_dir {data_dir} is the directory of {own.name}: their names could collide "
            f"with {own.name}'s shards there. Pass a data_dir of their own as the cache, e.g. "
            "data_dir=\"~/.cache/nanochat/my_shards\" (scripts.base_train: --data-dir; "
            "scripts that pass none, such as nanochat's: NANOCHAT_DATA_DIR)")


# -----------------------------------------------------------------------------
# Reading


def verify_hint(path: str) -> str:
    """The fix for a shard that cannot be read: find every bad one, then fetch them again (the
    downloader reads every page of a shard that no sha256 from the server vouches for)."""
    return (f"python -m nanochat.dataset --verify --data-dir {os.path.dirname(path) or '.'} lists "
            "every bad shard and the command that fetches them again (a streaming loader fetches "
            "its bad shards again when it restarts)")


def open_parquet(path: str) -> pq.ParquetFile:
    """Open a shard, reading its footer; a 0-byte, truncated or non-parquet file is a ValueError
    that names it and the fix, not pyarrow's message without the file name."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):  # removed since it was listed: say so, not "corrupt"
            raise FileNotFoundError(f"shard {path} does not exist (it was there when the shards "
                                    "were listed)") from None
        raise ValueError(f"{path} is not a readable parquet file ({e}); "
                         f"{verify_hint(path)}") from None


def read_row_group_texts(pf: pq.ParquetFile, rg_idx: int, path: str) -> list[str]:
    """The `text` column of one row group as a list of str, or a clear error naming file and row
    group."""
    return read_row_group_column(pf, rg_idx, path).to_pylist()


def read_row_group_column(pf: pq.ParquetFile, rg_idx: int, path: str) -> pa.ChunkedArray:
    """The checked `text` column of one row group, still in Arrow memory. Turning it into Python
    strings holds the GIL throughout (~5 ms for 1024 FineWeb documents), so a loader converts it a
    slice at a time and lets its tokenizer threads in between."""
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {pf.schema_arrow.names}); "
                         "shards need one string column named 'text'")
    try:
        column = pf.read_row_group(rg_idx, columns=["text"]).column("text")
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} row group {rg_idx} could not be read ({e}); "
                         f"{verify_hint(path)}") from None
    # large_string: what pyarrow writes for columns over 2 GB, the same text to us
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has type {column.type}, "
                         "expected string")
    if column.null_count:  # a None would reach the tokenizer and fail there, far from the file
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has {column.null_count} null "
                         "values")
    return column


def parquets_iter_batched(split: str, start: int = 0, step: int = 1, data_dir: str | None = None):
    """Yield the texts of row groups start, start+step, ... of each file of the split, in order.
    start/step shard across ranks (start=rank, step=world_size)."""
    check_int("start", start, 0)
    check_int("step", step, 1)
    for path in split_parquet_files(split, data_dir):
        pf = open_parquet(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_row_group_texts(pf, rg_idx, path)


# -----------------------------------------------------------------------------
# Downloading: which shards, their names and addresses (the machinery is in download.py)


def get_base_url(dataset: str | None = None) -> str:
    """Where shards are fetched from: $NANOCHAT_DATA_URL, else the dataset's Hugging Face repo."""
    return os.environ.get("NANOCHAT_DATA_URL") or get_dataset(dataset).base_url


def shard_url(index: int, base_url: str) -> str:
    return stores.join(base_url, index_to_filename(index))


def download_single_file(index: int, data_dir: str | None = None, base_url: str | None = None,
                         max_attempts: int = MAX_ATTEMPTS, backoff_base: float = BACKOFF_BASE, *,
                         dataset: str | None = None, timeout: float = REQUEST_TIMEOUT,
                         progress: bool | None = None, min_rate: float = MIN_RATE,
                         rate_window: float = RATE_WINDOW, deadline: float = DEADLINE) -> bool:
    """Fetch shard `index` into data_dir unless a sound copy is there; True when one is there
    afterwards. A copy that fails its checks is fetched again. Safe to call from several threads or
    processes at once. Raises HostNotFoundError when the host does not resolve (no retry can help).
    progress: bytes bar per shard (None: only on a terminal); timeout, min_rate (bytes/s over
    rate_window seconds) and deadline (seconds for the shard) bound the time spent: see
    nanochat/data/fetch/download.py."""
    check_int("shard index", index, 0)
    limits = Limits(max_attempts, backoff_base, timeout, min_rate, rate_window, deadline)
    data_dir = (get_data_dir(dataset) if data_dir is None
                else os.path.expanduser(os.fspath(data_dir)))
    base_url = get_base_url(dataset) if base_url is None else base_url
    check_source(base_url, data_dir)
    url, path = shard_url(index, base_url), os.path.join(data_dir, index_to_filename(index))
    check_sources([(url, path)], SOURCE_FIX, limits)  # (the directory: one source's shards)
    try:
        download_file(url, path, limits, progress=progress)
    except DownloadError as e:  # nanochat's signature: False, not an exception
        logger.error("%s", e)
        return False
    return True


def _fetch_shards(indices: list[int], data_dir: str, base_url: str, num_workers: int,
                  limits: Limits, *, progress: bool | None, check_disk: bool) -> Report:
    """What fetching these shards did: the CLI prints it, download_shards returns its failures."""
    # before the per-shard addresses, so that the error names what the user passed
    check_source(base_url, data_dir)
    files = [(shard_url(i, base_url), os.path.join(data_dir, index_to_filename(i)))
             for i in indices]
    return download_files(files, num_workers, limits, progress=progress, check_disk=check_disk)


def download_shards(indices, data_dir: str | None = None, base_url: str | None = None,
                    num_workers: int = 4, max_attempts: int = MAX_ATTEMPTS,
                    backoff_base: float = BACKOFF_BASE, *, dataset: str | None = None,
                    timeout: float = REQUEST_TIMEOUT, progress: bool | None = None,
                    check_disk: bool = True, min_rate: float = MIN_RATE,
                    rate_window: float = RATE_WINDOW, deadline: float = DEADLINE) -> list[int]:
    """Fetch the given shard indices with num_workers threads (0: in this thread); shards already
    there are checked and fetched again when bad. Returns the sorted indices that failed; empty
    means every shard is now on disk and verified. Raises ValueError before any download when
    base_url is not an address (check_address), OSError when check_disk finds the missing shards
    won't fit, and HostNotFoundError as soon as the host does not resolve (the whole run stops:
    no retry can help)."""
    limits = Limits(max_attempts, backoff_base, timeout, min_rate, rate_window, deadline)
    indices = sorted(set(indices))  # a repeated index would fetch one file twice, in two threads
    data_dir = (get_data_dir(dataset) if data_dir is None
                else os.path.expanduser(os.fspath(data_dir)))
    base_url = get_base_url(dataset) if base_url is None else base_url
    report = _fetch_shards(indices, data_dir, base_url, num_workers, limits, progress=progress,
                           check_disk=check_disk)
    return [i for i in indices if index_to_filename(i) in report.failed]


# -----------------------------------------------------------------------------
# Repackaging your own text into shards

ROW_GROUP_SIZE = 1024  # documents per row group, like the hosted shards
SHARD_SIZE_MB = 100.0  # the hosted shards are ~100MB after zstd
INPUT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
RATIO_SAMPLE_DOCS = 2048  # documents compressed up front to estimate the zstd ratio of this data


def _read_txt(path: str, text_field: str):
    """One document per non-empty line (the usual layout of scraped text dumps). text_field is
    unused: every reader takes the same arguments."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                yield line


def read_jsonl_texts(path: str, text_field: str = "text"):
    """Yield the text field of each non-empty line of a .jsonl or .jsonl.gz file; a line that is not
    JSON, or lacks the field, or whose field is not a string is an error naming file and line."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path} line {lineno}: no {text_field!r} field (found {keys}); "
                                 "pass the right one with --text-field")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path} line {lineno}: field {text_field!r} is "
                                 f"{type(text).__name__}, expected a string")
            yield text


def _read_parquet(path: str, text_field: str):
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names  # from the footer: a missing column fails before any read
    if text_field not in names:
        raise ValueError(f"{path} has no {text_field!r} column (columns: {names}); "
                         "pass the right one with --text-field")
    for rg_idx in range(pf.num_row_groups):
        column = pf.read_row_group(rg_idx, columns=[text_field]).column(text_field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ValueError(f"{path}: column {text_field!r} has type {column.type}, "
                             "expected string")
        if column.null_count:
            raise ValueError(f"{path} row group {rg_idx}: column {text_field!r} has "
                             f"{column.null_count} nulls")
        yield from column.to_pylist()


def _reader_for(path: str):
    for suffix, reader in ((".jsonl.gz", read_jsonl_texts), (".jsonl", read_jsonl_texts),
                           (".txt", _read_txt), (".parquet", _read_parquet)):
        if path.endswith(suffix):
            return reader
    raise ValueError(f"{path}: unsupported input type; use one of {', '.join(INPUT_SUFFIXES)}")


def read_documents(paths: list[str], text_field: str = "text", *,
                   progress: bool | None = None) -> list[str]:
    """All non-empty documents of the input files, in order. Empty ones are dropped: they would
    train nothing but a BOS. Every path is checked before any is read."""
    if not paths:
        raise ValueError("no input files given; pass .txt, .jsonl, .jsonl.gz or .parquet files")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file {path} does not exist")
        if not os.path.isfile(path):
            raise ValueError(f"input {path} is not a file; pass the files inside it")
        _reader_for(path)  # an unsupported suffix fails now, not after an hour of reading
    docs = []
    for path in progress_bar(paths, progress=progress, unit="file", desc="reading"):
        before = len(docs)
        try:
            docs.extend(t for t in _reader_for(path)(path, text_field) if t)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 ({e})") from None
        except (pa.ArrowException, gzip.BadGzipFile, EOFError) as e:
            raise ValueError(f"{path} could not be read ({e})") from None
        logger.info("%s: %d documents", path, len(docs) - before)
    return docs


def _zstd_ratio(sample: list[str]) -> float:
    """UTF-8 bytes per byte of zstd parquet for a sample of this data (~3 for English prose)."""
    raw = sum(len(t.encode("utf-8")) for t in sample)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": pa.array(sample, type=pa.string())}), sink,
                   compression="zstd")
    return max(raw / sink.getvalue().size, 1e-3)  # 1e-3: never a division by 0 below


def plan_shard_sizes(docs: list[str], *, shard_size_mb: float | None = None,
                     docs_per_shard: int | None = None) -> list[int]:
    """Documents per shard, as even as possible, at most docs_per_shard or about shard_size_mb of
    zstd parquet each (estimated by compressing a sample). At least 2 shards so that there is a
    train and a val split; when everything fits in one, val gets ~10% of the documents."""
    if shard_size_mb is not None and docs_per_shard is not None:
        raise ValueError("pass either shard_size_mb or docs_per_shard, not both")
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents (one for train, one for val), got {len(docs)}")
    if docs_per_shard is not None:
        check_int("docs_per_shard", docs_per_shard, 1)
        num_shards = math.ceil(len(docs) / docs_per_shard)
    else:
        shard_size_mb = SHARD_SIZE_MB if shard_size_mb is None else shard_size_mb
        if shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be > 0, got {shard_size_mb}")
        raw_bytes = sum(len(t.encode("utf-8")) for t in docs)
        compressed = raw_bytes / _zstd_ratio(docs[:RATIO_SAMPLE_DOCS])
        num_shards = math.ceil(compressed / (shard_size_mb * 1e6))
    if num_shards < 2:  # one shard would leave train or val empty
        num_val = max(1, len(docs) // 10)
        return [len(docs) - num_val, num_val]
    base, extra = divmod(len(docs), num_shards)  # the first `extra` shards get one more
    return [base + (i < extra) for i in range(num_shards)]


def _write_shard(path: str, texts: list[str], row_group_size: int) -> None:
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    tmp = path + ".tmp"  # never a *.parquet name, so a crash leaves nothing the loaders would read
    try:
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        remove_if_exists(tmp)
        raise


def repackage(inputs: list[str], out_dir: str, *, shard_size_mb: float | None = None,
              docs_per_shard: int | None = None, text_field: str = "text", seed: int = 42,
              row_group_size: int = ROW_GROUP_SIZE, progress: bool | None = None) -> list[str]:
    """Shuffle the documents of the input files and write them to out_dir as shard_00000.parquet,
    ... (one `text` column, zstd, row groups of row_group_size). The last shard is the validation
    split. Holds every document in memory. Returns the shard paths."""
    check_int("row_group_size", row_group_size, 1)
    if os.path.isdir(out_dir) and any(f.endswith(".parquet") for f in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds parquet files; mixing them with new shards "
                              "would change the train/val split, so pick an empty --out directory")
    docs = read_documents(list(inputs), text_field, progress=progress)
    sizes = plan_shard_sizes(docs, shard_size_mb=shard_size_mb, docs_per_shard=docs_per_shard)
    random.Random(seed).shuffle(docs)  # neighbours in a file are often related: mix them
    os.makedirs(out_dir, exist_ok=True)
    paths, start = [], 0
    try:
        for index, size in enumerate(progress_bar(sizes, progress=progress, unit="shard",
                                                  desc="writing")):
            path = os.path.join(out_dir, index_to_filename(index))
            _write_shard(path, docs[start:start + size], row_group_size)
            paths.append(path)
            start += size
    except BaseException:  # Ctrl-C too: out_dir held no parquet file, and a part of the shards
        for path in paths:  # would be read with the wrong val, its last: none is left
            remove_if_exists(path)
        raise
    assert start == len(docs)
    logger.info("wrote %d shards (%d documents) to %s", len(paths), len(docs), out_dir)
    return paths


# -----------------------------------------------------------------------------
# Command line

DOWNLOAD_HELP = ("Download pretraining shards (plus, always, the validation shard); shards already "
                 "there are checked and fetched again when bad. To convert your own text instead: "
                 "python -m nanochat.dataset repackage --help; to serve shards to a streaming "
                 "loader: python -m nanochat.dataset serve --help")
REPACKAGE_HELP = ("Shuffle your own documents into nanochat shards (the last shard is val). .txt: "
                  "one document per non-empty line; .jsonl/.jsonl.gz: one JSON object per line; "
                  ".parquet: one row per document.")


def _download_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset", description=DOWNLOAD_HELP)
    parser.add_argument("-n", "--num-files", type=int, default=-1,
                        help="train shards to fetch, from shard 0 (default: -1, every shard; 0: "
                             "only val). From a store's address (s3://..., a directory): the "
                             "first N train names it lists in sorted order (its last name is "
                             "val, always fetched)")
    parser.add_argument("-w", "--num-workers", type=int, default=4,
                        help="parallel downloads or checks (default: 4; 0: one at a time)")
    parser.add_argument("--dataset", default=None,
                        help=f"one of {sorted(DATASETS)} (default: $NANOCHAT_DATASET, "
                             f"else {DEFAULT_DATASET})")
    parser.add_argument("--base-url", default=None,
                        help="where the shards are: an https:// URL, s3://bucket/prefix, "
                             "gs://bucket/prefix, az://container/prefix, hf://datasets/owner/"
                             "name/folder, file:///path or a local directory (default: "
                             "$NANOCHAT_DATA_URL, else the dataset's URL). A store's shards keep "
                             "the names it lists; with --verify, names the source in the fix")
    parser.add_argument("--data-dir", default=None, help="default: <base dir>/<dataset subdir>")
    parser.add_argument("--verify", action="store_true",
                        help="download nothing: check every shard in the data dir (size and "
                             "sha256 against its .json record, PAR1 magic, parquet metadata, and "
                             "every page unless the record vouches for them) and exit 1 if any "
                             "is bad")
    parser.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS,
                        help="attempts in a row without progress, per shard (default: "
                             f"{MAX_ATTEMPTS})")
    parser.add_argument("--backoff-base", type=float, default=BACKOFF_BASE,
                        help="seconds before the 2nd attempt; doubles after each failure "
                             f"(default: {BACKOFF_BASE:g})")
    parser.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT,
                        help="seconds of silence before an attempt fails (default: "
                             f"{REQUEST_TIMEOUT:g})")
    parser.add_argument("--min-rate", type=float, default=MIN_RATE / 1e3,
                        help="KB/s: an attempt slower than this over --rate-window fails "
                             f"(default: {MIN_RATE / 1e3:g})")
    parser.add_argument("--rate-window", type=float, default=RATE_WINDOW,
                        help=f"seconds the rate is averaged over (default: {RATE_WINDOW:g})")
    parser.add_argument("--deadline", type=float, default=DEADLINE,
                        help="seconds for one shard, all attempts together (default: "
                             f"{DEADLINE:g})")
    return parser


def _download_main(argv: list[str]) -> int:
    parser = _download_parser()
    args = parser.parse_args(argv)
    # each bad value is named before anything is fetched; argparse has made them numbers already
    if args.num_files < -1:
        parser.error(f"-n/--num-files must be >= -1 (-1 means all shards), got {args.num_files}")
    if args.num_workers < 0:
        parser.error(f"-w/--num-workers must be >= 0, got {args.num_workers}")
    if args.max_attempts < 1:
        parser.error(f"--max-attempts must be >= 1, got {args.max_attempts}")
    for flag, value in (("--backoff-base", args.backoff_base), ("--min-rate", args.min_rate)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value:g}")
    for flag, value in (("--timeout", args.timeout), ("--rate-window", args.rate_window),
                        ("--deadline", args.deadline)):
        if value <= 0:
            parser.error(f"{flag} must be > 0 seconds, got {value:g}")

    spec = get_dataset(args.dataset)
    data_dir = os.path.expanduser(args.data_dir) if args.data_dir else get_data_dir(spec.name)
    if args.verify:
        source = args.base_url or get_base_url(spec.name)
        check_address(source)  # a mistyped address says so, rather than a fix for another
        return _verify_main(spec, data_dir, args.num_workers, source)
    base_url = args.base_url or get_base_url(spec.name)
    check_source(base_url, data_dir)
    limits = Limits(args.max_attempts, args.backoff_base, args.timeout, args.min_rate * 1e3,
                    args.rate_window, args.deadline)  # --min-rate is in KB/s, Limits in bytes/s
    bounds = (f"max_attempts={args.max_attempts} backoff_base={args.backoff_base:g}s "
              f"timeout={args.timeout:g}s min_rate={args.min_rate:g}KB/s "
              f"rate_window={args.rate_window:g}s deadline={args.deadline:g}s")
    listing, where, listed = _listing_to_fetch(spec, base_url, data_dir, limits)
    train = listing[:-1]
    asked = len(train) if args.num_files == -1 else args.num_files
    names = train[:asked] + listing[-1:]  # val always: every loader needs it
    print(f"{'' if listed else 'dataset=' + spec.name + ' '}"
          f"train_shards={len(names) - 1} val_shard={names[-1]} workers={args.num_workers} "
          f"data_dir={data_dir} base_url={shown(base_url)} {bounds}")
    short = asked > len(train)  # a shortfall: fetch what there is, then say so and exit 1
    if short:
        print(f"-n {asked} asks for more train shards than the {len(train)} {where}: fetching "
              f"those {len(train)} and val, then exiting 1")
    files = [(stores.join(base_url, name), os.path.join(data_dir, name)) for name in names]
    report = download_files(files, args.num_workers, limits, progress=None, check_disk=True)
    got = len(names) - len(report.failed)
    if short:  # never N/N for fewer than were asked for
        print(f"downloaded {got} of the {asked + 1} shards asked for ({asked} train and val) to "
              f"{data_dir}: {where} only {len(train)} train shards")
    else:
        print(f"downloaded {got}/{len(names)} shards to {data_dir}")
    fetched = [os.path.join(data_dir, n) for n in names if n not in report.failed]
    if fetched:
        print(_checked_words(fetched, base_url))
    _print_problems(report)
    return 1 if report.failed or short else 0


def _listing_to_fetch(spec: DatasetSpec, base_url: str, data_dir: str,
                      limits: Limits) -> tuple[list[str], str, bool]:
    """(the names the download picks from, train first and val last; who names them, for
    messages; whether a listing named them). A server's index.json (python -m nanochat.dataset
    serve makes one) or a store's listing names them, as it does for a streaming loader; a server
    with none (the Hugging Face hub) has the dataset's names."""
    # (the hub has no listing: not asked, so that a rerun with every shard there needs no network)
    listing = None if _hosted(base_url) else read_listing(base_url, limits)
    if listing is None:
        train = [index_to_filename(i) for i in range(spec.max_shard)]  # val: the last index
        return train + [spec.val_filename], f"{spec.name} has", False
    _check_own(listing, data_dir, listing_source(base_url))
    return listing, f"{listing_source(base_url)} lists", True


def _print_problems(report: Report) -> None:
    """The shards replaced and those that failed, and a rerun's advice only where it can help."""
    if report.replaced:
        print(f"replaced {len(report.replaced)} bad shards that were there:")
        print("\n".join(summarize(report.replaced)))
    if not report.failed:
        return
    retry = len(report.failed) - len(report.final)
    if not retry:
        advice = "a rerun cannot help: check the source and the names it has"
    else:
        which = f" the {retry} that may succeed" if report.final else ""
        advice = f"rerun the same command to retry{which} (partial downloads resume)"
    print(f"failed ({len(report.failed)}); {advice}:")
    print("\n".join(summarize(report.failed)))


def _checked_words(paths: list[str], base_url: str) -> str:
    """How the files fetched were checked: against a hash the server or store stated (verified),
    or only their size and parquet structure (it stated none)."""
    stated = sum(stated_check(path) is not None for path in paths)
    words = [f"{stated} verified against the hash {shown(base_url)} stated"] if stated else []
    if stated < len(paths):
        words.append(f"{len(paths) - stated} size and structure checked ({shown(base_url)} "
                     "stated no hash for them: their size, parquet structure and every page "
                     "were checked)")
    return "; ".join(words)


def _verify_main(spec: DatasetSpec, data_dir: str, num_workers: int, base_url: str) -> int:
    """--verify: check every shard in data_dir, offline; 1 when any is bad, with the command that
    fixes it (from base_url when it is a store's address)."""
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(f"no parquet shards in {data_dir}; {_get_shards(data_dir)}")
    bad = check_files(paths, num_workers)
    unrecorded = sum(not os.path.exists(record_path(p)) for p in paths)
    print(f"checked {len(paths)} shards in {data_dir}: {len(paths) - len(bad)} good, "
          f"{len(bad)} bad")
    if unrecorded:
        print(f"{unrecorded} have no .json record (your own shards, or fetched by another tool): "
              "for them the parquet structure and every page were checked, not size and sha256")
    if not bad:
        return 0
    print("\n".join(summarize({os.path.basename(p): e.reason for p, e in bad.items()})))
    for path, error in list(bad.items())[:3]:  # the full messages of a few, for the log
        logger.info("%s", error)
    if not stores.is_http(base_url):
        return _store_fix(paths, data_dir, base_url)
    # only a shard of the dataset is fetched again: named like its shards, and either in its own
    # directory (nanochat's downloader writes no .json record) or with our downloader's record.
    # Any other is your own, and a download would write the dataset into your data
    ours = _dataset_of(data_dir) == spec
    fetched = {os.path.basename(p): _shard_index(os.path.basename(p), spec) for p in paths
               if ours or os.path.exists(record_path(p))}
    fetched = {name: i for name, i in fetched.items() if i is not None}
    if any(os.path.basename(p) in fetched for p in bad):
        # -n covers every fetched train shard on disk, so the rerun re-checks them all and fetches
        # the bad ones again
        num_files = 1 + max((i for i in fetched.values() if i < spec.max_shard), default=-1)
        print(f"to fix: python -m nanochat.dataset --dataset {spec.name} --data-dir {data_dir} "
              f"-n {num_files} (add your --base-url if you used one); it fetches the bad shards "
              "again")
    others = sorted(os.path.basename(p) for p in bad if os.path.basename(p) not in fetched)
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        print(f"not fetchable from {spec.name} (named unlike its shards, or outside its "
              "directory with no .json record), so nothing here downloads them: "
              f"{', '.join(others[:3])}{more}; write them again from their source files "
              "(python -m nanochat.dataset repackage INPUTS --out NEW_DIR, a directory without "
              "parquet files) or delete them")
    return 1


def _store_fix(paths: list[str], data_dir: str, base_url: str) -> int:
    """--verify's fix for shards from a store: the download again, which re-checks every shard it
    names and fetches the bad ones. The files there are, in sorted order, the first train names
    the store lists and its val, as the download left them; -n counts the train ones."""
    print(f"to fix: python -m nanochat.dataset --base-url {shown(base_url)} --data-dir "
          f"{data_dir} -n {len(paths) - 1}; it fetches the bad shards again from there (a file "
          "it does not list stays bad: write it again from its source, or delete it)")
    return 1


def _shard_index(name: str, spec: DatasetSpec) -> int | None:
    """The index of a shard of spec named like the downloader names it, else None."""
    match = re.fullmatch(r"shard_(\d{5})\.parquet", name)
    return int(match.group(1)) if match and int(match.group(1)) <= spec.max_shard else None


def _repackage_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset repackage",
                                     description=REPACKAGE_HELP)
    parser.add_argument("inputs", nargs="+", help=f"input files ({', '.join(INPUT_SUFFIXES)})")
    parser.add_argument("--out", required=True,
                        help="output directory (must hold no parquet files)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--shard-size-mb", type=float, default=None,
                      help=f"target shard size after zstd (default {SHARD_SIZE_MB:g})")
    size.add_argument("--docs-per-shard", type=int, default=None,
                      help="at most this many documents per shard")
    parser.add_argument("--text-field", default="text",
                        help="JSON field or parquet column holding the text")
    parser.add_argument("--seed", type=int, default=42, help="shuffle seed")
    args = parser.parse_args(argv)
    # the size rule this run uses: one of the two, the default size when neither is given
    size = (f"docs_per_shard={args.docs_per_shard}" if args.docs_per_shard is not None
            else f"shard_size_mb={args.shard_size_mb:g}" if args.shard_size_mb is not None
            else f"shard_size_mb={SHARD_SIZE_MB:g}")
    print(f"inputs={len(args.inputs)} out={args.out} {size} text_field={args.text_field} "
          f"seed={args.seed}")
    paths = repackage(args.inputs, args.out, shard_size_mb=args.shard_size_mb,
                      docs_per_shard=args.docs_per_shard, text_field=args.text_field,
                      seed=args.seed)
    print(f"wrote {len(paths)} shards to {args.out}; the last, {os.path.basename(paths[-1])}, "
          "is val")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.dataset [-n N -w W ...]` downloads, `... --verify` checks the local
    shards, `... repackage INPUTS --out DIR` converts, `... serve DIR` serves. Returns the exit
    status (1 when a shard failed or is bad); bad input raises ValueError/FileNotFoundError/OSError
    (HostNotFoundError when the host does not resolve)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["repackage"]:  # a subcommand by hand: the download takes no positional
        return _repackage_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    return _download_main(argv)


def interrupted(argv: list[str]) -> str:
    """What Ctrl-C on `python -m nanochat.dataset ARGS` stopped, what it left and what a rerun
    does (nanochat.data.base.cli.run prints it)."""
    if argv[:1] == ["repackage"]:
        return ("repackage stopped; the shards it had written are removed (a part of them would "
                "split train and val wrongly), the input files are untouched: rerun the same "
                "command")
    if argv[:1] == ["serve"]:
        return "serve stopped; it changed nothing: rerun the same command to serve again"
    if any(arg.startswith("--v") for arg in argv):  # --verify, or argparse's abbreviation of it
        return "--verify stopped; it changes nothing: rerun it to check every shard"
    return ("the download stopped; the shards it installed are complete, partial ones stay as "
            ".tmp files: rerun the same command to resume them")


def _main() -> int:
    with logging_redirect_tqdm():  # log lines go above the progress bars, not through them
        return main()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores.quiet_clients()
    # FileNotFoundError is an OSError: one line, no traceback
    run(_main, interrupted, (ValueError, OSError, stores.MissingExtra))
