"""
Small shared helpers: where data lives, and who we are in a torchrun job.
Nothing here touches the disk or the network at import time.

May import: the standard library only (nanochat's own common.py takes its place in a nanochat
checkout).
"""

import os
import logging

logger = logging.getLogger(__name__)


def get_base_dir() -> str:
    """The root of everything nanochat stores: $NANOCHAT_BASE_DIR, else ~/.cache/nanochat.
    Resolved at call time and not created here (the caller that writes creates it)."""
    base_dir = os.environ.get("NANOCHAT_BASE_DIR")
    if base_dir:
        return base_dir
    return os.path.join(os.path.expanduser("~"), ".cache", "nanochat")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def get_dist_info() -> tuple[bool, int, int, int]:
    """(ddp, rank, local_rank, world_size) from torchrun's RANK / LOCAL_RANK / WORLD_SIZE.
    Outside torchrun: (False, 0, 0, 1)."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):  # torchrun sets all 3
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"inconsistent torchrun variables: RANK={rank}, "
                             f"WORLD_SIZE={world_size}")
        return True, rank, local_rank, world_size
    return False, 0, 0, 1


def print0(*args, **kwargs) -> None:
    """print only on rank 0."""
    if _env_int("RANK", 0) == 0:
        print(*args, **kwargs)
