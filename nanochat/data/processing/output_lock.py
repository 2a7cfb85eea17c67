"""
The lock a pretokenize run holds on its share of an output.
The lock a pretokenize run holds on its share of an output (one per rank), so that a second run of
the same rank waits, then stops with a message naming the run that holds it. The kernel's lock
(flock): it ends with its process, so a rerun right after a kill -9 gets it at once.

May import: nothing of ours.
"""

import contextlib
import os
import socket
import time

from filelock import FileLock, Timeout


@contextlib.contextmanager
def output_lock(output: str, rank: int, world_size: int, timeout: float):
    """Hold the lock of this rank's share of output, waiting up to timeout seconds; TimeoutError,
    naming the run that holds it, if it stays held. The lock is the kernel's (flock): it ends with
    its process, so a rerun right after a kill -9 gets it at once (the workers, which do not hold
    it, die then too)."""
    # one lock per rank: the ranks of one job write disjoint inputs and may run at once
    name = (".pretokenize.lock" if world_size == 1
            else f".pretokenize.rank{rank}-of-{world_size}.lock")
    path = os.path.join(output, name)
    os.makedirs(output, exist_ok=True)
    holder = "pid unknown"
    if os.path.exists(path):  # read before FileLock opens it: some filelock versions truncate it
        with open(path, encoding="utf-8", errors="replace") as f:
            holder = f.read().strip() or holder
    lock = FileLock(path, timeout=timeout)
    try:
        lock.acquire(timeout=0)  # free, as it most often is: nothing to say
    except Timeout:
        if timeout > 0:  # a wait of up to 10 s by default: say so when it starts
            print(f"waiting up to {timeout:g}s (--lock-timeout) for another pretokenize run "
                  f"({holder}) that is writing to {output}", flush=True)
        try:
            lock.acquire()
        except Timeout:
            error = TimeoutError(
                f"another pretokenize run ({holder}) is writing to {output}: {path} stayed locked "
                f"for {timeout:g}s; let that run finish (or stop it), then run again: the rerun "
                "skips the pairs it wrote. To run several at once, give each its own share of the "
                "inputs: --rank R --world-size N, with R from 0 to N-1, on one machine or several"
                + (f" (that run is rank {rank} of {world_size} too)" if world_size > 1 else ""))
            raise error from None
    try:
        since = time.strftime('%Y-%m-%d %H:%M:%S')
        _note_holder(path, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
        yield
    finally:
        _note_holder(path, "")  # nobody holds it now: a finished run leaves the file empty
        lock.release()


def _note_holder(path: str, text: str) -> None:
    # who holds the lock, for the message a second run gives; only a note: failing to write it
    # changes nothing
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass
