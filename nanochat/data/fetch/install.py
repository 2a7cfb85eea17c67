"""
A download's temp file, from its first byte to its final name.
How much of it a next attempt may keep (a prefix of the same version, never a splice of two), and
its installation once verified: the record first, fsync, rename, fsync of the directory, so that a
name never holds a partial file.

May import: nanochat.data.base.files, nanochat.data.fetch.errors, nanochat.data.fetch.records,
nanochat.data.fetch.verify.
"""

import logging
import os

from nanochat.data.base.files import fsync_dir, remove_if_exists
from nanochat.data.fetch.errors import BadFileError
from nanochat.data.fetch.records import (discard, open_nofollow, read_json, record_path,
                                         source_of, write_json)
from nanochat.data.fetch.verify import MAGIC, check_pages, check_parquet, check_stated, digests_of

logger = logging.getLogger(__name__)


# -----------------------------------------------------------------------------
# An attempt's start: how much of the temp file to keep


def resume_point(tmp: str) -> tuple[int, dict | None]:
    """(bytes of tmp to keep, its record). A tmp that cannot be trusted is discarded: one without a
    record naming a validator (nothing could tell whether its bytes belong to the file the server
    has now, and splicing two versions is the one failure we must never risk), one that does not
    start with PAR1, or one longer than the file."""
    try:
        f = open_nofollow(tmp, os.O_RDONLY, "rb")
    except FileNotFoundError:
        remove_if_exists(record_path(tmp))
        return 0, None
    with f:
        have = os.fstat(f.fileno()).st_size
        head = f.read(4)
    try:
        record = read_json(record_path(tmp))
    except BadFileError:
        record = None
    why = None
    if not record or not record.get("validator"):
        why = "no record of which version of the file it holds"
    elif not MAGIC.startswith(head):  # startswith: a tmp of 1-3 bytes holds part of the magic
        why = f"it does not start with PAR1 (starts with {head!r})"
    elif record.get("size") is not None and have > record["size"]:
        why = f"it is longer than the file ({record['size']} bytes)"
    if why:
        if have:
            logger.warning("discarding %d bytes of %s: %s", have, tmp, why)
        discard(tmp)
        return 0, None
    return have, record


# -----------------------------------------------------------------------------
# Its end: checked against what the source stated, then renamed to the final name


def install(tmp: str, path: str, record: dict) -> None:
    """Check tmp against what the server (or store) stated and as parquet, then rename it to path;
    its record first. A bad file that was at path stays there until this moment, so the name is
    never empty."""
    size = os.path.getsize(tmp)
    who = "the store" if "hashes" in record else "the server"
    if record["size"] is not None and size != record["size"]:
        raise BadFileError("wrong size", f"{tmp} has {size} bytes, {who} stated {record['size']}")
    check_parquet(tmp)
    digests = digests_of(tmp, record.get("hashes") or {})  # one read for every hash
    digest = digests["sha256"]
    if record.get("sha256") is not None and digest != record["sha256"]:
        raise BadFileError("sha256 mismatch",
                           f"{tmp} hashes to {digest}, the server stated {record['sha256']}")
    matched = check_stated(tmp, record, digests) if "hashes" in record else []
    stated = record.get("sha256") is not None or "sha256" in matched
    vouched = stated or bool(matched)  # the bytes are the publisher's: their pages read
    if not vouched:  # only the bytes vouch for themselves: read every page, as a reader will
        check_pages(tmp)
    # the sha256 is recorded either way: from then on a local change to the file is caught, and
    # check_file need not read the pages again
    installed = {"size": size, "sha256": digest, "sha256_stated_by_server": stated,
                 "pages_checked": not vouched, "source": source_of(record["url"]),
                 # the version the source stated: an ETag (or Last-Modified), a store's version
                 "source_version": record.get("validator")}
    if "hashes" in record:  # which of the store's hashes matched (none: size and structure only)
        installed["stated_hashes"] = matched
    if record.get("streamed"):  # a streaming cache's: it may evict it (ledger.py rebuilds by it)
        installed["streamed"] = True
    write_json(record_path(path), installed)
    with open_nofollow(tmp, os.O_RDONLY, "rb") as f:
        # its bytes are on disk before its name is (a 416 finish skipped the write's fsync)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    remove_if_exists(record_path(tmp))
