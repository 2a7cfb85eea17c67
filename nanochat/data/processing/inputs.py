"""
A pretokenize run's inputs, and the pair each one becomes.
List a pretokenize run's inputs and the pair each one becomes: a parquet dataset directory or a
store's address (its last shard in sorted order is val), or jsonl files and directories of them.
A store's shard is downloaded to a staging path under OUTPUT/.inputs/ before it is read. Cost: a
directory listing, or one listing request to the store.

May import: nanochat.data.fetch, nanochat.data.base.datasets.
"""

import os
from typing import NamedTuple

from nanochat.data.fetch.address import check_store_address, is_http, join, path_in_store, scheme_of
from nanochat.data.fetch.listing import read_listing
from nanochat.data.base.datasets import split_parquet_files
from nanochat.data.fetch.limits import Limits

JSONL_SUFFIXES = (".jsonl.gz", ".jsonl")
# a store's shards are downloaded under OUTPUT/.inputs/<split>/[<bucket>/]: hidden, so that no
# listing of pairs or buckets sees it, and per split and bucket, so that two buckets' shards of one
# name never meet
STAGING = ".inputs"


class PairToWrite(NamedTuple):
    """One input to tokenize into one pair."""
    source: str  # a local file, or a store's address (s3://bucket/prefix/name.parquet, ...)
    prefix: str  # the pair's path without .bin/.idx
    staged: str | None = None  # a store's shard: where it is downloaded to before tokenizing


def plan_pairs(inputs: list[str], output: str, val_inputs: list[str] | None = None,
               bucket: str | None = None) -> list[PairToWrite]:
    """[PairToWrite(input, output_prefix), ...]: train inputs, then val inputs, to output/<split>/
    (with a bucket: output/<split>/<bucket>/). One --input directory of parquet shards, or one
    store address, is split as on disk (its last shard in sorted order is val); otherwise the inputs
    are jsonl files or directories of them, all train, with val_inputs going to val."""
    address = next((p for p in inputs if is_store(p)), None)
    if address is not None:
        splits = _store_splits(address, inputs, val_inputs)
    elif len(inputs) == 1 and os.path.isdir(inputs[0]) and any(
            f.endswith(".parquet") for f in os.listdir(inputs[0])):
        if val_inputs:
            raise ValueError(f"{inputs[0]} is a parquet dataset, whose last shard is val already; "
                             "drop --val-input")
        splits = {s: split_parquet_files(s, inputs[0]) for s in ("train", "val")}
    else:
        splits = {"train": _expand_jsonl(inputs, "--input"),
                  "val": _expand_jsonl(val_inputs, "--val-input") if val_inputs else []}
    pairs = []
    for split, paths in splits.items():
        names = [_strip_suffix(os.path.basename(p)) for p in paths]
        # a.jsonl and a.jsonl.gz, or one name in two directories, would overwrite each other's pair
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"{split} inputs {dupes} would write the same output pair; rename or "
                             "drop one")
        within = split if bucket is None else os.path.join(split, bucket)
        directory, staging = os.path.join(output, within), os.path.join(output, STAGING, within)
        pairs += [PairToWrite(p, os.path.join(directory, n),
                              os.path.join(staging, os.path.basename(p)) if address else None)
                  for p, n in zip(paths, names)]
    return pairs


def is_store(path: str) -> bool:
    """Whether an --input is an address (s3://, gs://, az://, hf://; http(s):// is refused), whose
    shards are downloaded to be read; file:// and plain paths are read in place."""
    return scheme_of(path) not in ("", "file")


def local_input(path: str) -> str:
    """A plain path for a local --input: "~" expanded, file:///x read as /x; a store's address
    unchanged."""
    return path_in_store(path) if scheme_of(path) == "file" else \
        os.path.expanduser(path)


def _store_splits(address: str, inputs: list[str], val_inputs: list[str] | None) -> dict:
    """{"train": [address, ...], "val": [address]}: the parquet shards the store lists under
    address, split by the on-disk rule (the last name in sorted order is val)."""
    if is_http(address):
        raise ValueError(f"--input {address}: pretokenize reads a local directory or a store "
                         "(s3://, gs://, az://, hf://); download over HTTP first (python -m "
                         "nanochat.dataset --base-url URL --data-dir DIR) and pass --input DIR")
    if len(inputs) > 1 or val_inputs:
        raise ValueError(f"--input {address} is a store's dataset, whose last shard is val "
                         "already: pass it alone, without other --input paths or --val-input")
    check_store_address(address)
    names = read_listing(address, Limits())  # retried while the store asks to slow down
    paths = [join(address, name) for name in names]
    return {"train": paths[:-1], "val": paths[-1:]}


def _expand_jsonl(paths: list[str], flag: str) -> list[str]:
    """The .jsonl/.jsonl.gz files named by paths: files as given, directories' files sorted."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path)
                           if f.endswith(JSONL_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"{flag} directory {path} holds no .parquet, .jsonl or "
                                        ".jsonl.gz files")
            files.extend(found)
        elif os.path.isfile(path):
            if not path.endswith(JSONL_SUFFIXES):
                raise ValueError(f"{flag} file {path} is not .jsonl or .jsonl.gz; for parquet "
                                 "shards pass their directory (one --input DIR), which also picks "
                                 "the val shard")
            files.append(path)
        else:
            raise FileNotFoundError(f"{flag} path {path} does not exist")
    return files


def _strip_suffix(name: str) -> str:
    for suffix in (".parquet",) + JSONL_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name
