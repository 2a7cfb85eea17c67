"""
A whole loader in a worker process, so that none of its Python takes the trainer's GIL.
WorkerBatches (the trainer's end) starts `python -m nanochat.data.loader.worker`, a fresh
interpreter, and hands it a Job: the builder and the pickled spec it builds the loader from. Each
batch's rows come back through shared memory, the rest of the batch through a pipe; a failure there
is raised again in the trainer, once. Page: docs/loaders.md.

Cost: one process per loader (its start: ~0.4 s, without torch; ~2 s where nanochat's common.py
imports it), (depth + 1) slots of shared memory of 2 * B * T * 8 bytes, and ~0.5 ms of the
trainer's time per batch.

May import: the standard library, numpy.
"""

import atexit
import contextlib
import logging
import mmap
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple

import numpy as np

NICENESS = 19  # the worker's: where it shares a core with the trainer, the trainer goes first
CLOSE_TIMEOUT = 3.0  # seconds close() waits for a worker to end before killing it
HEADER = 64  # bytes before the slots in the shared file: the batches the trainer is done with
# seconds between a worker's looks for a free slot when all are full: the first wait, then twice
# as long each time, up to the last (a worker far ahead of its trainer wakes ~60 times a second)
SLOT_POLL = (0.001, 0.016)
_WORKERS: weakref.WeakSet = weakref.WeakSet()  # every worker started, closed at the exit


class Job(NamedTuple):
    """What a worker process is handed: `build()` makes the loader there (a
    nanochat.data.loader.build.DataLoader); each of its batches goes through one of `slots` slots
    of `slot_bytes` bytes, written by its `write_batch`."""
    # picklable: a builder of ours with the spec it builds from (functools.partial); unpickling it
    # imports what the spec holds (the tokenizer's module among them)
    build: Callable[[], Any]
    slots: int
    slot_bytes: int
    log_level: int  # the trainer's for nanochat's loggers: the worker logs to stderr at it
    # what the trainer's checks at the call logged (noting_logs): the worker, checking the resume
    # state again as it builds, does not say it again
    said: tuple[str, ...] = ()


class WorkerUnavailable(Exception):
    """The job cannot run in a worker process (its tokenizer cannot be pickled, or imported
    there): the caller runs the loader in this process instead."""


class WorkerTraceback(Exception):
    """Where in the worker process an exception was raised: its traceback there, less its last
    line. The __cause__ of the exception the trainer raises again, whose own traceback ends with
    that line, the exception and its message, once (docs/loaders.md)."""


