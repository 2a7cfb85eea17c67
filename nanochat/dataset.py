"""
The pretraining shard store: which dataset, where its parquet shards live, reading, downloading
and repackaging them.

A dataset is a numbered run of parquet shards (`shard_00000.parquet`, ...) with one `text` column,
row groups of ~1024 documents. The last index of a dataset is its validation shard; everything
else is train. Reading one row group costs one pyarrow call (a few ms for ~1024 documents).

Downloading (`python -m nanochat.dataset -n 240 -w 4`) fetches ~100MB per shard over HTTP with
retries, Range resume, a parquet check before the rename and a per-shard file lock, so several
processes can fetch into one directory at once. `python -m nanochat.dataset repackage ...` turns
your own .txt/.jsonl/.jsonl.gz/.parquet text into shards of the same format (all in memory).
"""

import argparse
import errno
import gzip
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import requests
from filelock import FileLock
from tqdm import tqdm

from nanochat.common import get_base_dir

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
        return f"https://huggingface.co/datasets/{self.repo}/resolve/main"

    @property
    def val_filename(self) -> str:
        return index_to_filename(self.max_shard)


DATASETS = {
    # nanochat's dataset since March 2026: 6543 shards of ~100MB (zstd), ~250M characters each
    "climbmix-400b": DatasetSpec("climbmix-400b", "karpathy/climbmix-400b-shuffle", 6542, "base_data_climbmix"),
    # the one before it: ~100B GPT-2 tokens of FineWeb-Edu, shuffled; 1823 shards of ~100MB (zstd)
    "fineweb-edu-100b": DatasetSpec("fineweb-edu-100b", "karpathy/fineweb-edu-100b-shuffle", 1822, "base_data"),
}
DEFAULT_DATASET = "climbmix-400b"  # what nanochat itself downloads and reads


def index_to_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def get_dataset(name: str | None = None) -> DatasetSpec:
    """The dataset named by `name`, else $NANOCHAT_DATASET, else ClimbMix-400B (what the downloader fetches)."""
    name = name or os.environ.get("NANOCHAT_DATASET") or DEFAULT_DATASET
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (from --dataset or NANOCHAT_DATASET); "
                         f"choose one of {sorted(DATASETS)}")
    return DATASETS[name]


def get_data_dir(dataset: str | None = None) -> str:
    """Where the shards of a dataset live: <base_dir>/base_data_climbmix for the default dataset."""
    return os.path.join(get_base_dir(), get_dataset(dataset).subdir)


def find_dataset() -> DatasetSpec:
    """The dataset the readers use when given no data_dir: $NANOCHAT_DATASET when set; else the one whose
    directory holds train shards (the downloader's names are nanochat's); when several do, the default one
    (logged once); when none does, the default one."""
    if os.environ.get("NANOCHAT_DATASET"):
        return get_dataset()
    # a directory with no train shard (a failed first download, `-n 0`) hides nothing
    present = [spec for spec in DATASETS.values() if _has_train_shards(get_data_dir(spec.name), spec)]
    if len(present) == 1:
        return present[0]
    if len(present) > 1:
        _log_once(logging.WARNING, "found %s; reading %s, the default (set NANOCHAT_DATASET to choose)",
                  " and ".join(get_data_dir(spec.name) for spec in present), get_data_dir(DEFAULT_DATASET))
    return get_dataset(DEFAULT_DATASET)


def _has_train_shards(data_dir: str, spec: DatasetSpec) -> bool:
    return os.path.isdir(data_dir) and any(name.endswith(".parquet") and name != spec.val_filename
                                           for name in os.listdir(data_dir))


def find_data_dir() -> str:
    """The directory the readers use when given no data_dir (see find_dataset)."""
    return get_data_dir(find_dataset().name)


_LOGGED: set = set()


def _log_once(level: int, message: str, *args) -> None:
    """Log a message once per process: the loaders list the shards for every split and every rank."""
    if (message, args) not in _LOGGED:
        _LOGGED.add((message, args))
        logger.log(level, message, *args)


