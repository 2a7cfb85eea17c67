"""
Checks of a file on disk: parquet structure, its record, the hashes a source states.
Parquet: PAR1 at both ends, a footer that reads, column chunks inside the file, every page when
nothing else vouches for them. The record: size and sha256. A store's hashes (md5, sha1, sha256,
crc32, crc32c) in one read of the file.

Cost: a ~100MB shard's checks take ~0.07 s from the page cache (sha256 at ~1.4 GB/s); reading its
pages ~0.6 s, once, and only when no hash was stated.

May import: nanochat.data.base.files, nanochat.data.fetch.address, nanochat.data.fetch.errors,
nanochat.data.fetch.records, pyarrow.
"""

import hashlib
import importlib
import logging
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.data.base.files import progress_bar
from nanochat.data.fetch.address import redact
from nanochat.data.fetch.errors import BadFileError
from nanochat.data.fetch.records import read_json, record_path

logger = logging.getLogger(__name__)

MAGIC = b"PAR1"  # every parquet file starts and ends with it


# -----------------------------------------------------------------------------
# A file on disk: sound parquet, and the file its record describes


def check_file(path: str) -> None:
    """Raise BadFileError unless path is a sound parquet file that matches its record, when it has
    one (size and sha256, checked in that order). Every page is read too (check_pages) unless the
    record vouches for them (pages_vouched): a shard the server stated no sha256 for is read once,
    a file without a record at every check."""
    record = read_json(record_path(path))
    if record is not None and not (isinstance(record.get("size"), int)
                                   and re.fullmatch(r"[0-9a-f]{64}", str(record.get("sha256")))):
        raise BadFileError("unreadable record", f"{record_path(path)} lacks a size and a sha256")
    try:
        size = os.path.getsize(path)
        # cheapest first: the size costs a stat, the sha256 reads the whole file
        if record is not None and size != record["size"]:
            raise BadFileError("wrong size",
                               f"{path} has {size} bytes, its record says {record['size']}")
        check_parquet(path)
        if record is not None and sha256_of(path) != record["sha256"]:
            raise BadFileError("sha256 mismatch",
                               f"{path} does not hash to the sha256 in its record")
        if not pages_vouched(record):
            check_pages(path)
    except OSError as e:  # a directory or an unreadable file under the name
        raise BadFileError("unreadable", f"{path} could not be read ({e})") from None


def check_files(paths: list[str], num_workers: int = 4, *,
                progress: bool | None = None) -> dict[str, BadFileError]:
    """check_file on each path with num_workers threads; returns {path: error} for the bad ones."""
    def check(path):
        try:
            check_file(path)
        except BadFileError as e:
            return e
        return None

    bad = {}
    with ThreadPoolExecutor(max_workers=max(num_workers, 1)) as pool:
        results = pool.map(check, paths)  # in the order of paths, so the bar counts in order
        # the bar first: zip then asks it once more, and it counts the last file and closes
        for error, path in zip(progress_bar(results, progress=progress, total=len(paths),
                                            unit="file", desc="checking"), paths):
            if error is not None:
                bad[path] = error
    return bad


def problem_with(path: str) -> BadFileError | str | None:
    """None when path is there and sound; "" when it is missing; else what is wrong with it."""
    if not os.path.exists(path):
        return ""
    try:
        check_file(path)
    except BadFileError as e:
        return e
    return None


def pages_vouched(record: dict | None) -> bool:
    """Whether a record whose sha256 the file matches also vouches that every page reads: the server
    stated that sha256, or a store a hash it matched (the bytes are the publisher's), or the pages
    were read before."""
    return record is not None and (record.get("sha256_stated_by_server") is True
                                   or record.get("pages_checked") is True
                                   or bool(record.get("stated_hashes")))


# -----------------------------------------------------------------------------
# The parquet checks: magic, footer, where each column chunk lies, every page


