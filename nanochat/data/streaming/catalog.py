"""
The catalog of a streamed split: each shard's size and documents per row group.
Both are known before the shard is fetched: they come from the end of the file, one ranged read per
shard, and are kept in DATA_DIR/.stream/catalog.json, so a restart reads nothing over the network
for them. It is data about the files at their URLs, a file of its own beside the ledger, written
under its own lock (.stream/catalog.lock), held while footers are read: the local ranks read each
footer once. An entry carries a checksum; one that is damaged, or that disagrees with its shard on
disk, is read again. The server's listing of the shards is kept beside it (.stream/listing.json).
Design: docs/streaming.md.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.streaming.streamed_split,
nanochat.data.base.files, nanochat.data.streaming.ledger.
"""

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock
from tqdm import tqdm

from nanochat.data.base.checks import is_int
from nanochat.data.base.datasets import open_parquet
from nanochat.data.fetch.address import shown
from nanochat.data.fetch.listing import read_listing
from nanochat.data.streaming.streamed_split import stream_source, streamed_split
from nanochat.data.fetch.errors import DownloadError, HostNotFoundError
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.records import recorded_size, recorded_source, source_of
from nanochat.data.fetch.small_reads import TAIL_BYTES, fetch_tail
from nanochat.data.fetch.sources import SOURCE_FIX, check_sources, check_versions
from nanochat.data.fetch.verify import MAGIC
from nanochat.data.base.files import file_stamp, warn_once, write_atomic
from nanochat.data.streaming.ledger import STREAM_DIR

logger = logging.getLogger(__name__)

CATALOG = "catalog.json"  # in STREAM_DIR: shard name -> {"url", "size", "rows", "check"}
# (the format's key "rows" holds a shard's documents per row group: catalog_entry)
# in STREAM_DIR: held while footers are read and the catalog written. Not the ledger's lock, which
# loaders take every few ms: reading thousands of footers takes a minute
CATALOG_LOCK = "catalog.lock"
LISTING_KEPT = "listing.json"  # in STREAM_DIR: {"base_url", "names"}: the server's last listing
CHUNK = 256  # footers read between two writes of the catalog: a reader killed loses at most these
CHANGED_FIX = ("Pass another data_dir for the source as it is now, or remove those shards, their "
               ".json records and .stream/catalog.json to stream the new files in their place")

# path -> (file_stamp, valid entries) of the catalog last read: a loader looks up sizes before each
# download, and checking a catalog of 6,543 shards takes ~0.4 s (reading the file again, ~0.1 ms)
_loaded: dict[str, tuple] = {}


def catalog_path(data_dir: str) -> str:
    return os.path.join(data_dir, STREAM_DIR, CATALOG)


def _check(url: str, size: int, docs_per_group: list[int]) -> str:
    """An entry's checksum: an entry changed on disk (a flipped bit, an edit) is read again rather
    than planned on."""
    return hashlib.sha256(json.dumps([url, size, docs_per_group]).encode()).hexdigest()[:16]


def catalog_entry(url: str, size: int, docs_per_group: list[int]) -> dict:
    """A shard's entry: its URL, its bytes, its documents per row group, and their checksum."""
    return {"url": url, "size": size, "rows": docs_per_group,
            "check": _check(url, size, docs_per_group)}


def _valid(entry) -> bool:
    """Whether a catalog value is an entry as catalog_entry makes them, its checksum right (an
    entry without one, as a version of this library before checksums wrote it, is kept by its
    shape: reading thousands of footers again would cost minutes)."""
    if not isinstance(entry, dict) or set(entry) - {"check"} != {"url", "size", "rows"}:
        return False
    url, size, docs_per_group = entry["url"], entry["size"], entry["rows"]
    fine = isinstance(url, str) and is_int(size) and size >= 0 and isinstance(docs_per_group, list)
    fine = fine and all(is_int(n) and n >= 0 for n in docs_per_group)
    check = _check(url, size, docs_per_group)
    return fine and entry.get("check", check) == check


def _load(path: str) -> dict[str, dict]:
    """The catalog's valid entries (a copy of the dict: the caller may add to it). A file that is
    unreadable or not an object of entries, or entries of the wrong shape or checksum, are named in
    one warning (once per version of the file), and left out: they are read again, and the next
    write of the catalog drops them."""
    try:
        with open(path, "rb") as f:
            stamp, cached = file_stamp(f.fileno()), _loaded.get(path)
            if cached is not None and cached[0] == stamp:
                return dict(cached[1])
            data = f.read()
    except FileNotFoundError:
        return {}
    except OSError as e:  # (a directory in its place, no permission: the same until fixed)
        warn_once(logger, path, (type(e).__name__, e.errno), "%s is unreadable (%s); its entries "
                  "are read again", path, e)
        return {}
    known = _parse(path, stamp, data)
    _loaded[path] = (stamp, known)
    return dict(known)


