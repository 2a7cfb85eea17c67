"""
Small file-system steps that make writes durable and clean-ups quiet.
The downloader (nanochat/data/fetch/), the token-shard writer
(nanochat/data/pretokenized/token_shards.py) and the streaming cache's small files (the ledger, the
catalog, the kept copies) share them: a whole-file write that leaves no temporary file behind and
says what a full disk needs, and a warning given once per version of a bad file. Also the one
progress bar every long step uses: frames on a terminal, plain lines in a log file.

May import: the standard library, tqdm.
"""

import errno
import os
import shutil
import sys

from tqdm import tqdm

# what a full disk under a streaming cache asks of its user
DISK_FULL_FIX = "free some space, pass a smaller cache_limit, or use a data_dir on a bigger disk"

_warned: dict[str, tuple] = {}  # path -> the version of it (file_stamp) last warned about


def remove_if_exists(path: str) -> None:
    """Remove a file; one that is already gone is not an error."""
    try:  # not exists() then remove(): another process may remove it in between
        os.remove(path)
    except FileNotFoundError:
        pass


def fsync_dir(path: str) -> None:
    """Make the renames in a directory durable (some platforms cannot open a directory: then
    nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)  # a rename is an entry in the directory: durable once the directory is
    finally:
        os.close(fd)


def disk_full(directory: str, needed: int, what: str, fix: str = DISK_FULL_FIX) -> OSError:
    """The error for a disk too full to take `needed` more bytes in `directory`: where, how much
    it needs and has, and the fix."""
    existing = directory
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # (a directory the full disk could not create)
    free = shutil.disk_usage(existing).free
    return OSError(errno.ENOSPC, f"{directory}: {what} needs {needed} bytes but {free} are free "
                                 f"(the disk is full); {fix}")


def write_atomic(path: str, data: bytes) -> None:
    """Write a small file whole, then rename it into place: a reader, who takes no lock, never sees
    half of it. One writer at a time (the caller's lock): the temporary file is path + ".tmp". On
    any OSError the temporary file goes; a full disk (or quota) is an OSError(ENOSPC) naming the
    directory, the bytes needed and free, and the fix."""
    tmp = path + ".tmp"
    # os.open and os.write, not open(): a loader closed by its __del__ at interpreter exit writes
    # here when the builtins may be gone already
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        remove_if_exists(tmp)  # (an empty or partial temporary file would stay for good)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(os.path.dirname(path) or ".", len(data),
                            f"writing {os.path.basename(path)}") from None
        raise


def file_stamp(fd: int) -> tuple[int, int, int]:
    """Which version of an open file this is: a whole-file write (write_atomic) makes a new inode,
    an edit in place a new mtime."""
    stat = os.fstat(fd)
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def warn_once(logger, path: str, stamp: tuple, message: str, *args) -> None:
    """logger.warning(message, *args), once per version of the bad file at `path`: a file read at
    every step stays bad until someone writes it again, and one warning says all there is."""
    if _warned.get(path) != stamp:
        _warned[path] = stamp
        logger.warning(message, *args)


# -----------------------------------------------------------------------------
# Progress: a bar on a terminal, plain lines in a log


class _QuarterLines(tqdm):
    """A bar for a log file or a pipe: one plain line at the start, at each quarter done and at the
    end, never a '\\r' frame (each frame of a drawn bar would pile up on one long line)."""

    def __init__(self, *args, **kwargs):
        self._quarter, self._shown = -1, None  # the last quarter and count written
        kwargs["leave"] = False  # close() writes the last line itself, then tqdm clears nothing
        self._format = kwargs.pop("bar_format", "{desc}: {percentage:3.0f}%{r_bar}")
        super().__init__(*args, **kwargs)

    def _line(self) -> None:
        self._shown = self.n
        self.bar_format = self._format if self.total else None  # no total: tqdm's count and rate
        self.fp.write(str(self) + "\n")
        self.fp.flush()

    def display(self, msg=None, pos=None):
        if msg is not None:  # (tqdm clearing the bar: there is none to clear)
            return False
        quarter = 4 * self.n // self.total if self.total else 0  # no total: start and end only
        if quarter > self._quarter:
            self._quarter = quarter
            self._line()
        return True

    def clear(self, nolock=False):  # tqdm.write and log lines clear a bar with '\\r': none here
        pass

    def moveto(self, n):  # nested bars move the cursor: a log has one line after another
        pass

    def close(self):
        if not self.disable and self._shown != self.n:  # the last line says where it ended
            self._line()
        super().close()


def progress_bar(iterable=None, *, progress: bool | None = None, lines: bool = True,
                 **kwargs) -> tqdm:
    """A tqdm bar (kwargs are tqdm's). progress=True: a bar; False: nothing. None: a bar on a
    terminal; elsewhere (a log file, a pipe) a plain line at the start, at each quarter done and
    at the end, or nothing when lines=False (a bar per file, under a bar that counts the files)."""
    if progress is None:
        stream = kwargs.get("file") or sys.stderr
        if not (hasattr(stream, "isatty") and stream.isatty()):
            return _QuarterLines(iterable, **kwargs) if lines else tqdm(iterable, disable=True,
                                                                          **kwargs)
        progress = True
    return tqdm(iterable, disable=not progress, **kwargs)
