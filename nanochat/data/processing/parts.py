"""
The texts of one unit of work: a whole input, or one part of it.
Read the texts of one unit of work, in batches: a whole input, or part k of n of it. Part k of a
parquet file of R row groups is its row groups k*R//n up to (k+1)*R//n; part k of a plain jsonl
file of S bytes is the lines that start in its bytes k*S//n up to (k+1)*S//n. A .jsonl.gz is read
from its start, so its parts read a plain copy that the first of them writes (plain_copy). The
bounds follow from n alone, so an input's parts, read in order, hold its documents in order, and
two runs that split it into as many parts write the same pairs. Cost: a part's rows; finding a
jsonl part's bounds reads up to two lines; a split .jsonl.gz is decompressed once, to disk.

May import: filelock, nanochat.data.base, nanochat.data.fetch.records,
nanochat.data.fetch.repackage.
"""

import gzip
import io
import os
import shutil

from filelock import FileLock

from nanochat.data.base.datasets import open_parquet, read_row_group_texts
from nanochat.data.base.files import fsync_dir, remove_if_exists
from nanochat.data.fetch.records import lock_path
from nanochat.data.fetch.repackage import jsonl_texts, read_jsonl_texts

TEXTS_PER_BATCH = 1024  # texts per encode call: a parquet row group, and as many jsonl lines


def text_batches(path: str, text_field: str, part: int = 0, parts: int = 1):
    """Lists of up to TEXTS_PER_BATCH texts of part `part` of `parts` of a parquet shard (one row
    group each) or a jsonl file (a part of a .jsonl.gz: of its plain_copy)."""
    if path.endswith(".parquet"):
        pf = open_parquet(path)
        groups = pf.num_row_groups
        for rg_idx in range(part * groups // parts, (part + 1) * groups // parts):
            yield read_row_group_texts(pf, rg_idx, path)
        return
    batch = []
    texts = (read_jsonl_texts(path, text_field) if parts == 1
             else _part_texts(path, text_field, part, parts))
    for text in texts:
        batch.append(text)
        if len(batch) == TEXTS_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _part_texts(path: str, text_field: str, part: int, parts: int):
    """The texts of the lines that start in bytes part*S//parts up to (part+1)*S//parts of a plain
    jsonl file of S bytes."""
    if path.endswith(".gz"):
        raise ValueError(f"{path}: a part of a .jsonl.gz is read from its plain copy (plain_copy)")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = _line_start(f, part * size // parts, size)
        stop = _line_start(f, (part + 1) * size // parts, size)
        # the whole file's reader in text mode sees the same lines: both bounds follow a "\n"
        lines = io.TextIOWrapper(io.BufferedReader(_Span(f, start, stop)), encoding="utf-8")
        yield from jsonl_texts(lines, text_field,
                               lambda n: f"{path} line {_lines_before(path, start) + n}")


def plain_copy(source: str, copy: str) -> None:
    """Make copy the decompressed bytes of the .jsonl.gz at source, unless it is there: the first
    of the input's parts writes it, the others wait for it. Written under a temporary name and
    renamed, so a copy there is whole."""
    os.makedirs(os.path.dirname(copy), exist_ok=True)
    with FileLock(lock_path(copy)):
        if os.path.exists(copy):
            return
        tmp = copy + ".tmp"
        try:
            with gzip.open(source, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, copy)
        finally:
            remove_if_exists(tmp)
        fsync_dir(os.path.dirname(copy))


def _line_start(f, at: int, size: int) -> int:
    """The first line start at or after byte `at`: 0, or the byte after a "\\n", or size."""
    if at <= 0 or at >= size:
        return max(0, min(at, size))
    f.seek(at - 1)
    f.readline()  # to the end of the line that byte at-1 is in (at once, if it is the "\n")
    return f.tell()


def _lines_before(path: str, offset: int) -> int:
    """The lines in a file's first `offset` bytes: only for an error's line number."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


class _Span(io.RawIOBase):
    """Bytes start up to stop of an open binary file, read as a file of their own."""

    def __init__(self, f, start: int, stop: int):
        super().__init__()
        f.seek(start)
        self._f, self._left = f, stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._left <= 0:
            return 0
        n = self._f.readinto(memoryview(buffer)[:self._left])
        self._left -= n
        return n