class WorkerBatches:
    """The trainer's end of a worker: an iterator of the loader's batches (each a NamedTuple whose
    `rows` is what the loader's `write_batch` wrote: int64, `slot_bytes` of them), started at
    once. A batch's `rows` view shared memory, valid until the next `next()`, which hands its
    slot back. Raises WorkerUnavailable when the job cannot run in a worker; a failure while the
    loader is built there is raised here, at once."""

    def __init__(self, job: Job):
        if os.name != "posix":  # (pass_fds, memfd: Linux and macOS)
            raise WorkerUnavailable(f"worker processes need a POSIX system, not {os.name}")
        try:
            payload = pickle.dumps(job)
        except Exception as e:  # (a lambda, a lock, a local class: AttributeError, TypeError...)
            raise WorkerUnavailable(f"its arguments cannot be pickled ({e})") from None
        self._closed = False
        self._lock = threading.Lock()  # sends: close() from another thread while next() sends
        # receives: cache_status() from another thread while next() waits. One thread at a time
        # reads the pipe; every message goes to _pending, and each thread takes its own kind
        self._arrived = threading.Condition()
        self._reading = False
        self._slot_bytes = job.slot_bytes
        self._taken = 0  # batches this end has taken: the worker reuses the slots of all but one
        self._pending: deque = deque()  # messages read and not yet taken
        slots_fd = _shared_file(HEADER + job.slots * job.slot_bytes)
        self._slots = mmap.mmap(slots_fd, HEADER + job.slots * job.slot_bytes)
        self._done = np.ndarray(1, np.int64, buffer=self._slots)  # see worker_main
        to_read, to_worker = os.pipe()  # the trainer's messages: the job, status requests, close
        from_worker, to_write = os.pipe()
        # a fresh interpreter, not a fork: the trainer's threads (CUDA's, the tokenizer's pools)
        # and locks do not survive a fork, and multiprocessing's spawn would run the trainer's
        # script again in it
        env = os.environ | {"PYTHONPATH": os.pathsep.join(import_path())}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __spec__.name, str(to_read), str(to_write), str(slots_fd)],
                pass_fds=(to_read, to_write, slots_fd), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (to_worker, from_worker):
                os.close(fd)
            raise
        finally:
            for fd in (to_read, to_write, slots_fd):
                os.close(fd)  # the worker holds them now: its pipe ends when it does, ours too
        _WORKERS.add(self)
        self._to_worker = Connection(to_worker, readable=False)
        self._from_worker = Connection(from_worker, writable=False)
        try:
            self._to_worker.send_bytes(payload)
            message = self._receive()
        except BaseException:
            self.close()
            raise
        if message[0] == "unavailable":
            self.close()
            raise WorkerUnavailable(message[1])
        if message[0] != "ready":
            self.close()
            self._raise(message)
        self.info: dict = message[1]  # what the loader there says of itself (worker_info)

    @property
    def pid(self) -> int:
        return self.process.pid

    def __iter__(self):
        return self

    def __next__(self):
        if self._taken:  # the last batch is done with: its slot may be written again
            self._done[0] = self._taken
        message = self._take(status=False)
        if message[0] != "batch":
            self._raise(message)
        _, slot, item = message
        self._taken += 1
        if slot is None:  # nothing written (a mixture's end: no rows)
            return item
        rows = np.ndarray(self._slot_bytes // 8, np.int64, buffer=self._slots,
                          offset=HEADER + slot * self._slot_bytes)
        return item._replace(rows=rows)

    def status(self):
        """What the loader there says of its shard cache (DataLoader.cache_status)."""
        if self._closed:
            raise RuntimeError("the loader is closed: its worker process, which held the shard "
                               "cache, has ended")
        self._send(("status",))
        status = self._take(status=True)[1]
        if isinstance(status, tuple) and status[:1] == ("failed",):
            self._raise(status)
        return status

    def _take(self, status: bool):
        """The next status reply (status=True), or else the next batch, end or failure."""
        while True:
            with self._arrived:
                for i, message in enumerate(self._pending):
                    if (message[0] == "status") == status:
                        del self._pending[i]
                        return message
                if self._reading:  # another thread reads: it files what comes, and says so
                    self._arrived.wait(0.1)
                    continue
                self._reading = True
            try:
                message = self._receive()
                with self._arrived:
                    self._pending.append(message)
            finally:
                with self._arrived:
                    self._reading = False
                    self._arrived.notify_all()

    def _send(self, message) -> None:
        with self._lock:
            if self._closed:
                raise StopIteration
            self._to_worker.send(message)

    def _receive(self):
        if self._closed:
            raise StopIteration
        try:
            return self._from_worker.recv()
        except (EOFError, OSError):
            if self._closed:  # close() from another thread ended the worker
                raise StopIteration from None
            code = self.process.wait()  # its pipe has ended: so has the process
            raise RuntimeError(f"the loader's worker process (pid {self.pid}) ended with exit "
                               f"code {code} before its next batch (see its output above; "
                               "a negative code is the signal that killed it)") from None

    def _raise(self, message):
        if message[0] == "end":
            raise StopIteration
        if message[0] == "failed":
            error, frames = message[1], message[2]
            raise error from WorkerTraceback(f"the loader's worker process (pid {self.pid}) "
                                             f"raised the error below:\n{frames.rstrip()}")
        raise RuntimeError(f"unexpected message from the loader's worker: {message[0]!r}")

    def close(self, wait: bool = True) -> None:
        """End the worker: asked to stop, then killed if it has not after CLOSE_TIMEOUT seconds
        (wait=False: asked only; it ends on its own). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._to_worker.send(("close",))
                self._to_worker.close()
            except OSError:  # it has ended already
                pass
        if not wait:  # (subprocess reaps it later)
            return
        try:
            self.process.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __del__(self):
        if hasattr(self, "process"):  # (None: __init__ failed before starting it)
            self.close(wait=False)  # garbage collection never waits for a process



def _shared_file(size: int) -> int:
    """An unnamed file in memory of `size` bytes: nothing is left behind, whoever dies first."""
    if hasattr(os, "memfd_create"):  # Linux
        fd = os.memfd_create("nanochat-batches")
    else:
        with tempfile.TemporaryFile() as f:  # (unlinked at once on POSIX)
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


def import_path() -> list[str]:
    """A child interpreter's sys.path: this process's, the checkout that holds this package first,
    so that it imports the same modules (the tokenizer's own among them)."""
    root = os.path.abspath(__file__)
    for _ in __name__.split("."):  # nanochat/data/loader/worker.py: four levels up
        root = os.path.dirname(root)
    return [root] + [os.path.abspath(p or os.curdir) for p in sys.path]


@atexit.register
def _close_workers_at_exit() -> None:
    for worker in list(_WORKERS):
        worker.close()



@contextlib.contextmanager
def noting_logs(package: str):
    """Yields a list of the messages this thread logs through `package`'s loggers while the block
    runs (they are handled as usual): what the checks at a loader's call said, which its worker,
    checking the resume state again, does not say twice (Job.said)."""
    said: list[str] = []
    thread, noting = threading.get_ident(), [True]
    make = logging.getLogRecordFactory()

    def noted(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if noting and record.thread == thread and (record.name + ".").startswith(package + "."):
            said.append(record.getMessage())
        return record

    logging.setLogRecordFactory(noted)
    try:
        yield said
    finally:
        noting.clear()  # inert from now on, also where another thread's factory wraps this one
        if logging.getLogRecordFactory() is noted:
            logging.setLogRecordFactory(make)


# -- the worker's side ---------------------------------------------------------------


def _failure(error: BaseException) -> tuple:
    """("failed", the exception, its traceback as text less its last line: the exception and its
    message, which end the trainer's traceback), the exception replaced by a RuntimeError that
    says what it was when it cannot be pickled."""
    text = "".join(traceback.format_exception(error))
    text = text.removesuffix("".join(traceback.format_exception_only(error)))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return "failed", error, text


class _Said(logging.Filter):
    """Drops, once each, the messages the trainer logged at the call (Job.said) that this
    process's main thread logs again while it builds the same loader."""

    def __init__(self, said: tuple[str, ...]):
        super().__init__()
        self.said = list(said)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.thread != threading.main_thread().ident or message not in self.said:
            return True
        self.said.remove(message)
        return False


def _serve_trainer(jobs: Connection, stop: threading.Event, answer) -> None:
    """The worker's second thread: status requests, and the end, which is a close or the trainer
    gone (its pipe ends). Then the main thread has a moment to close the loader; the process ends
    in any case, whatever ended this thread."""
    try:
        while True:
            message = jobs.recv()
            if message[0] != "status":  # "close"
                break
            answer()
    except (EOFError, OSError):  # the trainer has ended, killed perhaps
        pass
    finally:
        stop.set()
        time.sleep(CLOSE_TIMEOUT / 2)
        os._exit(0)


def worker_main(argv: list[str]) -> None:
    """A worker process: run the job the trainer sends, and hand it every batch. It ends by
    os._exit on every path: an interpreter's exit would wait for any thread the loader left
    running (a download between retries), and a worker must never outlive its trainer."""
    try:
        _work(*(int(arg) for arg in argv))
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)


def _work(job_fd: int, out_fd: int, slots_fd: int) -> None:
    # Ctrl-C goes to the whole process group: the trainer decides, and closes us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the trainer's thread comes first where they share a core: a loader that falls behind still
    # gets every core the trainer leaves while it waits in next(). (Set before any thread starts:
    # Linux keeps a niceness per thread, and new threads inherit it)
    os.nice(NICENESS)
    jobs = Connection(job_fd, writable=False)
    out = Connection(out_fd, readable=False)
    sending = threading.Lock()  # the three threads all send

    def send(message) -> None:
        with sending:
            out.send(message)

    try:
        job = pickle.loads(jobs.recv_bytes())  # imports the spec's modules, the tokenizer's too
    except Exception as e:
        send(("unavailable", f"{type(e).__name__}: {e}"))
        return
    loader = _build(job, send)
    if loader is not None:
        _serve(loader, job, _Channels(jobs, send, slots_fd))


def _build(job: Job, send):
    """The job's loader, built from its spec, quiet about what the trainer said at the call; None
    (the failure sent) when building fails."""
    logging.basicConfig(format="%(message)s")  # (stderr, as the trainer's warnings by default)
    logging.getLogger(__package__.split(".")[0]).setLevel(job.log_level)
    said = _Said(job.said)
    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(said)
    try:
        return job.build()
    except BaseException as e:  # the trainer raises it at its call
        send(_failure(e))
        return None
    finally:
        for handler in handlers:
            handler.removeFilter(said)


class _Channels(NamedTuple):
    jobs: Connection  # the trainer's messages: status requests, close
    send: Callable[[Any], None]  # to the trainer, one message at a time
    slots_fd: int  # the shared file the batches' rows go to


def _serve(loader, job: Job, channels: _Channels) -> None:
    """Hand the trainer every batch the loader makes, each written into a free slot, until the
    loader ends, fails, or the trainer closes it (or is gone)."""
    trainer = os.getppid()
    send = channels.send
    slots = mmap.mmap(channels.slots_fd, HEADER + job.slots * job.slot_bytes)
    # batches the trainer is done with, which it writes: batch n goes to slot n % slots once the
    # trainer is done with batch n - slots (a write to shared memory costs the trainer no call,
    # where a message would cost it ~0.5 ms of a write that wakes this process)
    done = np.ndarray(1, np.int64, buffer=slots)
    stop = threading.Event()

    def answer() -> None:
        try:
            status = loader.cache_status()
        except Exception as e:  # the trainer's cache_status() raises it
            status = _failure(e)
        send(("status", status))

    outbox = _start_posting(send, stop)
    try:
        send(("ready", loader.worker_info()))
        threading.Thread(target=_serve_trainer, args=(channels.jobs, stop, answer), daemon=True,
                         name="nanochat-worker-control").start()
        for made, batch in enumerate(loader.row_batches()):
            if not _wait_for_slot(made - job.slots, done, stop, trainer):
                break
            slot = made % job.slots
            host = np.ndarray(job.slot_bytes // 8, np.int64, buffer=slots,
                              offset=HEADER + slot * job.slot_bytes)
            item = loader.write_batch(batch, host)
            # (slot None: a mixture's end, no rows)
            outbox.put(("batch", None if batch.rows is None else slot, item))
        else:
            outbox.put(("end",))
    except BaseException as e:
        if not stop.is_set():  # (when stopping, a broken pipe is the trainer gone)
            outbox.put(_failure(e))
    finally:
        loader.close()
        # the trainer reads what was sent, then closes (or is gone): the other thread then ends
        # the process; so does a trainer gone without a word
        while not stop.wait(1.0) and os.getppid() == trainer:
            pass


def _start_posting(send, stop: threading.Event) -> queue.SimpleQueue:
    """An outbox whose messages a thread of their own sends: a message larger than the pipe holds
    (a batch's attention_info) must not hold up the next batch; at most `slots` wait in it."""
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def post() -> None:
        try:
            while (message := outbox.get()) is not None:
                send(message)
        except OSError:  # the trainer has gone
            stop.set()

    threading.Thread(target=post, daemon=True, name="nanochat-worker-post").start()
    return outbox


def _wait_for_slot(reused: int, done, stop: threading.Event, trainer: int) -> bool:
    """Wait until the trainer is done with batch `reused`, whose slot the next batch takes; False
    when stopping instead."""
    wait = SLOT_POLL[0]
    while reused >= done[0] and not stop.is_set():
        # every slot holds a batch the trainer has not finished; (a trainer gone leaves this
        # process to init: the end of its pipe says so too, this is a second way)
        if stop.wait(wait) or os.getppid() != trainer:
            stop.set()
        wait = min(2 * wait, SLOT_POLL[1])
    return not stop.is_set()


if __name__ == "__main__":
    worker_main(sys.argv[1:])
