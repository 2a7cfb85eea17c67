"""
What a streaming cache holds, for a person (nanochat/data/streaming/cache_status.py): the ledger,
the CacheStatus record of ShardCache.status() and DataLoader.cache_status(), and `python -m
nanochat.shard_cache status`, run as a user runs it. A small cache written by hand gives exact
figures; a live streaming loader gives the same figures through the loader and the command.

    python -m pytest tests/data/streaming/test_cache_status.py -q
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import ByteTokenizer, REPO_ROOT, write_shard
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.cache_status import (CacheStatus, describe, KeptCopy, LiveLoader,
                                                  read_status, ShardFile, ShardNeed)
from nanochat.data.streaming.ledger import (EVICTED, FETCHED, STREAM_DIR, Ledger, Loader,
                                            ShardEntry, Table)
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import index_to_filename


HOST = socket.gethostname()
S = [index_to_filename(i) for i in range(6)]  # shard_00000.parquet, ...
NEEDS = {S[1]: "reading", S[2]: "ahead", S[0]: "buffered"}  # the first loader's of the small cache


def dead_pid() -> int:
    """The pid of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def status_command(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanochat.shard_cache", "status",
                           *map(str, args)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_cache(tmp_path):
    """A cache written by hand: 3 streamed shards, one of the user's, a partial download; two live
    loaders and a gone one; a copy of each of a live and a gone loader; 3 evictions."""
    cache = tmp_path / "cache"
    (cache / STREAM_DIR).mkdir(parents=True)
    for name, size in ((S[0], 1000), (S[1], 2000), (S[2], 3000), (S[3], 4000)):
        (cache / name).write_bytes(b"x" * size)
    (cache / f"{S[4]}.tmp").write_bytes(b"x" * 500)
    for owner, name, size in (("box-1-0", S[0], 120), ("box-9-0", S[5], 80)):
        (cache / STREAM_DIR / "kept" / owner).mkdir(parents=True)
        (cache / STREAM_DIR / "kept" / owner / f"{name}.json.gz").write_bytes(b"x" * size)
    ledger = Ledger(str(cache))
    table = Table(
        loaders={"box-1-0": Loader(HOST, os.getpid(), 20_000, NEEDS, fetching=S[4]),
                 "box-2-0": Loader(HOST, os.getpid(), 15_000, {S[1]: "packing"}, restoring=True),
                 "box-9-0": Loader(HOST, dead_pid(), 10_000, {S[5]: "reading"})},
        shards={S[0]: ShardEntry(FETCHED, 1), S[1]: ShardEntry(FETCHED), S[2]: ShardEntry(FETCHED),
                S[4]: ShardEntry(FETCHED), S[5]: ShardEntry(EVICTED, 2)},
        kept={"box-1-0": {S[0]: 120}, "box-9-0": {S[5]: 80}}, evicting=True)
    with ledger.lock:
        ledger.write(table)
    return cache


def test_the_figures_of_a_small_cache(small_cache):
    status = read_status(str(small_cache))
    assert status == CacheStatus(
        data_dir=str(small_cache), cache_limit=15_000,  # the least of the live loaders'
        shards=(ShardFile(S[0], 1000, "streamed"), ShardFile(S[1], 2000, "streamed"),
                ShardFile(S[2], 3000, "streamed"), ShardFile(S[3], 4000, "yours"),
                ShardFile(S[4], 500, "partial")),
        # (box-9-0 is gone)
        loaders=(LiveLoader("box-1-0", 20_000, False), LiveLoader("box-2-0", 15_000, True)),
        needs=(ShardNeed(S[0], "box-1-0", "buffered"), ShardNeed(S[1], "box-1-0", "reading"),
               ShardNeed(S[1], "box-2-0", "packing"), ShardNeed(S[2], "box-1-0", "ahead"),
               ShardNeed(S[4], "box-1-0", "fetching")),
        kept=(KeptCopy(S[0], "box-1-0", 120, True), KeptCopy(S[5], "box-9-0", 80, False)),
        evicted=(S[5],), evictions=3, evicting=True,
        owner=None, peak_bytes=None, fetched_bytes=None, copying=None)  # (no loader's own figures)
    assert (status.shard_bytes, status.kept_bytes, status.used_bytes) == (10_500, 200, 10_700)
    # reading it changes nothing: the gone loader's row is dropped only by a loader that writes
    ledger = json.loads((small_cache / STREAM_DIR / "ledger.json").read_text())
    assert "box-9-0" in ledger["loaders"]


EXPECTED = """\
streaming cache in {cache}
on disk: 10.7 KB: 5 shard files, 10.5 KB, and 2 kept copies, 200 bytes
cache_limit: 15.0 KB, 71% used
  shard_00000.parquet       1.0 KB  streamed
  shard_00001.parquet       2.0 KB  streamed
  shard_00002.parquet       3.0 KB  streamed
  shard_00003.parquet       4.0 KB  yours
  shard_00004.parquet    500 bytes  partial
  (partial: a download under way or cut short; its next fetch resumes it)
  (streamed: fetched by a streaming loader; evicted once no live loader needs it)
  (yours: not fetched by a streaming loader; never evicted)
live loaders: 2
  box-1-0: cache_limit 20.0 KB
  box-2-0: cache_limit 15.0 KB, restoring a buffer
needs of the live loaders: 5
  shard_00000.parquet  box-1-0  buffered: recent states buffer documents of it, not copied yet
  shard_00001.parquet  box-1-0  reading: its reader is at it (reads it, or waits for it)
  shard_00001.parquet  box-2-0  packing: documents read from it are not packed yet
  shard_00002.parquet  box-1-0  ahead: fetched ahead (prefetch_shards)
  shard_00004.parquet  box-1-0  fetching: it is downloading it
kept for buffers (.stream/kept): 2 copies
  shard_00000.parquet  box-1-0  120 bytes
  shard_00005.parquet  box-9-0 (gone: kept for a resume)  80 bytes
evicted, not fetched since: shard_00005.parquet (3 evictions in all)
"""


def test_the_status_command_prints_them_for_a_person(small_cache):
    result = status_command(small_cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED.format(cache=small_cache)
    assert result.stdout == describe(read_status(str(small_cache))) + "\n"


@pytest.mark.slow
def test_the_status_command_on_a_directory_never_streamed_into_and_a_missing_one(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / S[0]).write_bytes(b"x" * 2500)
    result = status_command(tmp_path / "plain")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:5] == [
        "on disk: 2.5 KB: 1 shard file, 2.5 KB, and 0 kept copies, 0 bytes",
        "cache_limit: none (no live loader has one)",
        "  shard_00000.parquet       2.5 KB  yours",
        "  (yours: not fetched by a streaming loader; never evicted)"]
    assert not (tmp_path / "plain" / STREAM_DIR).exists()  # looking writes nothing
    result = status_command(tmp_path / "missing")
    assert result.returncode == 1
    assert result.stderr == f"{tmp_path / 'missing'} is not a directory\n"


@pytest.mark.slow
def test_the_status_command_reads_the_default_data_directory(small_cache, tmp_path):
    # the dataset's directory under NANOCHAT_BASE_DIR, as the loaders find it
    os.rename(small_cache, tmp_path / "base_data_climbmix")
    result = status_command(env=dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED.format(cache=tmp_path / "base_data_climbmix")


@pytest.mark.slow
def test_a_streaming_loader_reports_the_same_figures(tmp_path):
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    hosted.mkdir()
    for i in list(range(4)) + [6542]:  # 4 train shards and the val shard, 48 documents each
        texts = [f"shard {i} doc {j}: " + "ab" * 10 for j in range(48)]
        write_shard(str(hosted / index_to_filename(i)), texts, 8)
    sizes = {name: os.path.getsize(hosted / name) for name in os.listdir(hosted)}
    limit = 7 * max(sizes.values())
    server = ShardServer(str(hosted))
    try:
        limits = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=30)
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), 2, 32, "train", device="cpu", data_dir=str(cache), stream=True,
            num_shards=4, base_url=server.url, cache_limit=limit, prefetch_shards=1, prefetch=0,
            tokenizer_batch_size=2, buffer_size=4, download_limits=limits)
        for _ in range(10):  # shard 0 is read; 1 is fetched ahead
            next(loader)
        for _ in range(1000):  # 10 s: until the fetch ahead is done (then all waits for next())
            status = loader.cache_status()
            # (a fetch's bytes are counted once the shard is checked against the catalog, after
            # its row says it fetches nothing)
            done = status.fetched_bytes == sizes[S[0]] + sizes[S[1]]
            if done and all(n.reason != "fetching" for n in status.needs):
                break
            time.sleep(0.01)
        command = status_command(cache)
        loader.close()
        fetched = server.fetched()
    finally:
        server.close()
    assert isinstance(status, CacheStatus)
    assert status.cache_limit == limit
    assert status.copying is False  # (the split fits: nothing is copied)
    assert [loader.owner for loader in status.loaders] == [status.owner]
    assert {(n.shard, n.reason) for n in status.needs if n.loader == status.owner} >= {
        (S[0], "reading"), (S[1], "ahead"), (index_to_filename(6542), "val")}
    assert {(s.name, s.bytes, s.kind) for s in status.shards} == {
        (name, sizes[name], "streamed") for name in fetched}
    assert status.fetched_bytes == sum(sizes[name] for name in fetched)
    assert status.shard_bytes <= status.peak_bytes <= limit
    assert (status.kept, status.evicted, status.evictions) == ((), (), 0)
    # the command, run while the loader was live, shows the same: its needs, one line each
    assert command.returncode == 0, command.stderr
    reading = f"  {S[0]}  {status.owner}  reading: its reader is at it (reads it, or waits for it)"
    assert reading in command.stdout.splitlines()
    assert describe(status).splitlines()[1:] == command.stdout.splitlines()[1:]
    assert read_status(str(cache)).loaders == ()  # closed: its row is out of the ledger


