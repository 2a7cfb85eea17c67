"""
Tests for running a stage ahead on a thread (nanochat/data/loader/prefetch.py): a Prefetcher yields
its source's items in order, hands a failure in the source to the consumer as the same exception
(and again on every later next()), and close() ends its thread and closes the source. Run:
    python -m pytest tests/data/loader/test_prefetch.py -q
"""

import threading
import time

import pytest

from conftest import outcome
from nanochat.data.loader.prefetch import Prefetcher


def running(name: str) -> bool:
    return any(thread.name == name for thread in threading.enumerate())


def until_ended(name: str) -> bool:
    """Wait for the thread called name to end (outcome bounds the wait: a hang fails)."""
    while running(name):
        time.sleep(0.01)
    return True


def test_a_prefetcher_yields_the_sources_items_in_order():
    prefetcher = Prefetcher(iter(range(10)), 2, "test-prefetch-order")
    assert list(prefetcher) == list(range(10))
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_a_failure_in_the_source_reaches_the_consumer_as_the_same_exception():
    error = ValueError("row group 3 is unreadable")

    def source():
        yield 1
        yield 2
        raise error

    prefetcher = Prefetcher(source(), 4, "test-prefetch-failure")
    assert [next(prefetcher), next(prefetcher)] == [1, 2]
    with pytest.raises(ValueError, match="row group 3 is unreadable") as raised:
        next(prefetcher)
    assert raised.value is error
    with pytest.raises(ValueError) as again:  # a failed stage stays failed
        next(prefetcher)
    assert again.value is error


def test_close_ends_the_thread_and_closes_the_source():
    closed = []

    def endless():
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.append(True)

    name = "test-prefetch-close"
    prefetcher = Prefetcher(endless(), 3, name)
    assert [next(prefetcher) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert running(name)
    prefetcher.close()
    assert outcome(lambda: until_ended(name)) is True
    assert closed == [True]
    with pytest.raises(StopIteration):  # items made ahead are dropped
        next(prefetcher)
