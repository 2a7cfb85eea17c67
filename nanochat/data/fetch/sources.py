"""
One source per directory: every shard there is the run's source's file as it states it now.
A shard fetched from another source is refused, unless the run's source states the same sha256 for
it (a mirror); a shard that changed at its source is found by one HEAD or stat; a shard whose
record names no source is adopted by the first source that asks.

Imported only when needed: nanochat.data.fetch.stores (a store's stat; fsspec with it).
May import: nanochat.data.fetch.address, nanochat.data.fetch.errors,
nanochat.data.fetch.http_transport, nanochat.data.fetch.limits, nanochat.data.fetch.records,
nanochat.data.fetch.stores, requests, filelock.
"""

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import requests
from filelock import FileLock

from nanochat.data.fetch.address import is_http, join, redact
from nanochat.data.fetch.errors import BadFileError, StoreError
from nanochat.data.fetch.http_transport import head, stated_sha256, validator
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.records import (lock_path, record_or_none, record_path, recorded_source,
                                         source_of, write_json)

logger = logging.getLogger(__name__)

SOURCE_FIX = ("Pass another data directory for this source (--data-dir, data_dir=), or the source "
              "its shards came from (--base-url, base_url=, NANOCHAT_DATA_URL), or remove those "
              "shards and their .json records to fetch this source's in their place")


class OtherSourceError(ValueError):
    """A directory holds shards from another source than the one asked for, or shards whose
    source now states other contents for them: one directory holds one source's shards, so that
    no run reads another dataset's files (or an old version) as the ones it asked for."""


class Stated(NamedTuple):
    """What a source states of one of its files now."""
    sha256: str | None  # the content's sha256, when the source states one (the hub, serve)
    version: str | None  # the validator a download records: ETag or Last-Modified, a store's


# sources that did not answer a question about their files in this process: not asked again
_SILENT: set[str] = set()


# -----------------------------------------------------------------------------
# A directory's shards: all from the run's source, each as the source states it now


def check_sources(files: list[tuple[str, str]], fix: str, limits: Limits | None = None) -> None:
    """One source per directory, at the call: OtherSourceError, in one line naming both sources
    and `fix`, when a directory of files' (address, path) holds a shard whose record names another
    source. Unless the run's source states, for every such shard, the sha256 its record holds (a
    mirror, or the same server on another port): their records then name it, and the run goes on.
    A shard without a recorded source (your own, or fetched before sources were recorded) passes:
    see adopt_source."""
    others = _on_disk_from_elsewhere(files)
    if not others:
        return
    limits = Limits() if limits is None else limits
    with ThreadPoolExecutor(min(16, len(others))) as pool:
        stated = list(pool.map(lambda other: stated_now(other[0], limits), others))
    records = [record_or_none(path) or {} for _, path, _ in others]
    if all(s is not None and s.sha256 is not None and same_file(r, s)
           for s, r in zip(stated, records)):
        for (address, path, source), now in zip(others, stated):
            with FileLock(lock_path(path)):
                record = record_or_none(path)
                if record is not None and record.get("source") == source:
                    write_json(record_path(path), record | {"source": source_of(address),
                                                            "source_version": now.version})
        logger.info("%d shard(s) in %s from %s are the same files at %s (it states their "
                    "sha256): their records name it now", len(others),
                    os.path.dirname(others[0][1]), redact(_parent(others[0][2])),
                    redact(_parent(source_of(others[0][0]))))
        return
    address, path, source = others[0]
    names = ", ".join(os.path.basename(p) for _, p, _ in others[:2])
    raise OtherSourceError(
        f"{os.path.dirname(path)} holds {len(others)} shard(s) fetched from "
        f"{redact(_parent(source))} ({names}{', ...' if len(others) > 2 else ''}), not "
        f"from {redact(_parent(source_of(address)))}, which this run reads from, and that "
        f"does not state the same sha256 for them: one directory holds one source's shards. {fix}")


def check_file_source(address: str, path: str) -> None:
    """check_sources for the one file path, from its record alone (no directory listing, no
    request): OtherSourceError when it names another source than address."""
    source = recorded_source(path)
    if source is not None and source != source_of(address):
        raise OtherSourceError(
            f"{path} was fetched from {redact(source)}, not from "
            f"{redact(source_of(address))}, which this call reads it from: one directory "
            f"holds one source's shards. {SOURCE_FIX}")


