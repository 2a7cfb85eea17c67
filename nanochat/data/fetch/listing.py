"""
The names of a source's shards, as the source lists them.
The names of a source's shards, as the source lists them: a server's index.json (`python -m
nanochat.dataset serve` writes it; docs/streaming.md#your-own-shards gives its format), or the
parquet files under a store's address; the hub lists none, and its shards bear the dataset's names.
The download and a streaming loader both take their split from it.

Cost: one small request (at most LISTING_MAX_BYTES), or one store listing, retried within limits.

Imported only when needed: nanochat.data.fetch.stores (a store's listing; fsspec with it).

May import: nanochat.data.base, nanochat.data.fetch.
"""

import json
import logging
import time

from nanochat.data.base.datasets import dataset_of, hosted, log_once, shard_index
from nanochat.data.base.layout import LISTING
from nanochat.data.fetch.address import is_http, shown
from nanochat.data.fetch.errors import DownloadError, StoreError
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.small_reads import fetch_small

logger = logging.getLogger(__name__)

LISTING_MAX_BYTES = 16 * 2**20  # a listing of 6,543 shards is ~300 KB


def read_listing(base_url: str, limits: Limits) -> list[str] | None:
    """The sorted names of the parquet files that <base_url>/index.json lists (python -m
    nanochat.dataset serve makes it; docs/streaming.md#your-own-shards gives its format), or None
    when the server has none (the Hugging Face hub); a store's address: the parquet files directly
    under it. Small requests, bounded by limits; a listing that cannot be read is a ConnectionError,
    one that is wrong a ValueError, naming it."""
    if not is_http(base_url):
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
    if not hosted(base_url):
        # a server of your own with no listing: its files must then bear the dataset's names
        log_once(logger, logging.WARNING, "%s not found: reading the dataset's shard names "
                 "from %s (shard_00000.parquet on, val the dataset's last index). For shards of "
                 "other names, serve them with python -m nanochat.dataset serve DIR, or write an "
                 "index.json beside them (docs/streaming.md, \"Your own shards\")", url, base_url)
    return None


def listing_url(base_url: str) -> str:
    return f"{base_url.rstrip('/')}/{LISTING}"


def listing_source(base_url: str) -> str:
    """What lists base_url's shards, for messages: its index.json (http), else the store's
    listing of the prefix."""
    return listing_url(shown(base_url)) if is_http(base_url) else shown(base_url)


def _store_listing(base_url: str, limits: Limits) -> list[str]:
    """The parquet names directly under a store's address (stores.list_names), retried with the
    download limits' backoff while the store says a retry can help, within their deadline; then a
    ConnectionError. One a retry cannot help (not found, no credentials) is raised as it is."""
    from nanochat.data.fetch.stores import list_names  # (late: a loader that reads no store)
    deadline = time.monotonic() + limits.deadline
    for attempt in range(1, limits.max_attempts + 1):
        try:
            names = list_names(base_url, limits.timeout)
            break
        except StoreError as e:
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


def check_own(listing: list[str], data_dir: str, source: str) -> None:
    """ValueError when a listing of shards of your own would go into a dataset's directory."""
    own = dataset_of(data_dir)
    if own and (listing[-1] != own.val_filename
                or any(shard_index(name, own) is None for name in listing)):
        raise ValueError(
            f"{source} lists shards of your own (val {listing[-1]}), and "
            f"data_dir {data_dir} is the directory of {own.name}: their names could collide "
            f"with {own.name}'s shards there. Pass a data_dir of their own as the cache, e.g. "
            "data_dir=\"~/.cache/nanochat/my_shards\" (scripts.base_train: --data-dir; "
            "scripts that pass none, such as nanochat's: NANOCHAT_DATA_DIR)")
