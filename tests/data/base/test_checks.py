"""
nanochat/data/base/checks.py, the argument checks every loader makes: check_int's messages and
ranges, is_int on bools and numpy integers, check_options, resolve_rank and resolve_workers (from
the arguments or torchrun's and NANOCHAT_LOADER_WORKERS's variables), check_shuffle, parse_bytes's
units and refusals, and check_stream's settings from NANOCHAT_STREAM, NANOCHAT_CACHE_LIMIT and
NANOCHAT_STREAM_SHARDS.
Run: python -m pytest tests/data/base/test_checks.py -q
"""

import re

import numpy as np
import pytest

from nanochat.data.base.checks import (check_int, check_options, check_shuffle, check_stream,
                                       is_int, parse_bytes, resolve_rank, resolve_workers,
                                       Streaming)

STREAM_VARIABLES = ("NANOCHAT_STREAM", "NANOCHAT_CACHE_LIMIT", "NANOCHAT_STREAM_SHARDS",
                    "NANOCHAT_LOADER_WORKERS")


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    """The user's own settings never reach these tests."""
    for name in STREAM_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


@pytest.mark.parametrize("args, kwargs, message", [
    (("B", 0, 1), {}, "B must be an integer >= 1, got 0"),
    (("rank", 5, 0, 3), {}, "rank must be an integer in [0, 3], got 5"),
    (("x", 5, None, 3), {}, "x must be an integer <= 3, got 5"),
    (("seed", "5"), {}, "seed must be an integer, got '5'"),
    (("T", True, 1), {}, "T must be an integer >= 1, got True"),
    (("T", 2.0, 1), {}, "T must be an integer >= 1, got 2.0"),
    (("n", -1, 0), {"hint": " (0 = none)"}, "n must be an integer >= 0 (0 = none), got -1"),
    (("pos", list(range(100)), 0), {}, "pos must be an integer >= 0, got [0, 1, 2, 3, 4, 5, ...]"),
])
def test_check_int_names_the_argument_the_range_and_the_value(args, kwargs, message):
    with pytest.raises(ValueError, match=exactly(message)):
        check_int(*args, **kwargs)


def test_check_int_returns_a_plain_int_and_raises_the_error_asked_for():
    assert check_int("B", 7, 1, 7) == 7 and type(check_int("B", 7, 1, 7)) is int
    assert check_int("seed", -3) == -3  # no bound: any int
    with pytest.raises(TypeError, match=exactly("B must be an integer >= 1, got 0")):
        check_int("B", 0, 1, error=TypeError)
    with pytest.raises(ValueError, match=r"^B must be an integer >= 1, got "):
        check_int("B", np.int64(4), 1)  # a numpy integer is refused at the call
    assert [is_int(v) for v in (3, True, np.int64(3), np.bool_(True), 3.0)] == [
        True, False, False, False, False]
    assert [is_int(v, numpy=True) for v in (3, True, np.int64(3), np.bool_(True), 3.0)] == [
        True, False, True, False, False]


def test_check_options_and_check_shuffle():
    check_options(2, 8, "val", 0, buffer_size=None, tokenizer_batch_size=1)  # all good: nothing
    for args, more, message in [
            ((2, 8, "test", 1), {}, "split must be 'train' or 'val', got 'test'"),
            ((0, 8, "train", 1), {}, "B must be an integer >= 1, got 0"),
            ((2, 8, "train", -1), {}, "prefetch must be an integer >= 0 (0 = no background "
                                      "threads), got -1"),
            ((2, 8, "train", 1), {"buffer_size": 0}, "buffer_size must be an integer >= 1, got 0")]:
        with pytest.raises(ValueError, match=exactly(message)):
            check_options(*args, **more)
    assert check_shuffle(False, 0, 1) is None
    shuffle = check_shuffle(True, 7, 64, "web")
    assert (shuffle.seed, shuffle.window, shuffle.name) == (7, 64, "web")
    for args, message in [(("false", 0, 1), "shuffle must be True or False, got 'false'"),
                          ((True, "7", 1), "seed must be an integer, got '7'"),
                          ((True, 7, 0), "shuffle_window must be an integer >= 1, got 0")]:
        with pytest.raises(ValueError, match=exactly(message)):
            check_shuffle(*args)