def _parse(path: str, stamp: tuple, data: bytes) -> dict[str, dict]:
    """The valid entries of a catalog file's bytes, the others named in a warning."""
    try:
        value = json.loads(data)
    except ValueError as e:
        warn_once(logger, path, stamp, "%s is unreadable (%s); its entries are read again",
                  path, e)
        return {}
    if not isinstance(value, dict):
        warn_once(logger, path, stamp, "%s is not an object of shard entries; they are read "
                  "again", path)
        return {}
    known = {name: catalog_entry(entry["url"], entry["size"], entry["rows"])
             for name, entry in value.items() if _valid(entry)}
    if len(known) < len(value):
        bad = sorted(set(value) - set(known))
        warn_once(logger, path, stamp, "%s: %d entries of the wrong shape or checksum (%s); read "
                  "again", path, len(bad), ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else ""))
    return known


def catalog_sizes(data_dir: str) -> dict[str, int]:
    """name -> bytes of every shard in the catalog, whichever split's loader read it."""
    return {name: entry["size"] for name, entry in _load(catalog_path(data_dir)).items()}


def footer_docs_per_group(tail: bytes, url: str) -> list[int] | None:
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


def _file_entry(path: str, url: str) -> dict:
    """The catalog entry of a shard on disk (complete: only verified files have final names)."""
    meta = open_parquet(path).metadata
    docs_per_group = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return catalog_entry(url, os.path.getsize(path), docs_per_group)


def _as_installed(path: str, url: str) -> bool:
    """Whether the shard at path is on disk with the size its download was verified at (its
    record's), fetched from url's source: a file cut short or replaced since is not read for the
    catalog, and the cache fetches it again; one from another source is not url's shard."""
    try:
        size_ok = recorded_size(path) == os.path.getsize(path)
    except FileNotFoundError:  # (not fetched, or evicted)
        return False
    return size_ok and recorded_source(path) in (None, source_of(url))


def _read_entry(path: str, url: str, limits: Limits) -> dict:
    """One shard's catalog entry: from the file when it is on disk as installed, else from its
    footer on the server."""
    if _as_installed(path, url):
        try:
            return _file_entry(path, url)
        except (FileNotFoundError, ValueError):  # (evicted since, or damaged in place)
            pass
    size, tail = fetch_tail(url, TAIL_BYTES, limits)
    docs_per_group = footer_docs_per_group(tail, url)
    if docs_per_group is None:  # a footer longer than one request: ask for exactly it
        size, tail = fetch_tail(url, int.from_bytes(tail[-8:-4], "little") + 8, limits)
        docs_per_group = footer_docs_per_group(tail, url)
    return catalog_entry(url, size, docs_per_group)


def _disagree(data_dir: str, names: list[str], known: dict) -> list[str]:
    """The shards on disk whose size is not their entry's. (A size is one stat; documents per row
    group that differ at the same size would take reading every footer on disk, and the checksum
    catches an edit.)"""
    wrong = []
    for name in names:
        try:
            size = os.path.getsize(os.path.join(data_dir, name))
        except FileNotFoundError:
            continue
        if name in known and known[name]["size"] != size:
            wrong.append(name)
    return wrong


def read_catalog(data_dir: str, names: list[str], urls: list[str], limits: Limits,
                 workers: int = 16, *, verify: bool = False) -> list[dict]:
    """The catalog entries {"url", "size", "rows", "check"} of the given shards, in order: from the
    catalog file, or read (16 requests at a time) and added to it. verify: entries that disagree
    with their shard on disk are corrected from the file, with a warning. Raises ConnectionError
    naming the shard and URL when a footer cannot be fetched."""
    directory = os.path.join(data_dir, STREAM_DIR)
    os.makedirs(directory, exist_ok=True)
    path = catalog_path(data_dir)
    known = _load(path)
    if _missing(names, urls, known) or (verify and _disagree(data_dir, names, known)):
        # one process at a time reads footers: the others then find them in the file. A wait is
        # bounded: the holder's requests by the download limits, and a killed holder's lock is
        # released by the OS
        with FileLock(os.path.join(directory, CATALOG_LOCK)):
            known = _load(path)  # (as the last holder left it)
            fixed = _correct(data_dir, names, urls, known) if verify else {}
            if fixed:
                known |= fixed
                write_atomic(path, json.dumps(known).encode())
            known |= _read_missing(data_dir, _missing(names, urls, known), known, limits, workers)
    return [known[name] for name in names]


def _missing(names: list[str], urls: list[str], known: dict) -> list[tuple[str, str]]:
    # (keyed by URL too: a shard from another server is another file)
    return [(name, url) for name, url in zip(names, urls) if known.get(name, {}).get("url") != url]


def _correct(data_dir: str, names: list[str], urls: list[str], known: dict) -> dict[str, dict]:
    """The entries of the shards on disk that disagree with them, from the files, each named in a
    warning with both values: the cause shows here, before a resume is refused for files that
    differ from the ones its state was taken on."""
    url_of = dict(zip(names, urls))
    fixed = {}
    for name in _disagree(data_dir, names, known):
        path = os.path.join(data_dir, name)
        if not _as_installed(path, url_of[name]):  # the file is what is wrong: fetched again
            continue
        try:
            entry, fixed[name] = known[name], _file_entry(path, url_of[name])
        except (FileNotFoundError, ValueError):  # (evicted since, or damaged in place)
            continue
        logger.warning(
            "the catalog %s says shard %s has %d bytes in %d row groups, but the file on disk, "
            "verified when it was downloaded, has %d bytes in %d: the entry is corrected from the "
            "file", catalog_path(data_dir), name, entry["size"], len(entry["rows"]),
            fixed[name]["size"], len(fixed[name]["rows"]))
    return fixed