def check_parquet(path: str) -> None:
    """Raise BadFileError unless path starts and ends with PAR1, its footer parses, and every column
    chunk of every row group lies between the leading magic and the footer."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4)
        f.seek(max(size - 8, 0))
        tail = f.read(8)  # the footer's length (4 bytes, little-endian), then PAR1
        # 12 bytes: PAR1, a footer length and PAR1, the least a parquet file can be
        if size < 12 or head != MAGIC:
            raise BadFileError("not parquet", f"{path} does not start with PAR1 ({size} bytes, "
                                              f"starting with {head!r})")
        if tail[4:] != MAGIC:
            raise BadFileError("not parquet", f"{path} does not end with PAR1 ({size} bytes): "
                                              "truncated, or not a parquet file")
        footer_start = size - 8 - int.from_bytes(tail[:4], "little")
        try:
            metadata = pq.ParquetFile(f).metadata
            # a footer can parse and still point past the data (a file cut and padded): each
            # column chunk must lie inside the file, or reading it later fails mid-epoch
            for i in range(metadata.num_row_groups):
                row_group = metadata.row_group(i)
                for j in range(row_group.num_columns):
                    column = row_group.column(j)
                    first = (column.dictionary_page_offset if column.has_dictionary_page
                             else column.data_page_offset)
                    if not 4 <= first <= first + column.total_compressed_size <= footer_start:
                        raise BadFileError("unreadable parquet metadata",
                                           f"{path}: row group {i} column {j} lies outside the "
                                           f"data (bytes {first}+{column.total_compressed_size}, "
                                           f"footer at {footer_start})")
        except (pa.ArrowException, OSError) as e:
            raise BadFileError("unreadable parquet metadata",
                               f"{path} has no readable parquet footer ({e})") from None


def check_pages(path: str) -> None:
    """Raise BadFileError unless every row group of path reads: each page decompresses and decodes,
    as a reader will need them to (~0.6 s for a 124MB shard of 300 MB of text). Run after
    check_parquet."""
    with open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        for i in range(parquet.metadata.num_row_groups):
            try:
                parquet.read_row_group(i)  # every column: the text and whatever else is there
            except (pa.ArrowException, OSError) as e:
                raise BadFileError("corrupt page",
                                   f"{path}: row group {i} does not read ({e})") from None


# -----------------------------------------------------------------------------
# Hashes: the sha256, and every hash a store states, in one read


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            # hashlib releases the GIL for big buffers: threads hash in parallel
            digest.update(chunk)
    return digest.hexdigest()


def digests_of(path: str, stated: dict) -> dict:
    """{"sha256": hex} of path, with each hash named in stated that we can compute (md5, sha1,
    sha256 hex; crc32, crc32c, crc64nvme int), all in one read of the file."""
    hashers = {"sha256": hashlib.sha256()}
    hashers |= {name: hashlib.new(name, usedforsecurity=False) for name in ("md5", "sha1")
                if name in stated}
    crcs = {"crc32": lambda data, value: zlib.crc32(data, value)} if "crc32" in stated else {}
    for name in _OPTIONAL_CRCS:
        update = _optional_crc(name) if name in stated else None
        if update is not None:
            crcs[name] = update
    values = dict.fromkeys(crcs, 0)
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            for hasher in hashers.values():
                hasher.update(chunk)
            for name, update in crcs.items():
                values[name] = update(chunk, values[name])
    return {name: hasher.hexdigest() for name, hasher in hashers.items()} | values


_OPTIONAL_CRCS = {
    "crc32c": (("google_crc32c", lambda m, data, value: m.extend(value, data)),
               ("crc32c", lambda m, data, value: m.crc32c(data, value)),
               ("awscrt.checksums", lambda m, data, value: m.crc32c(data, value))),
    "crc64nvme": (("awscrt.checksums", lambda m, data, value: m.crc64nvme(data, value)),)}


_CRC_PACKAGES = {"crc32c": "google-crc32c", "crc64nvme": "awscrt"}


def _optional_crc(name: str):
    """update(data, value) -> value for a CRC of _OPTIONAL_CRCS, or None when no module for it is
    installed."""
    for module_name, extend in _OPTIONAL_CRCS[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        return lambda data, value: extend(module, data, value)
    return None


def check_stated(tmp: str, record: dict, digests: dict) -> list[str]:
    """The names of the store's stated hashes tmp matches (sorted); BadFileError on a mismatch.
    One that cannot be computed here (crc32c without its package) is skipped, not counted."""
    matched = []
    for name, want in sorted(record["hashes"].items()):
        if name not in digests:
            logger.info("%s: %s stated by the store not checked (pip install %s)", tmp, name,
                        _CRC_PACKAGES.get(name, "its package"))
            continue
        if digests[name] != want:
            raise BadFileError(f"{name} mismatch",
                               f"{tmp} has {name} {_shown(digests[name])}, the store stated "
                               f"{_shown(want)} for {redact(record['url'])}")
        matched.append(name)
    return matched


def _shown(value) -> str:
    return f"{value:08x}" if isinstance(value, int) else str(value)  # a crc as 8 hex digits