def test_rank_and_workers_from_the_arguments_else_the_environment(monkeypatch):
    assert resolve_rank(None, None) == (0, 1)  # outside torchrun
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, None) == (2, 4)
    assert resolve_rank(1, None) == (1, 4) and resolve_rank(None, 3) == (2, 3)
    with pytest.raises(ValueError, match=exactly("rank must be an integer in [0, 3], got 4")):
        resolve_rank(4, 4)
    with pytest.raises(ValueError, match=exactly("world_size must be an integer >= 1, got 0")):
        resolve_rank(0, 0)
    assert (resolve_workers(None, 2), resolve_workers(None, 0), resolve_workers(0, 2)) == (1, 0, 0)
    monkeypatch.setenv("NANOCHAT_LOADER_WORKERS", "0")
    assert (resolve_workers(None, 2), resolve_workers(1, 2)) == (0, 1)  # the argument wins
    monkeypatch.setenv("NANOCHAT_LOADER_WORKERS", "2")
    with pytest.raises(ValueError, match=exactly("NANOCHAT_LOADER_WORKERS must be 0 or 1, "
                                                 "got '2'")):
        resolve_workers(None, 1)
    with pytest.raises(ValueError, match=exactly("workers must be an integer in [0, 1] (0 = the "
                                                 "loader's threads run in this process), got 2")):
        resolve_workers(2, 1)


def test_parse_bytes_reads_decimal_and_binary_units_and_refuses_the_rest():
    assert [parse_bytes(v) for v in (1000, 2.5, " 7 ", "3b", "20GB", "500 MB", "2kib",
                                     "1.5TiB", "1Tb")] == [
        1000, 2, 7, 3, 20 * 10**9, 500 * 10**6, 2048, 3 * 2**39, 10**12]
    size = "expected bytes or a size like '20GB', '500MB', '1.5TiB'"
    for value, message in [
            ("20 GBs", f"cache_limit='20 GBs': {size}"),
            ("-5MB", f"cache_limit='-5MB': {size}"),
            (True, "cache_limit must be a number of bytes or a string like '20GB', got True"),
            (None, "cache_limit must be a number of bytes or a string like '20GB', got None"),
            (0, "cache_limit must be > 0 bytes, got 0"),
            ("0GB", "cache_limit must be > 0 bytes, got 0.0"),
            (float("inf"), "cache_limit must be a finite number of bytes, got inf: pass a size "
                           "like '20GB', or leave it unset for no limit")]:
        with pytest.raises(ValueError, match=exactly(message)):
            parse_bytes(value)
    with pytest.raises(ValueError, match=r"^cache_limit must be a finite number of bytes, got '9"):
        parse_bytes("9" * 309)  # a float's inf
    with pytest.raises(ValueError, match=exactly(f"LIMIT='x': {size}")):
        parse_bytes("x", "LIMIT")


def test_check_stream_takes_the_arguments_else_the_environment(monkeypatch):
    assert check_stream(None, None, 1, None, False) is None  # NANOCHAT_STREAM unset: no streaming
    assert check_stream(False, "1GB", 1, 3, True) is None  # not streaming: the rest is not read
    assert check_stream(True, None, 2, None, False) == Streaming(None, 2, None)
    monkeypatch.setenv("NANOCHAT_STREAM", "1")
    monkeypatch.setenv("NANOCHAT_CACHE_LIMIT", "2GB")
    monkeypatch.setenv("NANOCHAT_STREAM_SHARDS", "12")
    assert check_stream(None, None, 1, None, False) == Streaming(2 * 10**9, 1, 12)
    assert check_stream(None, "1MiB", 0, 3, False) == Streaming(2**20, 0, 3)  # the arguments win
    for variable, value, message in [
            ("NANOCHAT_STREAM_SHARDS", "1.5", "NANOCHAT_STREAM_SHARDS must be a number of train "
                                              "shards, got '1.5'"),
            ("NANOCHAT_CACHE_LIMIT", "lots", "NANOCHAT_CACHE_LIMIT='lots': expected bytes or a "
                                             "size like '20GB', '500MB', '1.5TiB'"),
            ("NANOCHAT_STREAM", "yes", "NANOCHAT_STREAM must be 1 (stream the shards) or 0, "
                                       "got 'yes'")]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=exactly(message)):
            check_stream(None, None, 1, None, False)
    for args, message in [
            (("1", None, 1, None, False), "stream must be True, False or None (NANOCHAT_STREAM), "
                                          "got '1'"),
            ((True, 1000, -1, 5, False), "prefetch_shards must be an integer >= 0 (shards "
                                         "fetched ahead), got -1")]:
        with pytest.raises(ValueError, match=exactly(message)):
            check_stream(*args)
    with pytest.raises(ValueError, match=r"^stream=True reads the shards in file order.*pass "
                                         r"shuffle=False, or fetch the shards first"):
        check_stream(True, None, 1, 5, True)
