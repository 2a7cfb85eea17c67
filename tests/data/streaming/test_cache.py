"""
The shard cache (stream=True, nanochat/data/streaming/cache.py) in one process: the shards are
served by a real HTTP server on 127.0.0.1 (nanochat/data/fetch/serve.py), and every streamed batch
and state is checked against the same loader over the served files on disk, the oracle here
(tests/test_dataloader.py checks that one against tests/oracle.py). Also: the budget (peak disk use,
the val shard and the shards still read never evicted), resume (exact, and the buffered documents'
shards fetched first), the elastic merge of streamed states, and the argument and environment
checks. The catalog, the ledger, kept copies, eviction and the budget check have files of their own
(test_catalog.py, ...); processes and torchrun: test_streaming_processes.py.

    python -m pytest tests/data/streaming/test_cache.py -q
"""

import json
import os
import shutil
import socket

import pytest

from conftest import (FAST, ByteTokenizer, assert_same_batches as _same, least_accepted, outcome,
                      peak_while, take_batches as _batches, write_hosted)
from nanochat.data.base.state import decode_keys
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.base.checks import parse_bytes
from nanochat.data.streaming.ledger import (FETCHED, Ledger, Loader, ShardEntry, start_time,
                                            STREAM_DIR, Table)
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import index_to_filename
from nanochat.resume import merge_states
from served_shards import disk_loader, stream_loader, streaming, VAL




# -----------------------------------------------------------------------------
# Streamed batches are the on-disk loader's, within the budget


@pytest.mark.slow
@pytest.mark.parametrize("kind, world_size, prefetch, prefetch_shards, limit_shards", [
    ("bestfit", 1, 4, 2, 6.2), ("bestfit", 3, 0, 0, 4.2), ("concat", 2, 4, 1, 6.2),
    ("bestfit", 2, 1, 3, None)])
def test_streamed_batches_equal_on_disk_across_epochs(hosted, tmp_path, kind, world_size, prefetch,
                                                      prefetch_shards, limit_shards):
    hosted_dir, server, sizes = hosted
    # about the least it accepts: (packing_shards + prefetch_shards + 1) x the largest shard
    # (packing_shards: 2, and 3 for concat's 2 ranks of 150 documents a shard), + the val shard,
    # + room for the copies of the buffered documents (copies_estimate: under a shard)
    limit = None if limit_shards is None else int(limit_shards * sizes[-1])
    extra = {"buffer_size": 20} if kind == "bestfit" else {}
    for rank in range(world_size):
        cache = tmp_path / f"cache{rank}"
        n = 500 // world_size  # past the end of the first epoch
        expected = _batches(disk_loader(kind, hosted_dir, rank=rank, world_size=world_size,
                                        prefetch=prefetch, **extra), n)
        streamed, peak = peak_while(cache, lambda: _batches(stream_loader(
            kind, server, cache, rank=rank, world_size=world_size, prefetch=prefetch,
            prefetch_shards=prefetch_shards, cache_limit=limit, **extra), n))
        _same(streamed, expected)
        assert streamed[-1][2]["next"][0] == 2  # the second epoch began
        if limit is not None:
            assert peak <= limit
            assert len([f for f in os.listdir(cache) if f.endswith(".parquet")]) < 7  # it evicted


def test_first_batch_needs_only_the_first_shard(hosted, tmp_path):
    """Training starts once the shard it reads first is there: with prefetch_shards=0 nothing else
    is fetched."""
    hosted_dir, server, _ = hosted
    loader = stream_loader("bestfit", server, tmp_path / "cache", prefetch_shards=0, prefetch=0,
                           buffer_size=4)
    next(loader)
    assert server.fetched() == [index_to_filename(0)]
    assert (sorted(f for f in os.listdir(tmp_path / "cache") if f.endswith(".parquet"))
            == [index_to_filename(0)])
    loader.close()


def test_val_shard_and_files_it_did_not_fetch_are_never_evicted(hosted, tmp_path):
    hosted_dir, server, sizes = hosted
    cache = tmp_path / "cache"
    val = stream_loader("bestfit", server, cache, split="val")
    _batches(val, 2)
    os.makedirs(cache, exist_ok=True)
    mine = os.path.join(hosted_dir, index_to_filename(3))
    # "the user's own copy"
    with open(mine, "rb") as src, open(cache / index_to_filename(3), "wb") as dst:
        dst.write(src.read())
    limit = 2 * sizes[-1] + 6 * sizes[-1]  # val + shard 3 + (prefetch_shards=2) + 3 + the copies
    _batches(stream_loader("bestfit", server, cache, cache_limit=limit, buffer_size=8), 400)
    assert (cache / VAL).exists() and (cache / index_to_filename(3)).exists()
    assert index_to_filename(3) not in server.fetched()
    # the ledger's table of the shards the streaming loaders fetched
    shards = json.loads((cache / STREAM_DIR / "ledger.json").read_text())["shards"]
    assert [name for name, row in shards.items() if row["state"] == "fetched"] != []
    assert index_to_filename(3) not in shards