def _read_missing(data_dir: str, missing: list[tuple[str, str]], known: dict, limits: Limits,
                  workers: int) -> dict[str, dict]:
    """The entries of `missing` (name, url), read 16 footers at a time and written to the catalog
    (with `known`, the rest of it) every CHUNK of them. The caller holds the catalog's lock."""
    if not missing:
        return {}
    path = catalog_path(data_dir)
    logger.info("reading the footers of %d shards from %s (kept in %s)", len(missing),
                shown(missing[0][1].rsplit("/", 1)[0]), path)

    def one(item):
        name, url = item
        try:
            return name, _read_entry(os.path.join(data_dir, name), url, limits)
        except DownloadError as e:
            # (the downloader's message starts with the URL, named here already)
            raise ConnectionError(f"could not read the footer of shard {name} from {shown(url)}: "
                                  f"{shown(str(e).removeprefix(f'{url}: '))}") from None

    found: dict[str, dict] = {}
    # (disable=None: a bar on a terminal only)
    with ThreadPoolExecutor(max(1, min(workers, len(missing)))) as pool, \
            tqdm(total=len(missing), unit="footer", desc="catalog", disable=None,
                 leave=False) as bar:
        for start in range(0, len(missing), CHUNK):
            found |= dict(pool.map(one, missing[start:start + CHUNK]))
            write_atomic(path, json.dumps(known | found).encode())
            bar.update(min(CHUNK, len(missing) - start))
    return found


class StreamedSplit(NamedTuple):
    """A streamed split's shards, where they go and where they come from, and their catalog."""
    data_dir: str  # the cache's directory
    paths: list[str]  # each shard's path in it (not on disk until fetched)
    urls: list[str]
    val: dict[str, int]  # the val shard's name -> its bytes (never evicted)
    entries: list[dict]  # the shards' catalog entries {"url", "size", "rows", "check"}


def streamed_files(split: str, data_dir: str | None, num_shards: int | None, base_url: str | None,
                   limits: Limits) -> StreamedSplit:
    """A streamed split (streamed_split: by the server's listing when it has one) with its catalog
    entries."""
    listing = kept_listing(data_dir, base_url, limits)
    shards = streamed_split(split, data_dir, num_shards, base_url, listing)
    data_dir, paths, urls = shards.data_dir, shards.paths, shards.urls
    val = streamed_split("val", data_dir, num_shards, base_url, listing)
    val_paths, val_urls = val.paths, val.urls
    # a cache holds one source's shards, as the source states them now: another's, or an old
    # version of its own, are refused here, at the start, before any is read
    files = list(zip(urls + val_urls, paths + val_paths))
    check_sources(files, SOURCE_FIX, limits)
    check_versions(files, CHANGED_FIX, limits)
    names = [os.path.basename(p) for p in paths]
    # (the val shard's entry too: every loader's budget holds it)
    entries = read_catalog(data_dir, list(dict.fromkeys(names + [shards.val_name])),
                           list(dict.fromkeys(urls + val_urls)), limits, verify=True)
    return StreamedSplit(data_dir, paths, urls, {shards.val_name: entries[-1]["size"]},
                         entries[:len(names)])


def kept_listing(data_dir: str | None, base_url: str | None, limits: Limits) -> list[str] | None:
    """The names the server or store lists (fetch.listing's read_listing), asked at every start:
    a listing kept from an earlier one would hide the shards added since. Kept in DATA_DIR/.stream/
    listing.json all the same, for when the source cannot be reached: a restart or a merge that
    needs no shard from it goes on, with a warning, as it does with the catalog."""
    data_dir, base_url = stream_source(data_dir, base_url)
    directory = os.path.join(data_dir, STREAM_DIR)
    path, record = os.path.join(directory, LISTING_KEPT), None
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):  # (none yet, or unreadable: written again below)
        pass
    try:
        names = read_listing(base_url, limits)
    except (ConnectionError, HostNotFoundError) as e:
        if not _kept_for(record, base_url):
            raise
        logger.warning("%s; going on with the listing kept in %s", e, path)
        return record["names"]
    if record != {"base_url": base_url, "names": names}:
        os.makedirs(directory, exist_ok=True)
        with FileLock(os.path.join(directory, CATALOG_LOCK)):  # (one writer at a time)
            write_atomic(path, json.dumps({"base_url": base_url, "names": names}).encode())
    return names


def _kept_for(record, base_url: str) -> bool:
    """Whether a kept listing is base_url's, of the shape kept_listing writes."""
    if not isinstance(record, dict) or record.get("base_url") != base_url:
        return False
    names = record.get("names")  # (None: the server had no listing)
    return names is None or (isinstance(names, list) and len(names) >= 2  # (a train and val)
                             and all(isinstance(n, str) for n in names))