# -----------------------------------------------------------------------------
# Listing and splitting

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Sorted full paths of the `*.parquet` files in data_dir (default: find_data_dir()).
    Partial downloads live under other names (`*.parquet.tmp`, ...) and are never listed."""
    data_dir = find_data_dir() if data_dir is None else data_dir
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"data directory {data_dir} does not exist; download some shards first: "
            "python -m nanochat.dataset -n 8")
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    return [os.path.join(data_dir, f) for f in names]


def _dataset_of(data_dir: str) -> DatasetSpec | None:
    """The known dataset whose directory this is (by its name, e.g. base_data_climbmix), or None."""
    name = os.path.basename(os.path.normpath(data_dir))
    return next((spec for spec in DATASETS.values() if spec.subdir == name), None)


def split_parquet_files(split: str, data_dir: str | None = None) -> list[str]:
    """The files of one split: val is the last file in sorted order, train the others (the seeds' rule
    and nanochat's). In a dataset's directory that is its last index, e.g. shard_06542.parquet, however
    many train shards were fetched; if it is not (your own shards there), one warning says which file is
    val and how to fetch the dataset's. Raises when the split would be empty."""
    _check_split(split)
    data_dir = find_data_dir() if data_dir is None else data_dir
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(
            f"no parquet shards in {data_dir}; download some first: python -m nanochat.dataset -n 8")
    val_path = paths[-1]
    spec = _dataset_of(data_dir)
    if spec and os.path.basename(val_path) != spec.val_filename:
        if os.path.join(data_dir, spec.val_filename) in paths:
            why = "sorts before it, so it is a train shard here"
        else:
            why = f"is missing (to fetch it: python -m nanochat.dataset --dataset {spec.name} -n 0)"
        _log_once(logging.WARNING, "%s: the last file in sorted order, %s, is val; %s's validation shard %s %s",
                  data_dir, os.path.basename(val_path), spec.name, spec.val_filename, why)
    if split == "val":
        return [val_path]
    train = [p for p in paths if p != val_path]
    if not train:
        raise FileNotFoundError(
            f"{data_dir} holds only the validation shard {os.path.basename(val_path)}, so the train split "
            "is empty; download train shards: python -m nanochat.dataset -n 8")
    return train


# -----------------------------------------------------------------------------
# Reading


def verify_hint(path: str) -> str:
    """The fix for a shard that cannot be read: find every bad one, then fetch them again."""
    return (f"to list every bad shard: python -m nanochat.dataset --verify --data-dir {os.path.dirname(path) or '.'} "
            "(running the download again re-fetches the bad ones)")


def open_parquet(path: str) -> pq.ParquetFile:
    """Open a shard, reading its footer; a 0-byte, truncated or non-parquet file is a ValueError that
    names it and the fix, not pyarrow's message without the file name."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"shard {path} does not exist (it was there when the shards were listed)") from None
        raise ValueError(f"{path} is not a readable parquet file ({e}); {verify_hint(path)}") from None


def read_row_group_texts(pf: pq.ParquetFile, rg_idx: int, path: str) -> list[str]:
    """The `text` column of one row group as a list of str, or a clear error naming file and row group."""
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
        raise ValueError(f"{path} row group {rg_idx} could not be read ({e}); {verify_hint(path)}") from None
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has type {column.type}, expected string")
    if column.null_count:
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has {column.null_count} null values")
    return column


def parquets_iter_batched(split: str, start: int = 0, step: int = 1, data_dir: str | None = None):
    """Yield the texts of row groups start, start+step, ... of each file of the split, in order.
    start/step shard across ranks (start=rank, step=world_size)."""
    if start < 0 or step < 1:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    for path in split_parquet_files(split, data_dir):
        pf = open_parquet(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_row_group_texts(pf, rg_idx, path)


# -----------------------------------------------------------------------------
# Downloading

MAX_ATTEMPTS = 5  # waits between them: base, 2*base, 4*base, 8*base (2, 4, 8, 16 s by default)
BACKOFF_BASE = 2.0
REQUEST_TIMEOUT = 30.0  # seconds of silence (connect or read) before an attempt counts as failed
# 64 KiB per write (~1600 for a ~100MB shard). A dropped connection loses the chunk being read
# (urllib3 fills a whole chunk before handing it over), so this is also the most a resume re-fetches.
CHUNK_SIZE = 64 * 1024
RETRY_AFTER_CAP = 60.0  # a server asking for longer than this gets this; 5 attempts stay within minutes
# Used for the disk check when the server gives no Content-Length: FineWeb-Edu and ClimbMix shards
# are ~90-100MB (zstd), so 100MB errs on the side of asking for too much.
SHARD_BYTES_ESTIMATE = 100 * 1024**2
DISK_MARGIN = 1.1  # shards differ in size by a few percent; keep 10% headroom over the estimate


class _RetryLater(Exception):
    """The server asked us to wait (429/503 with Retry-After) instead of using our backoff."""

    def __init__(self, message: str, seconds: float):
        super().__init__(message)
        self.seconds = seconds


class _GiveUp(Exception):
    """A permanent failure (404 and other 4xx): retrying would get the same answer."""


class _BadBody(Exception):
    """What we have on disk is wrong (size, Content-Range, not parquet); it cannot be resumed."""


def get_base_url(dataset: str | None = None) -> str:
    """Where shards are fetched from: $NANOCHAT_DATA_URL, else the dataset's Hugging Face repo."""
    return os.environ.get("NANOCHAT_DATA_URL") or get_dataset(dataset).base_url


def shard_url(index: int, base_url: str) -> str:
    return f"{base_url.rstrip('/')}/{index_to_filename(index)}"


def _lock_path(path: str) -> str:
    # a hidden name that does not end in .parquet, so list_parquet_files never sees it. We never
    # delete it ourselves: unlinking a lock file another process is waiting on lets a third process
    # lock a fresh file of the same name, and then two writers would share one temp file.
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.lock")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _retry_after_seconds(value: str | None) -> float | None:
    """The seconds form of a Retry-After header, capped at RETRY_AFTER_CAP; None if absent or a date."""
    if value is None or not value.strip().isdigit():
        return None  # the HTTP-date form is rare for these servers; our own backoff covers it
    return min(float(value.strip()), RETRY_AFTER_CAP)


def _content_length(response: requests.Response) -> int | None:
    # with a Content-Encoding the header counts compressed bytes, not what we write to disk
    if response.headers.get("Content-Encoding", "identity") != "identity":
        return None
    value = response.headers.get("Content-Length", "")
    return int(value) if value.isdigit() else None


def _parse_content_range(value: str | None) -> tuple[int, int | None]:
    """(first byte, total size or None) of a `bytes first-last/total` Content-Range."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (value or "").strip())
    if not match:
        raise _BadBody(f"206 answer with an invalid Content-Range {value!r}")
    first, last = int(match.group(1)), int(match.group(2))
    total = None if match.group(3) == "*" else int(match.group(3))
    if last < first or (total is not None and last >= total):
        raise _BadBody(f"206 answer with an inconsistent Content-Range {value!r}")
    return first, total


def _unsatisfied_range_total(response: requests.Response) -> int | None:
    """The file size a 416 answer reports in its `bytes */total` Content-Range, if any."""
    match = re.fullmatch(r"bytes \*/(\d+)", response.headers.get("Content-Range", "").strip())
    return int(match.group(1)) if match else None


def _check_status(response: requests.Response, url: str) -> None:
    """Return for 200/206; otherwise raise the exception that says whether and when to retry."""
    code = response.status_code
    if code in (200, 206):
        return
    if code == 416:
        raise _BadBody(f"{url}: 416 Range Not Satisfiable for our partial file")
    if code in (429, 503):
        seconds = _retry_after_seconds(response.headers.get("Retry-After"))
        if seconds is not None:
            raise _RetryLater(f"{url}: HTTP {code}, Retry-After {seconds:g}s", seconds)
    if 400 <= code < 500 and code not in (408, 429):
        raise _GiveUp(f"{url}: HTTP {code}")
    raise requests.HTTPError(f"{url}: HTTP {code}", response=response)


def _fetch_to_tmp(url: str, tmp: str, *, timeout: float, progress: bool | None) -> int | None:
    """One attempt: append the rest of the shard to tmp (or rewrite it) and return the total size
    the server announced, if it did. A dropped connection raises and leaves tmp for the next try."""
    have = os.path.getsize(tmp) if os.path.exists(tmp) else 0
    # identity: we compare bytes on disk with Content-Length, which compression would break
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    with requests.get(url, headers=headers, stream=True, timeout=timeout) as response:
        if response.status_code == 416 and have and _unsatisfied_range_total(response) == have:
            return have  # a run stopped between the last byte and the rename; the check below decides
        _check_status(response, url)
        if response.status_code == 206:
            first, total = _parse_content_range(response.headers.get("Content-Range"))
            if first != have:
                raise _BadBody(f"{url}: asked for bytes from {have}, got a range starting at {first}")
            mode = "ab"
        else:
            # 200: no Range sent, or the server ignores Range, so the body is the whole file
            have, mode = 0, "wb"
            total = _content_length(response)
        bar_off = None if progress is None else not progress  # None: tqdm shows bars only on a TTY
        with open(tmp, mode) as f, tqdm(total=total, initial=have, unit="B", unit_scale=True,
                                         desc=os.path.basename(url), leave=False, disable=bar_off) as bar:
            for chunk in response.iter_content(CHUNK_SIZE):
                f.write(chunk)
                bar.update(len(chunk))
    return total


def _verify_shard(tmp: str, total: int | None) -> None:
    """Raise _BadBody unless tmp has the announced size and a readable parquet footer."""
    size = os.path.getsize(tmp)
    if total is not None and size != total:
        raise _BadBody(f"{tmp} has {size} bytes, the server announced {total}")
    try:
        with open(tmp, "rb") as f:
            pq.ParquetFile(f)  # reads and parses the footer: catches truncated and non-parquet bodies
    except (pa.ArrowException, OSError) as e:
        raise _BadBody(f"{tmp} is not a readable parquet file ({e})") from None


def _download_locked(url: str, path: str, *, max_attempts: int, backoff_base: float,
                     timeout: float, progress: bool | None) -> bool:
    """The retry loop; the caller holds the shard's lock, so the fixed temp name is ours alone."""
    name = os.path.basename(path)
    tmp = path + ".tmp"  # survives an interrupted run so that the next run resumes it
    for attempt in range(1, max_attempts + 1):
        wait = backoff_base * 2 ** (attempt - 1)
        try:
            total = _fetch_to_tmp(url, tmp, timeout=timeout, progress=progress)
            _verify_shard(tmp, total)
            os.replace(tmp, path)
            logger.info("downloaded %s (%.1f MB)", name, os.path.getsize(path) / 1e6)
            return True
        except _GiveUp as e:
            logger.error("%s: %s; not retrying", name, e)
            _remove(tmp)
            return False
        except _RetryLater as e:
            wait = e.seconds
            logger.warning("%s attempt %d/%d: %s", name, attempt, max_attempts, e)
        except _BadBody as e:
            _remove(tmp)  # a complete but wrong file cannot be resumed; start over
            logger.warning("%s attempt %d/%d: %s; discarded", name, attempt, max_attempts, e)
        except (requests.RequestException, OSError) as e:
            # keep the partial temp file: the next attempt asks only for the missing bytes
            logger.warning("%s attempt %d/%d: %s", name, attempt, max_attempts, e)
        if attempt < max_attempts:
            time.sleep(wait)
    _remove(tmp)
    logger.error("%s: failed after %d attempts", name, max_attempts)
    return False


def _check_download_args(max_attempts: int, backoff_base: float) -> None:
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if backoff_base < 0:
        raise ValueError(f"backoff_base must be >= 0 seconds, got {backoff_base}")


def download_single_file(index: int, data_dir: str | None = None, base_url: str | None = None,
                         max_attempts: int = MAX_ATTEMPTS, backoff_base: float = BACKOFF_BASE, *,
                         dataset: str | None = None, timeout: float = REQUEST_TIMEOUT,
                         progress: bool | None = None) -> bool:
    """Fetch shard `index` into data_dir unless it is already there; True when it is there afterwards.
    Safe to call from several threads or processes at once: one downloads, the others wait and skip.
    progress: bytes bar per shard (None: only on a terminal)."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    _check_download_args(max_attempts, backoff_base)
    data_dir = get_data_dir(dataset) if data_dir is None else data_dir
    base_url = get_base_url(dataset) if base_url is None else base_url
    path = os.path.join(data_dir, index_to_filename(index))
    if os.path.exists(path):
        logger.debug("skipping %s: already there", path)
        return True
    os.makedirs(data_dir, exist_ok=True)
    with FileLock(_lock_path(path)):
        # another thread or process may have finished this shard while we waited for the lock
        if os.path.exists(path):
            logger.debug("skipping %s: downloaded by another process", path)
            return True
        return _download_locked(shard_url(index, base_url), path, max_attempts=max_attempts,
                                backoff_base=backoff_base, timeout=timeout, progress=progress)


def _probe_shard_bytes(url: str, timeout: float) -> int | None:
    """Content-Length of one shard from a HEAD request, or None when the server won't say."""
    try:
        response = requests.head(url, allow_redirects=True, timeout=timeout,
                                 headers={"Accept-Encoding": "identity"})
    except requests.RequestException as e:
        logger.info("HEAD %s failed (%s); using the per-shard estimate", url, e)
        return None
    if response.status_code != 200:
        return None
    return _content_length(response)


def check_disk_space(data_dir: str, num_shards: int, probe_url: str | None = None, *,
                     timeout: float = REQUEST_TIMEOUT) -> None:
    """Raise OSError(ENOSPC) if num_shards more shards would not fit in data_dir.
    Shard size comes from a HEAD of probe_url (shards of one dataset are within a few percent of
    each other), else SHARD_BYTES_ESTIMATE; 10% headroom is added either way."""
    if num_shards <= 0:
        return
    shard_bytes = _probe_shard_bytes(probe_url, timeout) if probe_url else None
    source = "from a HEAD request" if shard_bytes else "estimated"
    shard_bytes = shard_bytes or SHARD_BYTES_ESTIMATE
    need = int(shard_bytes * num_shards * DISK_MARGIN)
    free = shutil.disk_usage(data_dir).free
    if need > free:
        raise OSError(errno.ENOSPC,
                      f"{num_shards} shards need about {need / 1e9:.2f} GB ({shard_bytes / 1e6:.1f} MB each, "
                      f"{source}, +10%) but {data_dir} has {free / 1e9:.2f} GB free; free some space, "
                      "pass --data-dir on a bigger disk, or fetch fewer shards with -n")


def download_shards(indices, data_dir: str | None = None, base_url: str | None = None,
                    num_workers: int = 4, max_attempts: int = MAX_ATTEMPTS,
                    backoff_base: float = BACKOFF_BASE, *, dataset: str | None = None,
                    timeout: float = REQUEST_TIMEOUT, progress: bool | None = None,
                    check_disk: bool = True) -> list[int]:
    """Fetch the given shard indices with num_workers threads (0: in this thread).
    Returns the sorted indices that failed; empty means every shard is now on disk.
    Raises OSError before any download when check_disk finds the missing shards won't fit."""
    indices = sorted(set(indices))
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0: download in this thread), got {num_workers}")
    _check_download_args(max_attempts, backoff_base)
    data_dir = get_data_dir(dataset) if data_dir is None else data_dir
    base_url = get_base_url(dataset) if base_url is None else base_url
    missing = [i for i in indices if not os.path.exists(os.path.join(data_dir, index_to_filename(i)))]
    logger.info("%d of %d shards already in %s", len(indices) - len(missing), len(indices), data_dir)
    if not missing:
        return []
    os.makedirs(data_dir, exist_ok=True)
    if check_disk:
        check_disk_space(data_dir, len(missing), shard_url(missing[0], base_url), timeout=timeout)

    def fetch(index: int) -> bool:
        return download_single_file(index, data_dir, base_url, max_attempts, backoff_base,
                                    timeout=timeout, progress=progress)

    failed = []
    bar_off = None if progress is None else not progress
    with tqdm(total=len(indices), initial=len(indices) - len(missing), unit="shard",
              desc="shards", disable=bar_off) as bar:
        if num_workers <= 1:
            for index in missing:
                if not fetch(index):
                    failed.append(index)
                bar.update(1)
        else:
            with ThreadPoolExecutor(max_workers=num_workers) as pool:
                futures = {pool.submit(fetch, i): i for i in missing}
                for future in as_completed(futures):
                    if not future.result():
                        failed.append(futures[future])
                    bar.update(1)
    return sorted(failed)


