"""
The files beside a fetched file: its temp file, its lock and its `.json` record.
Their names, the record's reading and writing (atomic, never through a symlink), and what an
installed file's record says: its size, sha256, source and source_version, the hashes that vouched
for it.

May import: nanochat.data.base.checks, nanochat.data.base.files, nanochat.data.fetch.address,
nanochat.data.fetch.errors.
"""

import errno
import json
import os
import urllib.parse

from nanochat.data.base.checks import is_int
from nanochat.data.base.files import fsync_dir, remove_if_exists
from nanochat.data.fetch.address import is_http, is_local, path_in_store
from nanochat.data.fetch.errors import BadFileError, GiveUp


# -----------------------------------------------------------------------------
# The names beside a file: its temp file, its record, its lock


def tmp_path(path: str) -> str:
    return path + ".tmp"  # never a *.parquet name, so the listing never sees a partial file


def record_path(path: str) -> str:
    """`<path>.json`: what was verified about path (size, sha256), or for a `.tmp` which version it
    holds."""
    return path + ".json"


def lock_path(path: str) -> str:
    # a hidden name that does not end in .parquet, so the listing never sees it. We never delete it
    # ourselves: unlinking a lock file another process is waiting on lets a third process lock a
    # fresh file of the same name, and then two writers would share one temp file.
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.lock")


# -----------------------------------------------------------------------------
# Reading and writing beside a file, never through a link


def discard(tmp: str) -> None:
    remove_if_exists(tmp)
    remove_if_exists(record_path(tmp))  # a record without its bytes would vouch for nothing


def size_on_disk(path: str) -> int:
    return os.lstat(path).st_size if os.path.lexists(path) else 0  # lstat: a link's own size


def open_nofollow(path: str, flags: int, mode: str):
    """os.open with O_NOFOLLOW: a symlink at path is an error; its target is never read or
    written."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # what O_NOFOLLOW gives for a symlink
            raise GiveUp("symlink in the way",
                         f"{path} is a symbolic link; the downloader never writes through one. "
                         f"Remove the link (rm {path}) and rerun") from None
        raise
    return os.fdopen(fd, mode)


def resumable(tmp: str) -> int:
    """Bytes of tmp a next attempt can resume from: none unless its record names a validator."""
    try:
        record = read_json(record_path(tmp))
    except BadFileError:
        return 0
    return size_on_disk(tmp) if record and record.get("validator") else 0


def write_json(path: str, record: dict) -> None:
    """Write a small JSON record atomically (the caller holds the file's lock, so the temp name is
    ours)."""
    tmp = tmp_path(path)
    try:
        with open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the record
        os.replace(tmp, path)
    except OSError:
        remove_if_exists(tmp)  # (a full disk: an empty temporary file would stay for good)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # and the rename itself survives a crash


def read_json(path: str) -> dict | None:
    """The record at path, None when there is none; BadFileError when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadFileError("unreadable record", f"{path} could not be read ({e})") from None
    if not isinstance(record, dict):
        raise BadFileError("unreadable record",
                           f"{path} holds {type(record).__name__}, not a JSON object")
    return record


def record_or_none(path: str) -> dict | None:
    """path's record; None when there is none or it cannot be read (check_file says why)."""
    try:
        return read_json(record_path(path))
    except BadFileError:
        return None


# -----------------------------------------------------------------------------
# What an installed file's record says


def source_of(address: str) -> str:
    """What a shard's record names as its source: the address without a URL's user:password@, a
    local directory's file by its real path (two spellings of one source are one)."""
    if is_http(address):
        parts = urllib.parse.urlsplit(address)
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    if is_local(address):
        return os.path.realpath(path_in_store(address))
    return address


def recorded_source(path: str) -> str | None:
    """The source path's record names (source_of the address it was fetched from); None when it
    has no readable record, or a record written before sources were recorded."""
    source = (record_or_none(path) or {}).get("source")
    return source if isinstance(source, str) else None


def recorded_size(path: str) -> int | None:
    """The size path was verified at when it was installed (its record's); None without a
    readable record."""
    size = (record_or_none(path) or {}).get("size")
    return size if is_int(size) else None


def stated_check(path: str) -> str | None:
    """The hashes the server or store stated that path matched when it was installed, e.g.
    "sha256" or "crc32, md5"; None when none was stated (only its size and parquet structure were
    checked: never call it "verified") or path has no readable record."""
    record = record_or_none(path) or {}
    names = record.get("stated_hashes")
    if not isinstance(names, list):
        names = ["sha256"] if record.get("sha256_stated_by_server") is True else []
    return ", ".join(names) or None