def test_budget_too_small_is_an_error_at_the_call(hosted, tmp_path):
    _, server, sizes = hosted
    with pytest.raises(ValueError, match=r"(?s)cache_limit=.* is below what this streaming "
                                         r"loader must hold.*prefetch_shards=2"):
        stream_loader("bestfit", server, tmp_path / "cache", cache_limit=3 * sizes[-1])


def test_shuffle_with_stream_is_refused(hosted, tmp_path):
    _, server, _ = hosted
    with pytest.raises(ValueError, match="shuffle=True"):
        stream_loader("bestfit", server, tmp_path / "cache", shuffle=True)


# -----------------------------------------------------------------------------
# Resume and elastic merge


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_resume_exact_into_an_empty_cache_fetches_the_buffer_first(hosted, tmp_path, kind):
    hosted_dir, server, sizes = hosted
    extra = {"buffer_size": 40} if kind == "bestfit" else {}
    expected = _batches(disk_loader(kind, hosted_dir, **extra), 260)
    first = _batches(stream_loader(kind, server, tmp_path / "a", cache_limit=7 * sizes[-1],
                                   **extra), 200)
    _same(first, expected[:200])
    state = first[-1][2]
    buffered = list(dict.fromkeys(index_to_filename(key[1])
                                  for key in decode_keys(state["buffer"])))
    assert buffered  # the test is about them
    before = len(server.fetched())
    resumed = _batches(stream_loader(kind, server, tmp_path / "b", resume_state_dict=state,
                                     prefetch_shards=0, **extra), 60)
    _same(resumed, expected[200:])
    assert server.fetched()[before:before + len(buffered)] == buffered


@pytest.mark.slow
def test_elastic_merge_of_streamed_states(hosted, tmp_path, monkeypatch):
    """2 streaming ranks -> merge_states(stream=True) on a cache without the shards -> 3 streaming
    ranks: the same batches as the merge of the on-disk loaders' states resumed on disk."""
    hosted_dir, server, _ = hosted
    states = [_batches(stream_loader("bestfit", server, tmp_path / f"old{r}", rank=r, world_size=2,
                                     buffer_size=10), 70)[-1][2] for r in range(2)]
    disk_states = [_batches(disk_loader("bestfit", hosted_dir, rank=r, world_size=2,
                                        buffer_size=10), 70)[-1][2]
                   for r in range(2)]
    assert states == disk_states
    merged = merge_states(states, 3, data_dir=str(tmp_path / "new"), stream=True,
                          base_url=server.url, download_limits=FAST)
    assert merged == merge_states(disk_states, 3, data_dir=hosted_dir)
    assert not [f for f in os.listdir(tmp_path / "new") if f.endswith(".parquet")]  # footers only
    for r in range(3):
        expected = _batches(disk_loader("bestfit", hosted_dir, rank=r, world_size=3, buffer_size=10,
                                        resume_state_dict=merged), 80)
        _same(_batches(stream_loader("bestfit", server, tmp_path / "new", rank=r, world_size=3,
                                     buffer_size=10, resume_state_dict=merged), 80), expected)
    monkeypatch.setenv("NANOCHAT_STREAM", "1")  # merge_states reads it as the loaders do
    monkeypatch.setenv("NANOCHAT_DATA_URL", server.url)
    assert merge_states(states, 3, data_dir=str(tmp_path / "new")) == merged


@pytest.mark.slow
def test_a_merged_state_resumes_into_an_empty_cache_at_the_least_limit_without_a_stall(tmp_path):
    """merge_states of 2 ranks for 1: its plan deals the old buffers' documents, from 8 shards,
    all read before the first state. The budget check counts them: at the least limit it accepts,
    the resume is exact and does not wait for room."""
    hosted_dir = str(tmp_path / "hosted")
    write_hosted(hosted_dir, 12)
    server = ShardServer(hosted_dir)
    limits = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=5)
    kwargs = dict(num_shards=12, buffer_size=40, download_limits=limits)
    try:
        states = [_batches(stream_loader("bestfit", server, tmp_path / f"old{r}", rank=r,
                                         world_size=2, **kwargs), 150)[-1][2] for r in range(2)]
        merged = merge_states(states, 1, data_dir=hosted_dir)
        first = merged["states"][0]["plan"]
        assert len({unit.get("pq_idx") for unit in first}) >= 6  # the test is about them
        expected = _batches(disk_loader("bestfit", hosted_dir, buffer_size=40,
                                        resume_state_dict=merged), 20)
        least = least_accepted(lambda limit: stream_loader(
            "bestfit", server, tmp_path / "probe", cache_limit=limit, resume_state_dict=merged,
            **kwargs))
        resumed = outcome(lambda: _batches(stream_loader(
            "bestfit", server, tmp_path / "new", cache_limit=least, resume_state_dict=merged,
            **kwargs), 20))
    finally:
        server.close()
    _same(resumed, expected)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start times come from /proc")
