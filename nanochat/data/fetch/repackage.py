"""
Your own text written as shards (`python -m nanochat.dataset repackage`).
Your own text as shards: read .txt, .jsonl(.gz) or .parquet files, shuffle the documents, and
write them as shard_00000.parquet, ... (one `text` column, zstd, row groups of ~1024 documents),
the last shard val. `python -m nanochat.dataset repackage INPUTS --out DIR` runs it (main below).

Cost: holds every document in memory; writing is pyarrow's zstd, ~100MB shards by default.

May import: nanochat.data.base.
"""

import argparse
import gzip
import json
import logging
import math
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.data.base.layout import INPUT_SUFFIXES
from nanochat.data.base.checks import check_int
from nanochat.data.base.datasets import index_to_filename
from nanochat.data.base.files import progress_bar, remove_if_exists

logger = logging.getLogger(__name__)

ROW_GROUP_SIZE = 1024  # documents per row group, like the hosted shards
SHARD_SIZE_MB = 100.0  # the hosted shards are ~100MB after zstd
RATIO_SAMPLE_DOCS = 2048  # documents compressed up front to estimate the zstd ratio of this data


def repackage(inputs: list[str], out_dir: str, *, shard_size_mb: float | None = None,
              docs_per_shard: int | None = None, text_field: str = "text", seed: int = 42,
              row_group_size: int = ROW_GROUP_SIZE, progress: bool | None = None) -> list[str]:
    """Shuffle the documents of the input files and write them to out_dir as shard_00000.parquet,
    ... (one `text` column, zstd, row groups of row_group_size). The last shard is the validation
    split. Holds every document in memory. Returns the shard paths."""
    check_int("row_group_size", row_group_size, 1)
    if os.path.isdir(out_dir) and any(f.endswith(".parquet") for f in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds parquet files; mixing them with new shards "
                              "would change the train/val split, so pick an empty --out directory")
    docs = read_documents(list(inputs), text_field, progress=progress)
    sizes = plan_shard_sizes(docs, shard_size_mb=shard_size_mb, docs_per_shard=docs_per_shard)
    random.Random(seed).shuffle(docs)  # neighbours in a file are often related: mix them
    os.makedirs(out_dir, exist_ok=True)
    paths, start = [], 0
    try:
        for index, size in enumerate(progress_bar(sizes, progress=progress, unit="shard",
                                                  desc="writing")):
            path = os.path.join(out_dir, index_to_filename(index))
            _write_shard(path, docs[start:start + size], row_group_size)
            paths.append(path)
            start += size
    except BaseException:  # Ctrl-C too: out_dir held no parquet file, and a part of the shards
        for path in paths:  # would be read with the wrong val, its last: none is left
            remove_if_exists(path)
        raise
    assert start == len(docs)
    logger.info("wrote %d shards (%d documents) to %s", len(paths), len(docs), out_dir)
    return paths


def read_documents(paths: list[str], text_field: str = "text", *,
                   progress: bool | None = None) -> list[str]:
    """All non-empty documents of the input files, in order. Empty ones are dropped: they would
    train nothing but a BOS. Every path is checked before any is read."""
    if not paths:
        raise ValueError("no input files given; pass .txt, .jsonl, .jsonl.gz or .parquet files")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"input file {path} does not exist")
        if not os.path.isfile(path):
            raise ValueError(f"input {path} is not a file; pass the files inside it")
        _reader_for(path)  # an unsupported suffix fails now, not after an hour of reading
    docs = []
    for path in progress_bar(paths, progress=progress, unit="file", desc="reading"):
        before = len(docs)
        try:
            docs.extend(t for t in _reader_for(path)(path, text_field) if t)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 ({e})") from None
        except (pa.ArrowException, gzip.BadGzipFile, EOFError) as e:
            raise ValueError(f"{path} could not be read ({e})") from None
        logger.info("%s: %d documents", path, len(docs) - before)
    return docs


def _reader_for(path: str):
    for suffix, reader in ((".jsonl.gz", read_jsonl_texts), (".jsonl", read_jsonl_texts),
                           (".txt", _read_txt), (".parquet", _read_parquet)):
        if path.endswith(suffix):
            return reader
    raise ValueError(f"{path}: unsupported input type; use one of {', '.join(INPUT_SUFFIXES)}")


def _read_txt(path: str, text_field: str):
    """One document per non-empty line (the usual layout of scraped text dumps). text_field is
    unused: every reader takes the same arguments."""
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
        yield from jsonl_texts(f, text_field, lambda lineno: f"{path} line {lineno}")


