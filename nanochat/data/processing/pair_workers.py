"""
Units of work written on worker processes, or in this one: the command's local executor.
Write units' pairs on worker processes (spawned, one tokenizer each) or in this one, with
units.tokenize_unit, and hand back each unit's PairResult as it completes. Ctrl-C stops a worker's
pair at once, its temporary files removed; a worker ends with the main process, however that ends
(kill -9 included).

May import: nanochat.data.processing.units.
"""

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from nanochat.data.processing.units import PretokenizeJob, job_tokenizer, tokenize_unit

PARENT_POLL_SECONDS = 0.2  # how often a worker checks that the main process is still alive


def pair_results(job: PretokenizeJob, units: list, num_workers: int, num_threads: int):
    """The PairResult of tokenize_unit for each of units, in completion order, from num_workers
    processes (1: this one), each tokenizing on num_threads threads."""
    if num_workers <= 1:
        for unit in units:
            yield tokenize_unit(job, unit, num_threads)
        return
    # spawn: a forked child would inherit the parent's tokenizer thread pools, and maybe a held
    # lock. A worker that dies (killed, out of memory) stops the run with ChildProcessError instead
    # of hanging.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(job, num_threads, os.getpid())) as pool:
        with _sigint_blocked():  # (the workers start at the first submits)
            futures = [pool.submit(write_in_worker, unit) for unit in units]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BrokenProcessPool:  # an OSError: the command says it in one line
            raise ChildProcessError(
                "a pretokenize worker process died (killed, or out of memory?); the pairs written "
                "are complete and no partial one is installed: rerun the same command to write "
                "the rest") from None
        finally:
            for future in futures:  # on an error, do not start the inputs still queued
                future.cancel()


# the job and the tokenizer's threads of this worker process, set by _init_worker
_worker_job: PretokenizeJob | None = None
_worker_threads = 1


def _init_worker(job: PretokenizeJob, num_threads: int, parent_pid: int) -> None:
    global _worker_job, _worker_threads
    # Ctrl-C reaches the whole process group: between pairs the main process alone acts on it (an
    # idle worker would print a traceback); within one, write_in_worker lets it stop the pair. It
    # was blocked since this process started (pair_results): one sent meanwhile is dropped now
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # (POSIX)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _exit_with_parent(parent_pid)
    _worker_job, _worker_threads = job, num_threads
    job_tokenizer(job)  # loaded once, before the first unit


def write_in_worker(unit):
    """tokenize_unit in a worker process, for the job it was started with."""
    # Ctrl-C stops the pair at once, its temporary files removed (write_token_pairs); the main
    # process, stopped too, says so
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return tokenize_unit(_worker_job, unit, _worker_threads)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when the main process ends, however it ends (kill -9 included). Left alive, a
    worker would go on writing pairs, under the same temporary names as a rerun's workers."""
    if sys.platform.startswith("linux"):
        # the kernel kills us the moment the process that started us is gone (the pool is made and
        # used on one thread: the signal comes when that thread ends)
        PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch():  # elsewhere, and if the parent was gone before the line above ran
        while os.getppid() == parent_pid:  # an orphan is adopted: its parent id changes
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # at once: no cleanup that could finish a half-written pair

    threading.Thread(target=watch, name="nanochat-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _sigint_blocked():
    """Ctrl-C held back while the block runs, then raised. A process started meanwhile starts
    with it blocked (a signal mask is inherited), so that one still importing prints no traceback:
    the way multiprocessing starts its resource tracker."""
    if not hasattr(signal, "pthread_sigmask"):  # (not POSIX)
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