def test_a_reader_short_of_room_fails_within_the_deadline_naming_who_holds_it(hosted, tmp_path):
    """Another live loader of the machine needs every shard in the cache, and the budget has no
    room for one more: the reader fails within the download deadline (not after 600 s), and the
    error lists that loader's shards and why."""
    hosted_dir, server, sizes = hosted
    cache = tmp_path / "cache"
    cache.mkdir()
    held = [index_to_filename(i) for i in range(2, 7)]
    for name in held:
        shutil.copy(os.path.join(hosted_dir, name), cache / name)
    (cache / STREAM_DIR).mkdir()
    ledger = Ledger(str(cache))
    with ledger.lock:
        # (its start time: a live loader's row, not one of unknown liveness, dropped as stale)
        another = Loader(socket.gethostname(), os.getpid(), None, dict.fromkeys(held, "reading"),
                         started=start_time(os.getpid()))
        ledger.write(Table(loaders={"another": another},
                           shards={name: ShardEntry(FETCHED) for name in held}))
    limits = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=3)
    # room for 5 shards and a half: the 5 held and not one more
    loader = stream_loader("bestfit", server, cache, cache_limit=int(5.5 * sizes[-1]),
                           prefetch_shards=0, buffer_size=20, download_limits=limits)
    error = outcome(lambda: next(iter(loader)), 20)  # (the deadline, 3 s, not 600 s)
    loader.close()
    assert isinstance(error, ValueError), error
    assert "has had no room for shard_00000.parquet for 3s" in str(error)
    assert f"another: {held[0]} (reading), {held[1]} (reading)" in str(error)
    assert f"(the ledger {ledger.path};" in str(error)


# -----------------------------------------------------------------------------
# The environment: what nanochat's scripts, which pass none of the arguments, get


@pytest.mark.slow
def test_environment_turns_streaming_on(hosted, tmp_path, monkeypatch):
    hosted_dir, server, sizes = hosted
    expected = _batches(disk_loader("bestfit", hosted_dir), 100)
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_STREAM", "1")
    monkeypatch.setenv("NANOCHAT_DATA_URL", server.url)
    monkeypatch.setenv("NANOCHAT_STREAM_SHARDS", "7")
    monkeypatch.setenv("NANOCHAT_CACHE_LIMIT", f"{16 * sizes[-1] / 1e3:.3f}KB")
    # (the defaults on these small shards: all 7 (their read-ahead spans them), val, and a buffer
    # of 1,000's copies)
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), 4, 64, "train", device="cpu", tokenizer_batch_size=8)
    _same(_batches(loader, 100), expected)
    assert server.fetched()[0] == index_to_filename(0)  # into the dataset's directory, the cache
    assert (base / "base_data_climbmix" / STREAM_DIR / "catalog.json").exists()
    monkeypatch.setenv("NANOCHAT_CACHE_LIMIT", "lots")
    with pytest.raises(ValueError, match="NANOCHAT_CACHE_LIMIT='lots'"):
        tokenizing_distributed_data_loader_with_state_bos_bestfit(ByteTokenizer(), 2, 32, "train",
                                                                  device="cpu")
    monkeypatch.setenv("NANOCHAT_STREAM", "yes")
    with pytest.raises(ValueError, match="NANOCHAT_STREAM must be 1"):
        tokenizing_distributed_data_loader_with_state_bos_bestfit(ByteTokenizer(), 2, 32, "train",
                                                                  device="cpu")


def test_arguments_are_checked(hosted, tmp_path):
    _, server, _ = hosted
    for kwargs, message in [({"num_shards": 0}, "num_shards"),
                            ({"num_shards": 6543}, "num_shards"),
                            ({"prefetch_shards": -1}, "prefetch_shards"),
                            ({"cache_limit": "20 parsecs"}, "cache_limit"),
                            ({"cache_limit": 0}, "cache_limit"),
                            ({"stream": "yes"}, "stream must be"),
                            ({"base_url": "ftp://x"}, "must start with http")]:
        with pytest.raises(ValueError, match=message):
            stream_loader("bestfit", server, tmp_path / "cache", **kwargs)


def test_parse_bytes():
    assert parse_bytes("20GB") == 20 * 10**9
    assert parse_bytes("1.5 TiB") == int(1.5 * 2**40)
    assert parse_bytes("500mb") == 500 * 10**6
    assert parse_bytes(12345) == 12345
    for bad in ("", "GB", "-1GB", "1 GBs", True, None, [1]):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# -----------------------------------------------------------------------------
# The catalog and the footer request


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "9" * 400 + "GB"])
def test_cache_limit_nan_or_inf_is_a_clear_error(hosted, tmp_path, monkeypatch, value):
    _, server, _ = hosted
    with pytest.raises(ValueError, match=r"cache_limit must be a finite number of bytes, got "
                                         r".*: pass a size like '20GB', or leave it unset"):
        streaming(tmp_path / "cache", server, cache_limit=value)
    if isinstance(value, str):
        monkeypatch.setenv("NANOCHAT_CACHE_LIMIT", value)
        with pytest.raises(ValueError, match="NANOCHAT_CACHE_LIMIT must be a finite number"):
            streaming(tmp_path / "cache", server, cache_limit=None)
    with pytest.raises(ValueError, match="cache_limit must be a finite number"):
        parse_bytes(value)
