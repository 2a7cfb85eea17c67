"""
A pretokenize run's units of work, and the pair each one becomes.
List a pretokenize run's units of work and the pair each one becomes. The inputs are a parquet
dataset directory or a store's address (its last shard in sorted order is val), or jsonl files and
directories of them. A unit is a whole input, or one part of a local input larger than unit_bytes:
a range of a parquet file's row groups, or of a jsonl file's lines. Part k of n of NAME is
written to NAME.part-0000k-of-0000n, and the loaders read the parts in order at NAME's place
(base/layout.py). A store's shard is downloaded to a staging path under OUTPUT/.inputs/ before it
is read, and a split .jsonl.gz is decompressed there. Cost: a directory listing, or one listing
request to the store, and the footer of each local parquet file larger than unit_bytes.

May import: nanochat.data.fetch, nanochat.data.base.datasets, nanochat.data.base.layout.
"""

import os
from typing import NamedTuple

from nanochat.data.fetch.address import check_store_address, is_http, join, path_in_store, scheme_of
from nanochat.data.fetch.listing import read_listing
from nanochat.data.base.datasets import open_parquet, split_parquet_files
from nanochat.data.base.layout import PART_SUFFIX, list_token_shards, part_name, whole_name
from nanochat.data.fetch.limits import Limits

JSONL_SUFFIXES = (".jsonl.gz", ".jsonl")
# a store's shards are downloaded (a split .jsonl.gz decompressed) under
# OUTPUT/.inputs/<split>/[<bucket>/]: hidden, so that no listing of pairs or buckets sees it, and
# per split and bucket, so that two buckets' shards of one name never meet
STAGING = ".inputs"


# an input larger than this is split into units of about this size (--unit-mb): a unit is about a
# minute of one core's tokenizing for plain text, a few for compressed parquet
UNIT_MB = 256
MAX_PARTS = 99_999  # the five digits of a part's name


class PairToWrite(NamedTuple):
    """One unit of work: an input, or one part of it, to tokenize into one pair."""
    source: str  # a local file, or a store's address (s3://bucket/prefix/name.parquet, ...)
    prefix: str  # the pair's path without .bin/.idx
    # a store's shard: where it is downloaded to; a split .jsonl.gz: where it is decompressed to
    staged: str | None = None
    part: int = 0  # which part of source this unit is: row groups or lines (tokenize_pair.py)
    parts: int = 1  # how many parts source is split into; 1: the whole input


def unit_name(unit: PairToWrite) -> str:
    """What a message calls a unit: its input, and which part of it ("a.jsonl (part 2 of 4)")."""
    if unit.parts == 1:
        return unit.source
    return f"{unit.source} (part {unit.part + 1} of {unit.parts})"


def plan_pairs(inputs: list[str], output: str, val_inputs: list[str] | None = None,
               bucket: str | None = None, unit_bytes: int | None = None) -> list[PairToWrite]:
    """[PairToWrite(input, output_prefix), ...]: train inputs, then val inputs, to output/<split>/
    (with a bucket: output/<split>/<bucket>/), each input's parts in order. One --input directory
    of parquet shards, or one store address, is split as on disk (its last shard in sorted order is
    val); otherwise the inputs are jsonl files or directories of them, all train, with val_inputs
    going to val. unit_bytes: split local inputs larger than this (None: never)."""
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
        named = [n for n in names if PART_SUFFIX.search(n)]
        if named:
            raise ValueError(f"{split} inputs {named} end like the part of a split input "
                             "(NAME.part-00000-of-00002); rename them")
        within = split if bucket is None else os.path.join(split, bucket)
        directory, staging = os.path.join(output, within), os.path.join(output, STAGING, within)
        for path, name in zip(paths, names):
            n = 1 if address or unit_bytes is None else count_parts(path, unit_bytes)
            # a store's shard is downloaded there; a split .jsonl.gz is decompressed there
            staged = (os.path.join(staging, os.path.basename(path)) if address
                      else os.path.join(staging, f"{name}.jsonl") if n > 1 and path.endswith(".gz")
                      else None)
            pairs += [PairToWrite(path, os.path.join(directory, part_name(name, k, n)), staged, k,
                                  n) for k in range(n)]
    return pairs


def count_parts(path: str, unit_bytes: int) -> int:
    """How many units a local input is split into: one per unit_bytes of the file (compressed, for
    a .jsonl.gz), at most one per row group of a parquet file. The parts' bounds follow from this
    count alone (parts.py), so a count in a pair's name says which rows it holds."""
    wanted = -(-os.path.getsize(path) // unit_bytes)
    if wanted <= 1:
        return 1
    if path.endswith(".parquet"):
        wanted = min(wanted, open_parquet(path).metadata.num_row_groups)
    if wanted > MAX_PARTS:
        raise ValueError(f"{path} would be split into {wanted:,} parts, more than a name's "
                         f"{MAX_PARTS:,}; raise --unit-mb")
    return wanted


def check_parts(pairs: list[PairToWrite]) -> None:
    """Refuse a plan whose split of an input differs from the pairs already written for it (a rerun
    with another --unit-mb): both would be read, and their documents twice."""
    planned: dict[tuple[str, str], int] = {}  # (directory, input name) -> its parts in this plan
    for pair in pairs:
        directory, name = os.path.split(pair.prefix)
        planned[(directory, whole_name(name))] = pair.parts
    for directory in sorted({d for d, _ in planned}):
        for prefix in list_token_shards(directory) if os.path.isdir(directory) else []:
            name = os.path.basename(prefix)
            parts = planned.get((directory, whole_name(name)))
            if parts is not None and _parts_named(name) != parts:
                raise ValueError(
                    f"{prefix}.idx splits its input otherwise than this run "
                    f"({'one pair, unsplit' if parts == 1 else f'{parts} parts'}): rerun with the "
                    "--unit-mb of the run that wrote it, or write to a new --output")


def _parts_named(name: str) -> int:
    """How many parts a pair's name says its input was split into (1: a whole input's pair)."""
    match = PART_SUFFIX.search(name)
    return 1 if match is None else int(match.group(2))


def is_store(path: str) -> bool:
    """Whether an --input is an address (s3://, gs://, az://, hf://; http(s):// is refused), whose
    shards are downloaded to be read; file:// and plain paths are read in place."""
    return scheme_of(path) not in ("", "file")


def local_input(path: str, absolute: bool = False) -> str:
    """A plain path for a local input, output or directory: "~" expanded, file:///x read as /x,
    made absolute if asked (for workers that run in other directories); a store's address as is."""
    if is_store(path):
        return path
    path = path_in_store(path) if scheme_of(path) == "file" else os.path.expanduser(path)
    return os.path.abspath(path) if absolute else path


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
