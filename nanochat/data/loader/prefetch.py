"""
Running a stage ahead: on a daemon thread (Prefetcher), or in a worker process (WorkerBatches).
Prefetcher runs an iterator a few items ahead, hands every failure to its consumer, and stops within
a bounded time when closed (a whole pipeline of them at once). WorkerBatches runs a whole loader in
a worker process (`python -m nanochat.data.loader.prefetch`), so that none of its Python takes the
trainer's GIL: each batch's rows come back through shared memory, the rest of the batch through a
pipe. Page: docs/loaders.md.

Cost: one thread per stage, and at most `depth` items made ahead of the consumer. A worker: one
process per loader (its start: ~2 s and ~350 MB, it imports torch), (depth + 1) slots of shared
memory of 2 * B * T * 8 bytes, and ~0.5 ms of the trainer's time per batch.

May import: the standard library, numpy.
"""

import atexit
import contextlib
import importlib
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
from typing import NamedTuple

import numpy as np

logger = logging.getLogger(__name__)


class Prefetcher:
    """Runs an iterator on a daemon thread, up to `depth` items ahead.
    An exception in the thread is raised by the consumer's next `next()` (and every one after).

    `close()` stops it: the thread asks its source for nothing more and ends, closing the source
    from inside; a call already running there (one tokenizer call, one row group read) is not
    interrupted, and the thread ends when it returns. From then on `next()` raises StopIteration,
    even for items already made. A prefetcher started on another's thread (the packing stage
    starts the reading and tokenizing stages) stops with it, so a whole pipeline stops at once;
    its waits are woken at once."""

    def __init__(self, source, depth: int, name: str):
        self._source = source
        self._depth = depth
        self._items: deque = deque()  # (ok, item) made ahead: at most depth
        self._changed = threading.Condition()  # notified when an item is put or taken, and on close
        self._stop = threading.Event()
        # the prefetcher whose thread started this one: closing it closes this one too
        self._parent = getattr(_running, "prefetcher", None)
        self._children: list[Prefetcher] = []
        if self._parent is not None:
            self._parent._children.append(self)
        self._error: BaseException | None = None
        self.wait_seconds = 0.0  # time the consumer spent blocked in next(): the stall it felt
        # daemon: a loader never closed must not keep the interpreter from exiting
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _PREFETCHERS.add(self)
        self._thread.start()

    def stopping(self) -> bool:
        return self._stop.is_set() or (self._parent is not None and self._parent.stopping())

    def _put(self, entry) -> bool:
        """Hand (ok, item) to the consumer, waiting while `depth` are waiting; False (dropped)
        once stopping."""
        with self._changed:
            while len(self._items) >= self._depth and not self.stopping():
                # woken when the consumer takes one, or on close; the timeout bounds a missed wake
                self._changed.wait(0.1)
            if self.stopping():
                return False
            self._items.append(entry)
            self._changed.notify_all()
            return True

    def _run(self) -> None:
        _running.prefetcher = self  # a prefetcher made on this thread is this one's child
        try:
            items = iter(self._source)
            while not self.stopping():  # checked before every pull: a pull may start a long call
                try:
                    item = next(items)
                except StopIteration:
                    self._put((False, StopIteration()))
                    return
                self._put((True, item))
        except BaseException as e:  # hand every failure to the consumer, never die silently
            self._put((False, e))
        finally:
            # closed here, on the thread that runs it: a generator cannot be closed from another
            # thread while it is running
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:  # a failed stage stays failed: every later next() raises
            raise self._error
        t0 = time.perf_counter()
        ok, item = self._get()
        self.wait_seconds += time.perf_counter() - t0
        if ok:
            return item
        self._error = item
        raise item

    def _get(self) -> tuple[bool, object]:
        """The thread's next (ok, item), or (False, StopIteration()) once stopping (dropping what
        was made)."""
        with self._changed:
            while not self._items and not self.stopping() and self._thread.is_alive():
                self._changed.wait(0.1)  # woken when the thread puts one, or on close
            if self.stopping():
                return False, StopIteration()
            if not self._items:  # never: the thread ends with a last entry unless stopping
                return False, RuntimeError(f"{self._thread.name} ended without a result")
            entry = self._items.popleft()
            self._changed.notify_all()  # a slot is free: the thread may make the next item
            return entry

    def _wake(self) -> None:
        """Wake whoever waits on this prefetcher or on those it started, so that they see it
        stopping."""
        with self._changed:
            self._changed.notify_all()
        for child in self._children:
            child._wake()

    def close(self, timeout: float = 0.5) -> None:
        """Stop the thread and wait for it at most `timeout` seconds (it ends when its current call
        does)."""
        self._stop.set()
        self._wake()
        if self._thread is not threading.current_thread():  # a thread cannot join itself
            self._thread.join(timeout)


_running = threading.local()  # .prefetcher: the prefetcher whose thread this is
# every prefetcher, weakly: a running thread keeps its own alive, a finished one may go
_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()
EXIT_TIMEOUT = 5.0  # seconds the interpreter's exit waits, in all, for background calls running