def test_a_loader_that_does_not_stream_has_no_cache_status(tmp_path):
    write_shard(str(tmp_path / S[0]), ["a b c"] * 20, 8)
    write_shard(str(tmp_path / S[1]), ["d e f"] * 20, 8)
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=str(tmp_path))
    assert loader.cache_status() is None
    loader.close()


def test_the_ledger_is_one_json_table(small_cache):
    """The file a person finds in .stream: each loader's row, the shards' states, who owns each
    copy."""
    table = json.loads((small_cache / STREAM_DIR / "ledger.json").read_text())
    table["loaders"]["box-9-0"]["pid"] = "gone"  # (the pid of a process that has exited)
    assert table == {
        "loaders": {
            "box-1-0": {"host": HOST, "pid": os.getpid(), "cache_limit": 20_000, "restoring": False,
                        "needs": NEEDS, "fetching": S[4], "started": None, "later": []},
            "box-2-0": {"host": HOST, "pid": os.getpid(), "cache_limit": 15_000, "restoring": True,
                        "needs": {S[1]: "packing"}, "fetching": None, "started": None,
                        "later": []},
            "box-9-0": {"host": HOST, "pid": "gone", "cache_limit": 10_000, "restoring": False,
                        "needs": {S[5]: "reading"}, "fetching": None, "started": None,
                        "later": []}},
        "shards": {S[0]: {"state": "fetched", "evictions": 1},
                   S[1]: {"state": "fetched", "evictions": 0},
                   S[2]: {"state": "fetched", "evictions": 0},
                   S[4]: {"state": "fetched", "evictions": 0},
                   S[5]: {"state": "evicted", "evictions": 2}},
        "kept": {"box-1-0": {S[0]: 120}, "box-9-0": {S[5]: 80}},
        "evicting": True}
