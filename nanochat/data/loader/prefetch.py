"""
Running a stage ahead on a daemon thread.
Prefetcher runs an iterator a few items ahead of its consumer, hands every failure to it, and stops
within a bounded time when closed (a whole pipeline of them at once); at the interpreter's exit
every thread still running is stopped. The loader's worker process is worker.py. Page:
docs/loaders.md.

Cost: one thread per stage, and at most `depth` items made ahead of the consumer.

May import: the standard library.
"""

import atexit
import logging
import threading
import time
import weakref
from collections import deque

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