# -----------------------------------------------------------------------------
# Repackaging your own text into shards

ROW_GROUP_SIZE = 1024  # documents per row group, like the hosted shards
SHARD_SIZE_MB = 100.0  # the hosted shards are ~100MB after zstd
INPUT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
RATIO_SAMPLE_DOCS = 2048  # documents compressed up front to estimate the zstd ratio of this data


def _read_txt(path: str, text_field: str):
    """One document per non-empty line (the usual layout of scraped text dumps)."""
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
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path} has no {text_field!r} column (columns: {names}); "
                         "pass the right one with --text-field")
    for rg_idx in range(pf.num_row_groups):
        column = pf.read_row_group(rg_idx, columns=[text_field]).column(text_field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ValueError(f"{path}: column {text_field!r} has type {column.type}, expected string")
        if column.null_count:
            raise ValueError(f"{path} row group {rg_idx}: column {text_field!r} has {column.null_count} nulls")
        yield from column.to_pylist()


def _reader_for(path: str):
    for suffix, reader in ((".jsonl.gz", read_jsonl_texts), (".jsonl", read_jsonl_texts),
                           (".txt", _read_txt), (".parquet", _read_parquet)):
        if path.endswith(suffix):
            return reader
    raise ValueError(f"{path}: unsupported input type; use one of {', '.join(INPUT_SUFFIXES)}")


def read_documents(paths: list[str], text_field: str = "text", *, progress: bool | None = None) -> list[str]:
    """All non-empty documents of the input files, in order. Empty ones are dropped: they would
    train nothing but a BOS. Every path is checked before any is read."""
    if not paths:
        raise ValueError("no input files given; pass .txt, .jsonl, .jsonl.gz or .parquet files")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file {path} does not exist")
        if not os.path.isfile(path):
            raise ValueError(f"input {path} is not a file; pass the files inside it")
        _reader_for(path)
    docs = []
    for path in tqdm(paths, unit="file", desc="reading", disable=None if progress is None else not progress):
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
    pq.write_table(pa.table({"text": pa.array(sample, type=pa.string())}), sink, compression="zstd")
    return max(raw / sink.getvalue().size, 1e-3)


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
        if docs_per_shard < 1:
            raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
        num_shards = math.ceil(len(docs) / docs_per_shard)
    else:
        shard_size_mb = SHARD_SIZE_MB if shard_size_mb is None else shard_size_mb
        if shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be > 0, got {shard_size_mb}")
        raw_bytes = sum(len(t.encode("utf-8")) for t in docs)
        compressed = raw_bytes / _zstd_ratio(docs[:RATIO_SAMPLE_DOCS])
        num_shards = math.ceil(compressed / (shard_size_mb * 1e6))
    if num_shards < 2:
        num_val = max(1, len(docs) // 10)
        return [len(docs) - num_val, num_val]
    base, extra = divmod(len(docs), num_shards)
    return [base + (i < extra) for i in range(num_shards)]


def _write_shard(path: str, texts: list[str], row_group_size: int) -> None:
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    tmp = path + ".tmp"  # never a *.parquet name, so a crash leaves nothing the loaders would read
    pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
    os.replace(tmp, path)


def repackage(inputs: list[str], out_dir: str, *, shard_size_mb: float | None = None,
              docs_per_shard: int | None = None, text_field: str = "text", seed: int = 42,
              row_group_size: int = ROW_GROUP_SIZE, progress: bool | None = None) -> list[str]:
    """Shuffle the documents of the input files and write them to out_dir as shard_00000.parquet, ...
    (one `text` column, zstd, row groups of row_group_size). The last shard is the validation split.
    Holds every document in memory. Returns the shard paths."""
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1, got {row_group_size}")
    if os.path.isdir(out_dir) and any(f.endswith(".parquet") for f in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds parquet files; mixing them with new shards would "
                              "change the train/val split, so pick an empty --out directory")
    docs = read_documents(list(inputs), text_field, progress=progress)
    sizes = plan_shard_sizes(docs, shard_size_mb=shard_size_mb, docs_per_shard=docs_per_shard)
    random.Random(seed).shuffle(docs)  # neighbours in a file are often related; mix them across shards
    os.makedirs(out_dir, exist_ok=True)
    paths, start = [], 0
    for index, size in enumerate(tqdm(sizes, unit="shard", desc="writing",
                                      disable=None if progress is None else not progress)):
        path = os.path.join(out_dir, index_to_filename(index))
        _write_shard(path, docs[start:start + size], row_group_size)
        paths.append(path)
        start += size
    assert start == len(docs)
    logger.info("wrote %d shards (%d documents) to %s", len(paths), len(docs), out_dir)
    return paths


# -----------------------------------------------------------------------------
# Command line


def _download_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset",
        description="Download pretraining shards (plus, always, the validation shard). "
                    "To convert your own text instead: python -m nanochat.dataset repackage --help")
    parser.add_argument("-n", "--num-files", type=int, default=-1,
                        help="number of train shards to fetch, from shard 0 (-1: all, 0: only val)")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (0: one at a time)")
    parser.add_argument("--dataset", default=None, help=f"one of {sorted(DATASETS)} (default: $NANOCHAT_DATASET, "
                                                        f"else {DEFAULT_DATASET})")
    parser.add_argument("--base-url", default=None, help="default: $NANOCHAT_DATA_URL, else the dataset's URL")
    parser.add_argument("--data-dir", default=None, help="default: <base dir>/<dataset subdir>")
    parser.add_argument("--backoff-base", type=float, default=BACKOFF_BASE,
                        help="seconds before the 2nd attempt; doubles after each failure")
    parser.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS, help="tries per shard")
    args = parser.parse_args(argv)
    if args.num_files < -1:
        parser.error(f"-n/--num-files must be >= -1 (-1 means all shards), got {args.num_files}")
    if args.num_workers < 0:
        parser.error(f"-w/--num-workers must be >= 0, got {args.num_workers}")
    if args.backoff_base < 0:
        parser.error(f"--backoff-base must be >= 0 seconds, got {args.backoff_base}")
    if args.max_attempts < 1:
        parser.error(f"--max-attempts must be >= 1, got {args.max_attempts}")

    spec = get_dataset(args.dataset)
    data_dir = args.data_dir or get_data_dir(spec.name)
    base_url = args.base_url or get_base_url(spec.name)
    num_train = spec.max_shard  # train shards are 0 .. max_shard-1
    num_files = num_train if args.num_files == -1 else args.num_files
    if num_files > num_train:
        print(f"-n {num_files} is past the last train shard of {spec.name}; clamping to {num_train}")
        num_files = num_train
    indices = list(range(num_files)) + [spec.max_shard]
    print(f"dataset={spec.name} train_shards={num_files} val_shard={spec.max_shard} "
          f"workers={args.num_workers} data_dir={data_dir} base_url={base_url} "
          f"max_attempts={args.max_attempts} backoff_base={args.backoff_base:g}s")
    failed = download_shards(indices, data_dir, base_url, args.num_workers, args.max_attempts,
                             args.backoff_base)
    print(f"downloaded {len(indices) - len(failed)}/{len(indices)} shards to {data_dir}")
    if failed:
        print(f"failed ({len(failed)}): {', '.join(index_to_filename(i) for i in failed)}")
        return 1
    return 0


