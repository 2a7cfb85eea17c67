"""
nanochat/data/base/files.py, the small file-system steps: write_atomic's whole-file write (the
exact bytes, no temporary file left, a full disk's message), disk_full, remove_if_exists and
fsync_dir, warn_once per version of a file (file_stamp), and progress_bar's plain lines in a log.
Run: python -m pytest tests/data/base/test_files.py -q
"""

import errno
import io
import logging
import os
import re
import shutil
from collections import namedtuple

import pytest

from nanochat.data.base.files import (disk_full, DISK_FULL_FIX, file_stamp, fsync_dir,
                                      progress_bar, remove_if_exists, warn_once, write_atomic)


def test_write_atomic_leaves_the_exact_bytes_and_no_temporary_file(tmp_path):
    path = str(tmp_path / "ledger.json")
    write_atomic(path, b"first, and longer")
    write_atomic(path, bytearray(b"\x00second"))  # replaces it whole
    assert (tmp_path / "ledger.json").read_bytes() == b"\x00second"
    assert os.listdir(tmp_path) == ["ledger.json"]
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(IsADirectoryError):  # the rename fails: its temporary file goes too
        write_atomic(str(tmp_path / "a_dir"), b"data")
    with pytest.raises(FileNotFoundError):
        write_atomic(str(tmp_path / "missing" / "x"), b"data")
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "ledger.json"]


def test_a_full_disk_names_the_directory_the_bytes_and_the_fix(tmp_path, monkeypatch):
    asked = []

    def disk_usage(path):
        asked.append(path)
        return namedtuple("usage", "total used free")(1000, 990, 10)

    real_replace = os.replace

    def replace(src, dst):
        if src.startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError) as full:
        write_atomic(str(tmp_path / "catalog.json"), b"x" * 25)
    assert full.value.errno == errno.ENOSPC
    assert full.value.strerror == (f"{tmp_path}: writing catalog.json needs 25 bytes but 10 are "
                                   f"free (the disk is full); {DISK_FULL_FIX}")
    assert os.listdir(tmp_path) == []  # no temporary file
    error = disk_full(str(tmp_path / "not" / "made"), 7, "a shard", fix="free some space")
    assert str(error) == (f"[Errno {errno.ENOSPC}] {tmp_path / 'not' / 'made'}: a shard needs 7 "
                          "bytes but 10 are free (the disk is full); free some space")
    assert asked == [str(tmp_path), str(tmp_path)]  # the nearest directory that exists


def test_remove_if_exists_and_fsync_dir_are_quiet_about_what_is_gone(tmp_path):
    (tmp_path / "shard.tmp").write_bytes(b"x")
    remove_if_exists(str(tmp_path / "shard.tmp"))
    remove_if_exists(str(tmp_path / "shard.tmp"))  # gone already: not an error
    assert os.listdir(tmp_path) == []
    with pytest.raises(IsADirectoryError):  # only a missing file is let go
        remove_if_exists(str(tmp_path))
    assert fsync_dir(str(tmp_path)) is None
    assert fsync_dir(str(tmp_path / "missing")) is None  # cannot open it: nothing


def test_warn_once_per_version_of_a_bad_file(tmp_path, caplog):
    logger = logging.getLogger("nanochat.data.test_files")
    path = str(tmp_path / "kept.json")

    def stamp():
        fd = os.open(path, os.O_RDONLY)
        try:
            return file_stamp(fd)
        finally:
            os.close(fd)

    write_atomic(path, b"{bad")
    first = stamp()
    assert first == (os.stat(path).st_ino, os.stat(path).st_mtime_ns, 4)
    with caplog.at_level("WARNING", logger=logger.name):
        for _ in range(3):
            warn_once(logger, path, stamp(), "%s is not JSON", "kept.json")
        write_atomic(path, b"{still bad")  # a new version: a new inode, a new warning
        assert stamp() != first
        for _ in range(2):
            warn_once(logger, path, stamp(), "%s is not JSON (%d)", "kept.json", 2)
    assert [r.getMessage() for r in caplog.records] == ["kept.json is not JSON",
                                                        "kept.json is not JSON (2)"]


def test_progress_in_a_log_is_a_line_at_the_start_each_quarter_and_the_end():
    log = io.StringIO()  # not a terminal
    bar = progress_bar(range(8), file=log, desc="shards", bar_format="{desc}: {n}/{total}",
                       mininterval=0, miniters=1)
    assert list(bar) == list(range(8))
    assert log.getvalue() == "shards: 0/8\nshards: 2/8\nshards: 4/8\nshards: 6/8\nshards: 8/8\n"
    assert not re.search("\r", log.getvalue())
    quiet = io.StringIO()
    assert list(progress_bar(range(3), file=quiet, lines=False)) == [0, 1, 2]
    assert list(progress_bar(range(3), progress=False, file=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""