def check_versions(files: list[tuple[str, str]], fix: str, limits: Limits) -> None:
    """OtherSourceError, in one line with `fix`, when a file of files' (address, path) on disk
    changed at its source (changed_at_source: one request each, 16 at a time)."""
    there = [(address, path) for address, path in files if os.path.exists(path)]
    if not there:
        return
    with ThreadPoolExecutor(min(16, len(there))) as pool:
        changed = [e for e in pool.map(lambda f: changed_at_source(*f, limits), there) if e]
    if changed:
        more = ", ..." if len(changed) > 1 else ""
        raise OtherSourceError(f"{len(changed)} shard(s) on disk changed at their source "
                               f"({changed[0]}{more}). {fix}")


def changed_at_source(address: str, path: str, limits: Limits) -> BadFileError | None:
    """BadFileError("changed at its source") when path's record names address's source and the
    source states other contents for it now (one request; none when the record names no version
    and no sha256 is stated); None when it is the same file, or that cannot be told."""
    record = record_or_none(path)
    if record is None or record.get("source") != source_of(address):
        return None
    stated = stated_now(address, limits)
    if stated is None or same_file(record, stated) is not False:
        return None
    now = f"sha256 {stated.sha256}" if stated.sha256 is not None else f"version {stated.version}"
    return BadFileError("changed at its source",
                        f"{path}: {redact(source_of(address))} now states {now} for it, "
                        "not the file here: it changed at its source")


def adopt_source(address: str, path: str) -> None:
    """Write address as the source of a shard whose record names none (installed before sources
    were recorded): from then on it counts only for that source. The caller holds path's lock."""
    record = record_or_none(path)
    if record is not None and "source" not in record:
        logger.info("%s records no source: taken as from %s, the source that asks for it first",
                    path, redact(source_of(address)))
        write_json(record_path(path), record | {"source": source_of(address),
                                                "source_version": None})


# -----------------------------------------------------------------------------
# What a source states now, and what is on disk from elsewhere


def stated_now(address: str, limits: Limits) -> Stated | None:
    """What the source states now of the file at address: one HEAD (redirects followed) or a
    store's stat, bounded by limits.timeout. None when it cannot say (no such file, an error, no
    answer: logged once per source, which is then not asked again in this process)."""
    parent = _parent(source_of(address))
    if parent in _SILENT:
        return None
    try:
        if not is_http(address):  # (late: a loader that never reads a store never loads it)
            from nanochat.data.fetch.stores import stat
            info = stat(address, limits.timeout)
            return Stated(info.hashes.get("sha256"), info.version)
        response = head(address, limits.timeout)
        if response is None:
            raise requests.Timeout(f"no whole answer in {limits.timeout:g}s")
    except (requests.RequestException, StoreError, OSError) as e:
        _SILENT.add(parent)
        logger.warning("could not ask %s whether its files changed (%s): the shards on disk from "
                       "it are taken as its files, by their records", redact(parent), e)
        return None
    if response.status_code != 200:  # (gone from the source: the copy here is what it had)
        return None
    return Stated(stated_sha256(response), validator(response))


def same_file(record: dict, stated: Stated) -> bool | None:
    """Whether what a source states now is the file a record describes: by the sha256 when the
    source states one, else by the version it stated at the download; None when neither tells."""
    if stated.sha256 is not None:
        return stated.sha256 == record.get("sha256")
    if stated.version is not None and record.get("source_version") is not None:
        return stated.version == record["source_version"]
    return None


def _on_disk_from_elsewhere(files: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(the address the run asks for at the same name, path, the recorded source) of each shard in
    the directories of files whose record names a source in another directory than the run's."""
    # directory -> the run's address of its shards' directory, and the source that names
    asked = {}
    for address, path in files:
        asked.setdefault(os.path.dirname(os.path.abspath(path)),
                         (_parent(address), _parent(source_of(address))))
    found = []
    for directory, (parent, wanted) in asked.items():
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
            path = os.path.join(directory, name)
            source = recorded_source(path) if name.endswith(".parquet") else None
            if source is not None and _parent(source) != wanted:
                found.append((join(parent, name), path, source))
    return found


def _parent(source: str) -> str:
    """The source of a shard's directory: its address less the file's name."""
    return source.rsplit("/", 1)[0]
