"""
Checking a loader's arguments up front, so that bad input fails at the call with a ValueError that
names the argument, not later inside a background thread.

May import: nanochat.common, nanochat.dataset, nanochat.shuffle.
"""

from nanochat.common import get_dist_info
from nanochat.dataset import SPLITS
from nanochat.shuffle import Shuffle


def check_positive(**kwargs) -> None:
    """ValueError unless every value is an int >= 1 (a bool is not)."""
    for name, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_options(B, T, split, prefetch, **more) -> None:
    """The arguments every loader takes; `more`: other counts that must be >= 1 (None: not given)."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    check_positive(B=B, T=T, **{k: v for k, v in more.items() if v is not None})
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0 (0 = no background threads), got {prefetch!r}")


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size), each defaulting to torchrun's RANK / WORLD_SIZE, checked."""
    _, env_rank, _, env_world_size = get_dist_info()
    rank = env_rank if rank is None else rank
    world_size = env_world_size if world_size is None else world_size
    check_positive(world_size=world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return seed


def check_shuffle(shuffle, seed, shuffle_window, bucket: str = "") -> Shuffle | None:
    """The Shuffle of a loader's shuffle=, seed=, shuffle_window= arguments (None: not shuffled)."""
    if not isinstance(shuffle, bool):
        raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
    check_seed(seed)
    check_positive(shuffle_window=shuffle_window)
    return Shuffle(seed, shuffle_window, bucket) if shuffle else None
