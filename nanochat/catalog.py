"""
The catalog of a streamed split: each shard's size and documents per row group, known before the
shard is fetched. Both come from the end of the file, one HTTP Range request per shard, and are kept
in DATA_DIR/.stream/catalog.json: a restart reads nothing over the network for them. The catalog is
data about the files at their URLs, written once per shard, so it stays a file of its own beside
the ledger (it coordinates nothing), written under the ledger's lock. Also the two estimates the
start check of a loader's cache_limit uses. Design: docs/streaming.md.

May import: nanochat.dataset, nanochat.download, nanochat.ledger.
"""

import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock
from tqdm import tqdm

from nanochat.dataset import open_parquet, streamed_split
from nanochat.download import MAGIC, TAIL_BYTES, DownloadError, Limits, fetch_tail
from nanochat.ledger import LOCK, STREAM_DIR

logger = logging.getLogger(__name__)

CATALOG = "catalog.json"  # in STREAM_DIR: shard name -> {"url", "size", "rows"}


def _read_json(path: str, default):
    """A JSON file's value; `default` when it is missing or unreadable (with a warning)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        logger.warning("%s is unreadable (%s); starting it afresh", path, e)
        return default


def _write_json(path: str, value) -> None:
    """Write whole, then rename: a reader (who takes no lock) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"  # (a pid each: two processes never share a temporary file)
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def catalog_path(data_dir: str) -> str:
    return os.path.join(data_dir, STREAM_DIR, CATALOG)


def catalog_sizes(data_dir: str) -> dict[str, int]:
    """name -> bytes of every shard in the catalog, whichever split's loader read it."""
    catalog = _read_json(catalog_path(data_dir), {})
    entries = catalog.items() if isinstance(catalog, dict) else ()
    return {name: entry.get("size", 0) for name, entry in entries if isinstance(entry, dict)}


def footer_rows(tail: bytes, url: str) -> list[int] | None:
    """Documents per row group from a parquet file's last bytes; None when they do not hold
    the whole footer."""
    # 12: the least a parquet file ends with (magic, a footer's length, magic)
    if len(tail) < 12 or tail[-4:] != MAGIC:
        raise ValueError(f"{url} does not end with {MAGIC!r}: not a parquet file")
    length = int.from_bytes(tail[-8:-4], "little")  # the footer's length, just before the magic
    if length + 8 > len(tail):
        return None
    try:
        meta = pq.read_metadata(pa.BufferReader(MAGIC + tail[-(length + 8):]))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{url}: its parquet footer cannot be read ({e})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _entry(path: str, url: str, limits: Limits) -> dict:
    """One shard's catalog entry: from the file when it is on disk (complete: only verified files
    have final names), else from its footer on the server."""
    if os.path.exists(path):
        meta = open_parquet(path).metadata
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        return {"url": url, "size": os.path.getsize(path), "rows": rows}
    size, tail = fetch_tail(url, TAIL_BYTES, limits)
    rows = footer_rows(tail, url)
    if rows is None:  # a footer longer than one request: ask for exactly it
        size, tail = fetch_tail(url, int.from_bytes(tail[-8:-4], "little") + 8, limits)
        rows = footer_rows(tail, url)
    return {"url": url, "size": size, "rows": rows}


def read_catalog(data_dir: str, names: list[str], urls: list[str], limits: Limits,
                 workers: int = 16) -> list[dict]:
    """The catalog entries {"url", "size", "rows"} of the given shards, in order: from the catalog
    file, or read (16 requests at a time) and added to it. Raises ConnectionError naming the shard
    and URL when a footer cannot be fetched."""
    directory = os.path.join(data_dir, STREAM_DIR)
    os.makedirs(directory, exist_ok=True)
    path = catalog_path(data_dir)
    known = _read_json(path, {})
    # (keyed by URL too: a shard from another server is another file)
    missing = [(name, url) for name, url in zip(names, urls)
               if known.get(name, {}).get("url") != url]
    if missing:
        logger.info("reading the footers of %d shards from %s (kept in %s)", len(missing),
                    missing[0][1].rsplit("/", 1)[0], path)

        def one(item):
            name, url = item
            try:
                return name, _entry(os.path.join(data_dir, name), url, limits)
            except DownloadError as e:
                raise ConnectionError(
                    f"could not read the footer of shard {name} from {url}: {e}") from None

        with ThreadPoolExecutor(max(1, min(workers, len(missing)))) as pool:
            # (disable=None: a bar on a terminal only)
            found = dict(tqdm(pool.map(one, missing), total=len(missing), unit="footer",
                              desc="catalog", disable=None, leave=False))
        with FileLock(os.path.join(directory, LOCK)):  # (other loaders may add their entries too)
            known = _read_json(path, {}) | found
            _write_json(path, known)
    return [known[name] for name in names]


def streamed_files(split: str, data_dir: str | None, num_shards: int | None, base_url: str | None,
                   limits: Limits) -> tuple[str, list[str], list[str], dict[str, int], list[dict]]:
    """A streamed split (nanochat.dataset.streamed_split) with its catalog entries:
    (data_dir, paths, URLs, {the val shard's name: its size}, catalog entries)."""
    data_dir, paths, urls, val_name = streamed_split(split, data_dir, num_shards, base_url)
    _, _, val_urls, _ = streamed_split("val", data_dir, num_shards, base_url)
    names = [os.path.basename(p) for p in paths]
    # (the val shard's entry too: every loader's budget holds it)
    entries = read_catalog(data_dir, list(dict.fromkeys(names + [val_name])),
                           list(dict.fromkeys(urls + val_urls)), limits)
    return data_dir, paths, urls, {val_name: entries[-1]["size"]}, entries[:len(names)]


# -----------------------------------------------------------------------------
# The estimates of the start check


def packing_shards(entries: list[dict], rank: int, world_size: int, read_ahead: int) -> int:
    """The most shards that `read_ahead` documents (read and not yet packed) and the one the reader
    has just opened can span for this rank: one more than its fewest documents of a shard (its row
    groups of it) divide them into."""
    shares = [sum(entry["rows"][rank::world_size]) for entry in entries]
    return 1 + math.ceil(read_ahead / max(min((n for n in shares if n), default=1), 1))


def copies_estimate(entries: list[dict], buffer_docs: int) -> int:
    """What the copies of `buffer_docs` buffered documents may take, an estimate: twice their bytes
    at the split's most bytes per document of a shard (best-fit keeps long documents waiting)."""
    per_doc = max(entry["size"] / max(sum(entry["rows"]), 1) for entry in entries)
    return int(2 * buffer_docs * per_doc)
