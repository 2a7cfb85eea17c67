"""
Small file-system steps that make writes durable and clean-ups quiet, shared by the downloader
(nanochat/download.py) and the token-shard writer (nanochat/token_shards.py).

May import: the standard library only.
"""

import os


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
