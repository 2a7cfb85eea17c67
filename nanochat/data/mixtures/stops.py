"""
How a mixture loader stops, every rank at the same step.
How a mixture loader stops: its exceptions (each with the last good state), the codes of a step's
stop, and every rank agreeing on them. The flag travels on a CPU (gloo) group, one 4-byte
all_reduce a step, so that reading it never waits for the GPU.

May import: torch, nothing of ours.
"""

import torch
import torch.distributed as dist

STOP_CODES = {None: 0, "budget": 1, "bucket": 2}  # a batch's Stop kind -> its code
FAILED = 3  # this rank's loader failed (a bad shard, ...): the others stop too, not wait


class MixtureStop(RuntimeError):
    """The mixture loader stopped on purpose; `state` is the last good state (resume from it)."""

    def __init__(self, message: str, state: dict | None):
        super().__init__(message)
        self.state = state


class BucketExhausted(MixtureStop):
    """A bucket ran dry on some rank (allow_bucket_exhaustion=False). Save a checkpoint with
    `.state` and stop; resume with allow_bucket_exhaustion=True to go on without the bucket. The
    message gives the bucket's crop share so far and the fixes for a next run."""

    def __init__(self, message: str, state: dict | None, bucket: str | None):
        super().__init__(message, state)
        self.bucket = bucket


class CurriculumComplete(MixtureStop):
    """Every phase's token budget has been trained (allow_budget_mismatch=False)."""


def agree(code: int, world_size: int) -> int:
    """The largest stop code over all ranks (code: this rank's): one 4-byte all_reduce on the CPU
    group, or code itself when the loader is not one of a job's ranks."""
    group = flag_group(world_size)
    if group is None:
        return code
    flag = torch.tensor([code], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


_FLAG_GROUP: list = []  # the CPU (gloo) process group the stop flags travel on, made once


def flag_group(world_size: int):
    """A gloo group for the per-batch stop flag, or None when the loader is not one of a job's ranks
    (no torch.distributed, or a loader made for world_size=1, e.g. an evaluation on rank 0 only). On
    CPU, so that reading the flag never waits for the GPU (an NCCL all_reduce + .item() would sync
    every step). Made at the first mixture loader's construction, which every rank reaches in the
    same order."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size:  # a loader for a subset of the job (rank 0's eval)
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if not _FLAG_GROUP:
        _FLAG_GROUP.append(dist.new_group(backend="gloo"))
    return _FLAG_GROUP[0]


def dry_message(stop, bucket_stats: dict, fixes: str) -> str:
    """BucketExhausted's message: which bucket (stop: this rank's Stop, or None when another rank's
    bucket ran dry), its crop share so far (bucket_stats: the batch's per-bucket stats), what to
    do (fixes: curriculum.dry_fixes)."""
    crops = {name: s["crop_share"] for name, s in bucket_stats.items()}
    if stop and stop.bucket:
        dry = (f"bucket {stop.bucket!r} ran dry on this rank (its crop share so far: "
                 f"{crops[stop.bucket]:.2f})")
    elif stop:
        shares = ", ".join(f"{name} {crop:.2f}" for name, crop in sorted(crops.items()))
        dry = ("every bucket of the current phase ran dry on this rank (crop shares so "
                 f"far: {shares})")
    else:
        dry = "a bucket ran dry on another rank (its message says which)"
    return (f"{dry}; its `state` is the last good state: save a checkpoint with it and stop, "
            "or resume with allow_bucket_exhaustion=True to drop the bucket. For a run that "
            f"does not run dry, the fixes: {fixes}")
