"""
Streaming (stream=True, nanochat/data/streaming/cache.py) in one process: the shards are served by a
real HTTP server on 127.0.0.1 (nanochat/data/fetch/serve.py), and every streamed batch and state is
checked against the same loader over the served files on disk, the oracle here
(tests/test_dataloader.py checks that one against tests/oracle.py). Also: the budget (peak disk use,
the val shard and the shards still read never evicted), resume (exact, and the buffered documents'
shards fetched first), the elastic merge of streamed states, the catalog, the footer request, and
the argument and environment checks. Processes, faults and torchrun:
tests/data/streaming/test_streaming_processes.py.
"""

import gzip
import json
import logging
import os
import random
import shutil
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from functools import partial

import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from conftest import (FAST, ByteTokenizer, least_accepted, outcome, peak_while, write_hosted,
                      write_shard)
from conftest import assert_same_batches as _same
from conftest import take_batches as _batches
from nanochat.data.fetch import download
from nanochat.data.streaming import cache as shard_cache
from nanochat.dataloader import (tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.dataset import index_to_filename
from nanochat.data.fetch.download import DownloadError, Limits
from nanochat.data.loader.options import parse_bytes
from nanochat.resume import merge_states
from nanochat.data.streaming.catalog import footer_rows
from nanochat.data.streaming.ledger import FETCHED, Ledger, Loader, ShardRow, Table, start_time
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.data.streaming.cache import ShardCache
from nanochat.data.base.state import decode_keys
from nanochat.data.fetch.serve import ShardServer

VAL = index_to_filename(6542)  # the default dataset's (ClimbMix's) val shard
LOADERS = {"bestfit": tokenizing_distributed_data_loader_with_state_bos_bestfit,
           "concat": tokenizing_distributed_data_loader_with_state}


# tokenizer batches of 8: what a loader reads ahead stays within a shard of these small ones (300
# documents), so the least cache_limit is a few shards (catalog.packing_shards)
def _streaming(kind, server, cache, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, num_shards=7,
                  base_url=server.url, download_limits=FAST, tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=str(cache), **kwargs)


def _on_disk(kind, hosted_dir, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=hosted_dir, **kwargs)


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
        expected = _batches(_on_disk(kind, hosted_dir, rank=rank, world_size=world_size,
                                     prefetch=prefetch, **extra), n)
        streamed, peak = peak_while(cache, lambda: _batches(_streaming(
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
    loader = _streaming("bestfit", server, tmp_path / "cache", prefetch_shards=0, prefetch=0,
                        buffer_size=4)
    next(loader)
    assert server.fetched() == [index_to_filename(0)]
    assert (sorted(f for f in os.listdir(tmp_path / "cache") if f.endswith(".parquet"))
            == [index_to_filename(0)])
    loader.close()


def test_val_shard_and_files_it_did_not_fetch_are_never_evicted(hosted, tmp_path):
    hosted_dir, server, sizes = hosted
    cache = tmp_path / "cache"
    val = _streaming("bestfit", server, cache, split="val")
    _batches(val, 2)
    os.makedirs(cache, exist_ok=True)
    mine = os.path.join(hosted_dir, index_to_filename(3))
    # "the user's own copy"
    with open(mine, "rb") as src, open(cache / index_to_filename(3), "wb") as dst:
        dst.write(src.read())
    limit = 2 * sizes[-1] + 6 * sizes[-1]  # val + shard 3 + (prefetch_shards=2) + 3 + the copies
    _batches(_streaming("bestfit", server, cache, cache_limit=limit, buffer_size=8), 400)
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
        _streaming("bestfit", server, tmp_path / "cache", cache_limit=3 * sizes[-1])


def test_shuffle_with_stream_is_refused(hosted, tmp_path):
    _, server, _ = hosted
    with pytest.raises(ValueError, match="shuffle=True"):
        _streaming("bestfit", server, tmp_path / "cache", shuffle=True)


# -----------------------------------------------------------------------------
# Resume and elastic merge


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_resume_exact_into_an_empty_cache_fetches_the_buffer_first(hosted, tmp_path, kind):
    hosted_dir, server, sizes = hosted
    extra = {"buffer_size": 40} if kind == "bestfit" else {}
    expected = _batches(_on_disk(kind, hosted_dir, **extra), 260)
    first = _batches(_streaming(kind, server, tmp_path / "a", cache_limit=7 * sizes[-1], **extra),
                     200)
    _same(first, expected[:200])
    state = first[-1][2]
    buffered = list(dict.fromkeys(index_to_filename(key[1])
                                  for key in decode_keys(state["buffer"])))
    assert buffered  # the test is about them
    before = len(server.fetched())
    resumed = _batches(_streaming(kind, server, tmp_path / "b", resume_state_dict=state,
                                  prefetch_shards=0, **extra), 60)
    _same(resumed, expected[200:])
    assert server.fetched()[before:before + len(buffered)] == buffered


def test_eviction_spares_what_any_loader_of_the_machine_needs(tmp_path):
    """With another live loader's needs on record (it reads shard 0, fetched shard 1 ahead, and
    buffers documents of shard 2 that it has not copied yet), making room evicts only the shards no
    one needs, oldest first, and says there is no room rather than evict one of those."""
    cache = tmp_path / "cache"
    names = [index_to_filename(i) for i in range(6)]
    (cache / STREAM_DIR).mkdir(parents=True)
    # 1,000 bytes each, fetched by a streaming loader, oldest first
    for i, name in enumerate(names[:5]):
        (cache / name).write_bytes(b"x" * 1000)
        os.utime(cache / name, (1e9 + i, 1e9 + i))
    ledger = Ledger(str(cache))
    needs = {names[0]: "reading", names[1]: "ahead", names[2]: "buffered"}
    with ledger.lock:
        another = Loader(socket.gethostname(), os.getpid(), 4000, needs)
        ledger.write(Table(loaders={"another": another},
                           shards={name: ShardRow(FETCHED) for name in names[:5]}))
    shards = ShardCache(str(cache), names, [f"http://127.0.0.1:9/{name}" for name in names],
                        [1000] * 6, prefetch_shards=0, cache_limit=4000, limits=FAST)

    def on_disk():
        return sorted(name for name in os.listdir(cache) if name.endswith(".parquet"))

    def make_room() -> bool:
        with ledger.lock:
            table = ledger.read()
            room = shards._make_room(table, names[5])
            ledger.write(table)
        return room

    assert make_room()  # 5 shards and the one to fetch: 6,000 bytes; 3 and 4 go
    assert on_disk() == names[:3]
    shards.limit = 2000
    assert not make_room()  # only what the other loader needs is left
    assert on_disk() == names[:3]
    with ledger.lock:  # that loader is gone: its shards may go, oldest first
        table = ledger.read()
        del table.loaders["another"]
        ledger.write(table)
    assert make_room()
    assert on_disk() == names[2:3]
    table = ledger.read()
    assert table.fetched() == names[2:3] and table.evicting
    evicted = {name: row.evictions for name, row in table.shards.items() if row.state == "evicted"}
    assert evicted == {names[0]: 1, names[1]: 1, names[3]: 1, names[4]: 1}


def _split_dir(hosted_dir, directory, num_train: int) -> str:
    """A directory with the first num_train hosted train shards and the val shard: the on-disk
    oracle's."""
    os.makedirs(directory)
    for name in [index_to_filename(i) for i in range(num_train)] + [VAL]:
        shutil.copy(os.path.join(hosted_dir, name), directory)
    return str(directory)


@pytest.mark.slow
def test_shards_outside_the_split_in_the_cache_do_not_stop_the_copies(tmp_path, monkeypatch):
    """A cache_limit that holds the split and the val shard, but not the 3 shards already in the
    cache from elsewhere (as after an earlier -n run): the loader must evict, so it copies buffered
    documents, and runs into the next epoch with the on-disk loader's batches (without copies the
    shards of long documents would fill the budget for good: a reader waiting for room, then an
    error)."""
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 3.0)
    hosted_dir = tmp_path / "hosted"
    write_hosted(hosted_dir, 12)
    server = ShardServer(str(hosted_dir))
    cache = tmp_path / "cache"
    cache.mkdir()
    for i in (9, 10, 11):
        shutil.copy(hosted_dir / index_to_filename(i), cache)
    train = [os.path.getsize(hosted_dir / index_to_filename(i)) for i in range(9)]
    limit = sum(train) + os.path.getsize(hosted_dir / VAL)
    try:
        expected = _batches(_on_disk("bestfit", _split_dir(hosted_dir, tmp_path / "split", 9),
                                     buffer_size=20), 420)
        loader = _streaming("bestfit", server, cache, num_shards=9, cache_limit=limit,
                            prefetch_shards=1, buffer_size=20)
        assert loader.cache_status().copying
        _same(_batches(loader, 420), expected)
    finally:
        server.close()
    assert expected[-1][2]["next"][0] == 2  # into the second epoch
    assert os.listdir(cache / STREAM_DIR / "kept")  # it copied


@pytest.mark.slow
def test_copies_beyond_their_room_give_way_to_a_waiting_reader(tmp_path, monkeypatch, caplog):
    """One document in 20 is 8,000 characters, far longer than a row: best-fit keeps them waiting,
    and their copies outgrow the room the start check sets aside (copies_estimate, from the average
    document: ~55 KB here, against ~250 KB). At the least cache_limit it accepts, the reader that
    finds no room has the oldest copies dropped, with a warning, rather than wait: the batches are
    the on-disk loader's, and the disk stays within the limit."""
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 3.0)
    hosted_dir = tmp_path / "hosted"
    hosted_dir.mkdir()
    rng = random.Random(1)
    for i in list(range(30)) + [6542]:
        texts = [f"s{i} d{j}: " + "".join(rng.choice("abcdefgh ") for _ in range(
            8000 if rng.random() < 0.05
            else rng.choice([rng.randint(1, 40), rng.randint(1, 300)])))
            for j in range(80)]
        write_shard(os.path.join(hosted_dir, index_to_filename(i)), texts, 16)
    server = ShardServer(str(hosted_dir))
    settings = dict(num_shards=30, prefetch_shards=1, buffer_size=60)
    try:
        limit = least_accepted(lambda limit: _streaming("bestfit", server, tmp_path / "cache",
                                                         cache_limit=limit, **settings))
        expected = _batches(_on_disk("bestfit", _split_dir(hosted_dir, tmp_path / "split", 30),
                                     buffer_size=60), 1500)
        with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.cache"):
            streamed, peak = peak_while(tmp_path / "cache", lambda: _batches(_streaming(
                "bestfit", server, tmp_path / "cache", cache_limit=limit, **settings), 1500))
    finally:
        server.close()
    _same(streamed, expected)
    assert peak <= limit
    assert any("the copies of buffered documents" in record.getMessage()
               for record in caplog.records)


def _kept(cache, name: str) -> dict[tuple[int, int], str]:
    """{(rg_idx, row): text} of the copies of shard `name`'s documents that the loaders kept for
    their buffers."""
    texts = {}
    kept = os.path.join(cache, STREAM_DIR, "kept")
    for owner in os.listdir(kept) if os.path.isdir(kept) else []:
        path = os.path.join(kept, owner, name + ".json.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:  # {"sha256": ..., "docs": [[rg, row, text], ...]}
                texts.update(((rg_idx, row), text) for rg_idx, row, text in json.load(f)["docs"])
    return texts


@pytest.mark.slow
def test_a_buffers_documents_are_on_disk_or_kept_and_a_resume_reads_the_copies(hosted, tmp_path):
    """Documents longer than a row (T=64) wait in the best-fit buffer for many shards. After every
    batch, each document the yielded state buffers is in its shard on disk or in a copy, with the
    shard's text; a resume in the same cache reads the copies and fetches none of the shards they
    came from."""
    hosted_dir, server, sizes = hosted
    cache = tmp_path / "cache"
    source = {}  # name -> {(rg_idx, row): text} of the hosted shards
    for name in sorted(os.listdir(hosted_dir)):
        pf = pq.ParquetFile(os.path.join(hosted_dir, name))
        source[name] = {(g, r): text for g in range(pf.num_row_groups)
                        for r, text in enumerate(pf.read_row_group(g).column("text").to_pylist())}
    expected = _batches(_on_disk("bestfit", hosted_dir, buffer_size=20), 260)
    # about the least: (packing 2 + prefetch_shards=1 + 1) x the largest, val, copies
    limit = int(5.2 * sizes[-1])
    loader = _streaming("bestfit", server, cache, cache_limit=limit, prefetch_shards=1,
                        buffer_size=20)
    copied = set()  # shards of buffered documents seen evicted, their documents kept
    streamed = []
    for inputs, targets, state in loader:
        streamed.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
        wanted = {}
        for key in decode_keys(state["buffer"]):
            wanted.setdefault(index_to_filename(key[1]), set()).add((key[2], key[3]))
        with FileLock(os.path.join(cache, STREAM_DIR, "lock")):  # (what evicts and copies holds it)
            for name, rows in wanted.items():
                if not (cache / name).exists():
                    kept = _kept(cache, name)
                    assert ({row: kept.get(row) for row in rows}
                            == {row: source[name][row] for row in rows}), name
                    copied.add(name)
        if len(streamed) == 200:
            break
    loader.close()
    _same(streamed, expected[:200])
    assert copied  # not vacuous: shards went while documents of theirs were buffered
    state = streamed[-1][2]
    gone = ({index_to_filename(key[1]) for key in decode_keys(state["buffer"])}
            - set(os.listdir(cache)))
    assert gone  # the resume needs documents of shards no longer on disk
    before = len(server.fetched())
    # (prefetch=0, prefetch_shards=0: nothing read or fetched ahead into the next epoch, which
    # reads them again)
    resumed = _batches(_streaming("bestfit", server, cache, cache_limit=limit, prefetch_shards=0,
                                  buffer_size=20, resume_state_dict=state, prefetch=0), 60)
    _same(resumed, expected[200:])
    assert not gone & set(server.fetched()[before:])  # read from the copies


@pytest.mark.slow
def test_elastic_merge_of_streamed_states(hosted, tmp_path, monkeypatch):
    """2 streaming ranks -> merge_states(stream=True) on a cache without the shards -> 3 streaming
    ranks: the same batches as the merge of the on-disk loaders' states resumed on disk."""
    hosted_dir, server, _ = hosted
    states = [_batches(_streaming("bestfit", server, tmp_path / f"old{r}", rank=r, world_size=2,
                                  buffer_size=10), 70)[-1][2] for r in range(2)]
    disk_states = [_batches(_on_disk("bestfit", hosted_dir, rank=r, world_size=2, buffer_size=10),
                            70)[-1][2]
                   for r in range(2)]
    assert states == disk_states
    merged = merge_states(states, 3, data_dir=str(tmp_path / "new"), stream=True,
                          base_url=server.url, download_limits=FAST)
    assert merged == merge_states(disk_states, 3, data_dir=hosted_dir)
    assert not [f for f in os.listdir(tmp_path / "new") if f.endswith(".parquet")]  # footers only
    for r in range(3):
        expected = _batches(_on_disk("bestfit", hosted_dir, rank=r, world_size=3, buffer_size=10,
                                     resume_state_dict=merged), 80)
        _same(_batches(_streaming("bestfit", server, tmp_path / "new", rank=r, world_size=3,
                                  buffer_size=10, resume_state_dict=merged), 80), expected)
    monkeypatch.setenv("NANOCHAT_STREAM", "1")  # merge_states reads it as the loaders do
    monkeypatch.setenv("NANOCHAT_DATA_URL", server.url)
    assert merge_states(states, 3, data_dir=str(tmp_path / "new")) == merged


@pytest.mark.slow
def test_a_merged_state_resumes_into_an_empty_cache_at_the_least_limit_without_a_stall(tmp_path):
    """merge_states of 2 ranks for 1: its plan deals the old buffers' documents, from 8 shards,
    all read before the first state. The start check counts them: at the least limit it accepts,
    the resume is exact and does not wait for room."""
    hosted_dir = str(tmp_path / "hosted")
    write_hosted(hosted_dir, 12)
    server = ShardServer(hosted_dir)
    limits = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=5)
    kwargs = dict(num_shards=12, buffer_size=40, download_limits=limits)
    try:
        states = [_batches(_streaming("bestfit", server, tmp_path / f"old{r}", rank=r,
                                      world_size=2, **kwargs), 150)[-1][2] for r in range(2)]
        merged = merge_states(states, 1, data_dir=hosted_dir)
        first = merged["states"][0]["plan"]
        assert len({unit.get("pq_idx") for unit in first}) >= 6  # the test is about them
        expected = _batches(_on_disk("bestfit", hosted_dir, buffer_size=40,
                                     resume_state_dict=merged), 20)
        least = least_accepted(lambda limit: _streaming(
            "bestfit", server, tmp_path / "probe", cache_limit=limit, resume_state_dict=merged,
            **kwargs))
        resumed = outcome(lambda: _batches(_streaming(
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
                           shards={name: ShardRow(FETCHED) for name in held}))
    limits = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=3)
    # room for 5 shards and a half: the 5 held and not one more
    loader = _streaming("bestfit", server, cache, cache_limit=int(5.5 * sizes[-1]),
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
    expected = _batches(_on_disk("bestfit", hosted_dir), 100)
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
            _streaming("bestfit", server, tmp_path / "cache", **kwargs)


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


def test_catalog_is_read_once_and_reused(hosted, tmp_path):
    hosted_dir, server, _ = hosted
    _batches(_streaming("bestfit", server, tmp_path / "cache"), 1)
    # the file's end
    footers = [name for name, wanted in server.gets if wanted and wanted.startswith("bytes=-")]
    # val's too: the budget counts it
    assert sorted(footers) == [index_to_filename(i) for i in range(7)] + [VAL]
    catalog = json.loads((tmp_path / "cache" / STREAM_DIR / "catalog.json").read_text())
    for i in range(7):
        path = os.path.join(hosted_dir, index_to_filename(i))
        entry = catalog[index_to_filename(i)]
        assert entry["size"] == os.path.getsize(path)
        assert sum(entry["rows"]) == 300 and entry["rows"][0] == 32
    before = len(server.gets)
    _batches(_streaming("bestfit", server, tmp_path / "cache"), 1)
    assert not [name for name, wanted in server.gets[before:]
                if wanted and wanted.startswith("bytes=-")]


def test_fetch_tail_and_footer_rows(hosted):
    hosted_dir, server, _ = hosted
    path = os.path.join(hosted_dir, index_to_filename(1))
    body = open(path, "rb").read()
    size, tail = download.fetch_tail(f"{server.url}/{index_to_filename(1)}", 100, FAST)
    assert (size, tail) == (len(body), body[-100:])
    size, tail = download.fetch_tail(f"{server.url}/{index_to_filename(1)}", 10 * len(body), FAST)
    assert tail == body
    assert footer_rows(body[-100:], "x") is None  # too short for the footer: ask again for it whole
    assert footer_rows(body, "x") == [32] * 9 + [12]
    with pytest.raises(ValueError, match="not a parquet file"):
        footer_rows(b"x" * 100, "http://h/shard_00000.parquet")
    with pytest.raises(DownloadError, match="HTTP 404"):
        download.fetch_tail(f"{server.url}/missing.parquet", 100, FAST)


def test_fetch_tail_needs_range_support(tmp_path):
    (tmp_path / "f.parquet").write_bytes(b"PAR1" + b"x" * 100 + b"PAR1")
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(DownloadError, match="must honour Range requests"):
            download.fetch_tail(f"http://127.0.0.1:{server.server_address[1]}/f.parquet", 10, FAST)
    finally:
        server.shutdown()
        server.server_close()
