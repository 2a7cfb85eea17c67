"""
Reading a parquet shard's text, with errors that name the file and the fix.
Reading parquet shards: open one (its footer) and read the `text` column of a row group, checked,
with errors that name the file, the row group and the fix instead of pyarrow's bare message.

Cost: opening reads the footer; a row group is one pyarrow call, a few ms for ~1024 documents.

May import: pyarrow; nothing of ours.
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq


def open_parquet(path: str) -> pq.ParquetFile:
    """Open a shard, reading its footer; a 0-byte, truncated or non-parquet file is a ValueError
    that names it and the fix, not pyarrow's message without the file name."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):  # removed since it was listed: say so, not "corrupt"
            raise FileNotFoundError(f"shard {path} does not exist (it was there when the shards "
                                    "were listed)") from None
        raise ValueError(f"{path} is not a readable parquet file ({e}); "
                         f"{verify_hint(path)}") from None


def read_row_group_texts(pf: pq.ParquetFile, rg_idx: int, path: str) -> list[str]:
    """The `text` column of one row group as a list of str, or a clear error naming file and row
    group."""
    return read_row_group_column(pf, rg_idx, path).to_pylist()


def read_row_group_column(pf: pq.ParquetFile, rg_idx: int, path: str) -> pa.ChunkedArray:
    """The checked `text` column of one row group, still in Arrow memory. Turning it into Python
    strings holds the GIL throughout (~5 ms for 1024 FineWeb documents), so a loader converts it a
    slice at a time and lets its tokenizer threads in between."""
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {pf.schema_arrow.names}); "
                         "shards need one string column named 'text'")
    try:
        column = pf.read_row_group(rg_idx, columns=["text"]).column("text")
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} row group {rg_idx} could not be read ({e}); "
                         f"{verify_hint(path)}") from None
    # large_string: what pyarrow writes for columns over 2 GB, the same text to us
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has type {column.type}, "
                         "expected string")
    if column.null_count:  # a None would reach the tokenizer and fail there, far from the file
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has {column.null_count} null "
                         "values")
    return column


def verify_hint(path: str) -> str:
    """The fix for a shard that cannot be read: find every bad one, then fetch them again (the
    downloader reads every page of a shard that no sha256 from the server vouches for)."""
    return (f"python -m nanochat.dataset --verify --data-dir {os.path.dirname(path) or '.'} lists "
            "every bad shard and the command that fetches them again (a streaming loader fetches "
            "its bad shards again when it restarts)")