def jsonl_texts(lines, text_field: str, where):
    """read_jsonl_texts over lines already open (where(lineno) names the line in an error, lineno
    counted from 1 here)."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where(lineno)}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where(lineno)}: no {text_field!r} field (found {keys}); "
                             "pass the right one with --text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where(lineno)}: field {text_field!r} is "
                             f"{type(text).__name__}, expected a string")
        yield text


def _read_parquet(path: str, text_field: str):
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names  # from the footer: a missing column fails before any read
    if text_field not in names:
        raise ValueError(f"{path} has no {text_field!r} column (columns: {names}); "
                         "pass the right one with --text-field")
    for rg_idx in range(pf.num_row_groups):
        column = pf.read_row_group(rg_idx, columns=[text_field]).column(text_field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ValueError(f"{path}: column {text_field!r} has type {column.type}, "
                             "expected string")
        if column.null_count:
            raise ValueError(f"{path} row group {rg_idx}: column {text_field!r} has "
                             f"{column.null_count} nulls")
        yield from column.to_pylist()


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
        check_int("docs_per_shard", docs_per_shard, 1)
        num_shards = math.ceil(len(docs) / docs_per_shard)
    else:
        shard_size_mb = SHARD_SIZE_MB if shard_size_mb is None else shard_size_mb
        if shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be > 0, got {shard_size_mb}")
        raw_bytes = sum(len(t.encode("utf-8")) for t in docs)
        compressed = raw_bytes / _zstd_ratio(docs[:RATIO_SAMPLE_DOCS])
        num_shards = math.ceil(compressed / (shard_size_mb * 1e6))
    if num_shards < 2:  # one shard would leave train or val empty
        num_val = max(1, len(docs) // 10)
        return [len(docs) - num_val, num_val]
    base, extra = divmod(len(docs), num_shards)  # the first `extra` shards get one more
    return [base + (i < extra) for i in range(num_shards)]


def _zstd_ratio(sample: list[str]) -> float:
    """UTF-8 bytes per byte of zstd parquet for a sample of this data (~3 for English prose)."""
    raw = sum(len(t.encode("utf-8")) for t in sample)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": pa.array(sample, type=pa.string())}), sink,
                   compression="zstd")
    return max(raw / sink.getvalue().size, 1e-3)  # 1e-3: never a division by 0 below


def _write_shard(path: str, texts: list[str], row_group_size: int) -> None:
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    tmp = path + ".tmp"  # never a *.parquet name, so a crash leaves nothing the loaders would read
    try:
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        remove_if_exists(tmp)
        raise


# -----------------------------------------------------------------------------
# Command line: python -m nanochat.dataset repackage INPUTS --out DIR

REPACKAGE_HELP = ("Shuffle your own documents into nanochat shards (the last shard is val). .txt: "
                  "one document per non-empty line; .jsonl/.jsonl.gz: one JSON object per line; "
                  ".parquet: one row per document.")


def main(argv: list[str]) -> int:
    """`python -m nanochat.dataset repackage INPUTS --out DIR [...]`: write the shards and say
    where; bad input raises ValueError/FileNotFoundError/FileExistsError."""
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset repackage",
                                     description=REPACKAGE_HELP)
    parser.add_argument("inputs", nargs="+", help=f"input files ({', '.join(INPUT_SUFFIXES)})")
    parser.add_argument("--out", required=True,
                        help="output directory (must hold no parquet files)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--shard-size-mb", type=float, default=None,
                      help=f"target shard size after zstd (default {SHARD_SIZE_MB:g})")
    size.add_argument("--docs-per-shard", type=int, default=None,
                      help="at most this many documents per shard")
    parser.add_argument("--text-field", default="text",
                        help="JSON field or parquet column holding the text")
    parser.add_argument("--seed", type=int, default=42, help="shuffle seed")
    args = parser.parse_args(argv)
    # the size rule this run uses: one of the two, the default size when neither is given
    size = (f"docs_per_shard={args.docs_per_shard}" if args.docs_per_shard is not None
            else f"shard_size_mb={args.shard_size_mb:g}" if args.shard_size_mb is not None
            else f"shard_size_mb={SHARD_SIZE_MB:g}")
    print(f"inputs={len(args.inputs)} out={args.out} {size} text_field={args.text_field} "
          f"seed={args.seed}")
    paths = repackage(args.inputs, args.out, shard_size_mb=args.shard_size_mb,
                      docs_per_shard=args.docs_per_shard, text_field=args.text_field,
                      seed=args.seed)
    print(f"wrote {len(paths)} shards to {args.out}; the last, {os.path.basename(paths[-1])}, "
          "is val")
    return 0