@atexit.register
def _stop_threads_at_exit() -> None:
    """Stop every loader's threads when the interpreter exits (a script that never closes its
    loader, or ends right after closing it), and wait for the calls they are in to return, at most
    EXIT_TIMEOUT seconds in all: a daemon thread still inside a C++ call (pyarrow, torch, the
    tokenizer) when the interpreter finalizes aborts the process with 'terminate called without an
    active exception'."""
    prefetchers = list(_PREFETCHERS)
    for prefetcher in prefetchers:
        prefetcher.close(timeout=0)  # all stop at once; the waits below share one deadline
    deadline = time.monotonic() + EXIT_TIMEOUT
    for prefetcher in prefetchers:
        prefetcher._thread.join(max(0.0, deadline - time.monotonic()))
    running = [p._thread.name for p in prefetchers if p._thread.is_alive()]
    if running:
        logger.warning("exiting with loader threads still inside a call after %ss: %s",
                       EXIT_TIMEOUT, running)


def maybe_prefetch(source, depth: int, name: str):
    return Prefetcher(source, depth, name) if depth > 0 else source  # depth 0: no thread at all


@contextlib.contextmanager
def noting_logs(package: str):
    """Yields a list of the messages this thread logs through `package`'s loggers while the block
    runs (they are handled as usual): what the checks at a loader's call said, which its worker,
    running them again, does not say twice (Job.said)."""
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


# -----------------------------------------------------------------------------
# A whole loader in a worker process

NICENESS = 19  # the worker's: where it shares a core with the trainer, the trainer goes first
CLOSE_TIMEOUT = 3.0  # seconds close() waits for a worker to end before killing it
HEADER = 64  # bytes before the slots in the shared file: the batches the trainer is done with
# seconds between a worker's looks for a free slot when all are full: the first wait, then twice
# as long each time, up to the last (a worker far ahead of its trainer wakes ~60 times a second)
SLOT_POLL = (0.001, 0.016)
_WORKERS: weakref.WeakSet = weakref.WeakSet()  # every worker started, closed at the exit


class Job(NamedTuple):
    """What a worker runs: `function(**kwargs)` makes a loader (a nanochat.dataloader.DataLoader);
    each of its batches goes through one of `slots` slots of `slot_bytes` bytes, written by its
    `write_batch`."""
    function: str  # "module:name" of a public loader function
    kwargs: dict
    slots: int
    slot_bytes: int
    log_level: int  # the trainer's for nanochat's loggers: the worker logs to stderr at it
    # what the trainer's checks at the call logged (noting_logs): the worker, building the same
    # loader, does not say it again
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
        env = os.environ | {"PYTHONPATH": os.pathsep.join(_import_path())}
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


def _import_path() -> list[str]:
    """The trainer's sys.path, so that the worker imports the same modules (the tokenizer's own
    among them), this package's directory first."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [package_parent] + [os.path.abspath(p or os.curdir) for p in sys.path]


@atexit.register
def _close_workers_at_exit() -> None:
    for worker in list(_WORKERS):
        worker.close()


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
    trainer = os.getppid()
    jobs = Connection(job_fd, writable=False)
    out = Connection(out_fd, readable=False)
    sending = threading.Lock()  # the three threads all send

    def send(message) -> None:
        with sending:
            out.send(message)

    try:
        job = pickle.loads(jobs.recv_bytes())  # imports the tokenizer's module, among others
        module, name = job.function.split(":")
        function = getattr(importlib.import_module(module), name)
    except Exception as e:
        send(("unavailable", f"{type(e).__name__}: {e}"))
        return
    logging.basicConfig(format="%(message)s")  # (stderr, as the trainer's warnings by default)
    logging.getLogger(__package__).setLevel(job.log_level)
    said = _Said(job.said)
    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(said)
    try:
        loader = function(**job.kwargs)
    except BaseException as e:  # the trainer raises it at its call
        send(_failure(e))
        return
    finally:
        for handler in handlers:
            handler.removeFilter(said)
    slots = mmap.mmap(slots_fd, HEADER + job.slots * job.slot_bytes)
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

    # batches go out from a thread of their own: a message larger than the pipe holds (a batch's
    # attention_info) must not hold up the next batch; at most `slots` wait in the outbox
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def post() -> None:
        try:
            while (message := outbox.get()) is not None:
                send(message)
        except OSError:  # the trainer has gone
            stop.set()

    try:
        send(("ready", loader.worker_info()))
        threading.Thread(target=_serve_trainer, args=(jobs, stop, answer), daemon=True,
                         name="nanochat-worker-control").start()
        threading.Thread(target=post, daemon=True, name="nanochat-worker-post").start()
        for made, batch in enumerate(loader.row_batches()):
            wait = SLOT_POLL[0]
            while made - done[0] >= job.slots and not stop.is_set():
                # every slot holds a batch the trainer has not finished; (a trainer gone leaves
                # this process to init: the end of its pipe says so too, this is a second way)
                if stop.wait(wait) or os.getppid() != trainer:
                    stop.set()
                wait = min(2 * wait, SLOT_POLL[1])
            if stop.is_set():
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


if __name__ == "__main__":
    worker_main(sys.argv[1:])