def _repackage_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset repackage",
        description="Shuffle your own documents into nanochat shards (the last shard is val). "
                    ".txt: one document per non-empty line; .jsonl/.jsonl.gz: one JSON object per line; "
                    ".parquet: one row per document.")
    parser.add_argument("inputs", nargs="+", help=f"input files ({', '.join(INPUT_SUFFIXES)})")
    parser.add_argument("--out", required=True, help="output directory (must hold no parquet files)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--shard-size-mb", type=float, default=None,
                      help=f"target shard size after zstd (default {SHARD_SIZE_MB:g})")
    size.add_argument("--docs-per-shard", type=int, default=None, help="at most this many documents per shard")
    parser.add_argument("--text-field", default="text", help="JSON field or parquet column holding the text")
    parser.add_argument("--seed", type=int, default=42, help="shuffle seed")
    args = parser.parse_args(argv)
    print(f"inputs={len(args.inputs)} out={args.out} shard_size_mb={args.shard_size_mb} "
          f"docs_per_shard={args.docs_per_shard} text_field={args.text_field} seed={args.seed}")
    paths = repackage(args.inputs, args.out, shard_size_mb=args.shard_size_mb,
                      docs_per_shard=args.docs_per_shard, text_field=args.text_field, seed=args.seed)
    print(f"wrote {len(paths)} shards to {args.out}; the last, {os.path.basename(paths[-1])}, is val")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.dataset [-n N -w W ...]` downloads; `... repackage INPUTS --out DIR` converts.
    Returns the exit status (1 when a shard failed); bad input raises ValueError/FileNotFoundError/OSError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["repackage"]:
        return _repackage_main(argv[1:])
    return _download_main(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError; show one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
