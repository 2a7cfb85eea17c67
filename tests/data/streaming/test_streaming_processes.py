"""
Streaming (stream=True) with real processes and real failures, against a ShardServer on
127.0.0.1: many ranks of one machine share one cache and download each shard once, even when
they drift apart; every local rank checks the machine's least cache_limit, and a merged state
resumes at it; two torchrun "nodes" each fill their own cache; a streaming run killed
mid-download resumes exactly; a server that goes away or falls silent, a missing shard and a full
disk are clear errors, never a hang; the least cache_limit is enough while another loader of the
machine downloads, or after one was interrupted. Every streamed batch and state is compared with
the same loader over the hosted shards on disk.
Run: python -m pytest tests/data/streaming/test_streaming_processes.py -q   (~90 s)
"""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from itertools import islice
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from conftest import TESTS, ByteTokenizer, least_accepted, outcome, worker_env, write_shard
from s3_server import free_port
from nanochat.data.streaming import eviction, fetcher
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import get_dataset, index_to_filename
from nanochat.data.fetch.limits import Limits
from nanochat.data.streaming.budget import copies_estimate, size_up
from nanochat.data.streaming.catalog import read_catalog
from nanochat.resume import merge_states
from nanochat.data.base.state import decode_keys
from nanochat.data.fetch import serve as shard_server
from nanochat.data.fetch.serve import BLOCK, ShardServer
from stream_worker import LOADER, rows_of

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# -----------------------------------------------------------------------------
# Hosted shards, the on-disk oracle, the workers


def host_shards(directory, num_shards: int, docs_of, row_group_size: int) -> list[str]:
    """Train shards shard_00000.parquet, ... with docs_of(i)'s texts, and the dataset's val shard,
    as the hub names them. Returns the train shards' names."""
    os.makedirs(directory, exist_ok=True)
    names = [index_to_filename(i) for i in range(num_shards)]
    for i, name in enumerate(names):
        write_shard(os.path.join(directory, name), docs_of(i), row_group_size)
    write_shard(os.path.join(directory, get_dataset().val_filename), ["val"], 1)
    return names


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=n))


def equal_docs(num: int, length: int):
    """docs_of for shards whose documents all have one length: every rank then takes the same
    number of documents per batch, so ranks that step together stay on the same shard."""
    return lambda i: [letters(random.Random(f"{i}-{j}"), length) for j in range(num)]


def on_disk(
    hosted, num_batches: int, rank: int = 0, world_size: int = 1, resume=None, **settings
) -> list[dict]:
    """The oracle: the same loader over the hosted shards on disk, each batch as a worker writes
    it (settings: a worker's STREAM_WORKER_LOADER)."""
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(hosted), rank=rank, world_size=world_size,
        resume_state_dict=resume, **LOADER | settings)
    batches = take_written(loader, num_batches)
    loader.close()
    return batches


def take_written(loader, num_batches: int) -> list[dict]:
    """The next batches of a loader as a worker writes them, and reads them back (tuples become
    lists)."""
    return [json.loads(json.dumps({"rows": rows_of(inputs, targets), "state": state}))
            for inputs, targets, state in islice(loader, num_batches)]


def read_lines(path) -> list[dict]:
    """A worker's complete lines (a killed worker may have left half of one)."""
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def stream_env(base_dir, url: str, num_shards: int, cache_limit: int | None = None) -> dict:
    """A worker's environment: stream num_shards train shards from url into base_dir's dataset
    directory."""
    env = dict(worker_env(), NANOCHAT_STREAM="1", NANOCHAT_BASE_DIR=str(base_dir),
               NANOCHAT_DATA_URL=url, NANOCHAT_STREAM_SHARDS=str(num_shards))
    if cache_limit is not None:
        env["NANOCHAT_CACHE_LIMIT"] = str(cache_limit)
    return env


def copies(hosted, names) -> int:
    """The room the loaders below (a buffer of 8) set aside for copies of buffered documents
    (copies_estimate)."""
    entries = [{"size": os.path.getsize(os.path.join(hosted, name)),
                "rows": [pq.read_metadata(os.path.join(hosted, name)).num_rows]}
               for name in names]
    return copies_estimate(entries, LOADER["buffer_size"])


def least_limit(hosted, names) -> int:
    """The least cache_limit of a 3-shard split, prefetch_shards=2: its 3 shards and the val shard
    (it all fits then: no shard is ever evicted, so no copies of buffered documents are made or
    budgeted)."""
    assert len(names) == 3
    return (sum(shards_in(hosted)[name] for name in names)
            + shards_in(hosted)[get_dataset().val_filename])


def cache_dir(base_dir) -> str:
    return os.path.join(base_dir, get_dataset().subdir)


def shards_in(directory) -> dict[str, int]:
    """name -> bytes of the complete shards in a directory."""
    return {name: os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
            if name.endswith(".parquet")}


def ledger_loaders(directory) -> dict[str, dict]:
    """The loaders' rows in a cache's ledger, as the file has them (dead loaders too)."""
    with open(os.path.join(directory, ".stream", "ledger.json")) as f:
        return json.load(f)["loaders"]


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -----------------------------------------------------------------------------
# Many ranks, one machine; many machines, a disk each


@pytest.mark.slow
def test_ranks_of_one_machine_download_each_shard_once_within_the_budget(tmp_path):
    # 10 shards of 48 equal documents in row groups of 2: 24 documents (6 batches) per rank per
    # shard
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    names = host_shards(hosted, 10, equal_docs(48, 20), row_group_size=2)
    out.mkdir()
    largest = max(shards_in(hosted)[name] for name in names)
    # about the least it accepts: room for the shard read, the one still being packed,
    # prefetch_shards=2 ahead, a rank out of step, the val shard and copies of the buffered
    # documents (a few hundred bytes)
    limit = 6 * largest + copies(hosted, names)
    # 144 documents per rank, and 8 more in the buffer: shards 0-6 are read (the run must evict),
    # 7 and 8 fetched ahead; nothing of the next epoch is, so every shard's one visit is its only
    # one
    num_batches = 36
    server = ShardServer(str(hosted))
    try:
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2",
               os.path.join(TESTS, "stream_worker.py"), str(out), str(num_batches)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                env=stream_env(tmp_path / "base", server.url, len(names), limit))
        assert result.returncode == 0, result.stdout + result.stderr
        fetched = server.fetched()
    finally:
        server.close()
    for rank in range(2):
        assert read_lines(out / f"rank{rank}.jsonl") == on_disk(hosted, num_batches, rank, 2)
    # one download per shard for the machine, not one per rank, in the order they are read
    last_read = read_lines(out / "rank0.jsonl")[-1]["state"]["pq_idx"]
    assert last_read == 6
    assert fetched == names[:len(fetched)] and len(fetched) >= last_read + 1
    # the budget held: shards were evicted (each then had been read by both ranks: none was fetched
    # twice)
    kept = shards_in(cache_dir(tmp_path / "base"))
    assert len(kept) < len(fetched) and sum(kept.values()) <= limit


@pytest.mark.slow
def test_local_ranks_that_drift_apart_download_each_shard_once(tmp_path):
    """3 ranks, 10 row groups per shard: rank 0 reads 4 of each shard, ranks 1 and 2 read 3, so
    ranks 1 and 2 move through the shards faster and drift ~17 shards ahead in 200 steps. With a
    budget that holds the drift and what the ranks read (30 shards; scripts/bench_drift), each
    shard is downloaded once: eviction spares what the lagging rank reads soon (its `later` in the
    ledger), not only what it needs now."""
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    names = host_shards(hosted, 80, equal_docs(40, 20), row_group_size=4)
    out.mkdir()
    limit = 30 * max(shards_in(hosted)[name] for name in names)
    server = ShardServer(str(hosted))
    try:
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=3",
               os.path.join(TESTS, "stream_worker.py"), str(out), "200"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                env=stream_env(tmp_path / "base", server.url, len(names), limit))
        assert result.returncode == 0, result.stdout + result.stderr
        fetched = server.fetched()
    finally:
        server.close()
    read = [[line["state"]["pq_idx"] for line in read_lines(out / f"rank{rank}.jsonl")]
            for rank in range(3)]
    assert read[1][-1] - read[0][-1] >= 15  # they drifted apart (more than the 6 it needs)
    assert read[0] == [line["state"]["pq_idx"] for line in on_disk(hosted, 200, 0, 3)]
    assert len(set(fetched)) > 50  # every shard read, and evictions: 30 of them fit
    assert sorted(fetched) == sorted(set(fetched))  # none downloaded twice


@pytest.mark.slow
def test_two_nodes_each_fill_their_own_cache(tmp_path):
    # torchrun --nnodes 2 on one machine: node 0 and node 1 are two launches with a base dir (a
    # local disk) each
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    names = host_shards(hosted, 4, equal_docs(24, 20), row_group_size=2)
    out.mkdir()
    num_batches = 16  # 3 batches per rank per shard: past the first epoch (12 batches), no limit
    server = ShardServer(str(hosted))
    port, nodes = free_port(), []
    try:
        nodes += [subprocess.Popen([*TORCHRUN, "--nnodes=2", f"--node-rank={node}",
                                    "--nproc-per-node=1", "--master-addr=127.0.0.1",
                                    f"--master-port={port}",
                                    os.path.join(TESTS, "stream_worker.py"),
                                    str(out), str(num_batches)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=stream_env(tmp_path / f"node{node}", server.url, len(names)))
                  for node in range(2)]
        for node in nodes:
            output = node.communicate(timeout=120)[0]
            assert node.returncode == 0, output
        fetched = server.fetched()
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        server.close()
    for rank in range(2):  # node_rank x nproc_per_node + local rank
        assert read_lines(out / f"rank{rank}.jsonl") == on_disk(hosted, num_batches, rank, 2)
    # each node downloaded each shard once, into its own directory, byte for byte the hosted one
    assert Counter(fetched) == {name: 2 for name in names}
    for node in range(2):
        directory = cache_dir(tmp_path / f"node{node}")
        assert sorted(shards_in(directory)) == names
        for name in names:
            assert file_bytes(os.path.join(directory, name)) == file_bytes(hosted / name)


# -----------------------------------------------------------------------------
# Kill and resume


def mixed_docs(i: int) -> list[str]:
    """4 long documents (60 KB of random text: a shard is ~150 KB, which a throttled server sends
    in 64 KB steps) among 12 short ones, which best-fit keeps in its buffer while the long ones
    fill rows."""
    rng = random.Random(i)
    docs = ([letters(rng, 60_000) for _ in range(4)]
            + [letters(rng, rng.randint(5, 40)) for _ in range(12)])
    rng.shuffle(docs)
    return docs


def buffered_shards(state) -> list[int]:
    """The shards of a state's buffered documents, in the order a resume re-reads them."""
    shards = [key[1] for key in decode_keys(state["buffer"])]
    return [p for i, p in enumerate(shards) if i == 0 or p != shards[i - 1]]


@pytest.mark.slow
def test_a_killed_streaming_run_resumes_exactly(tmp_path):
    hosted, base = tmp_path / "hosted", tmp_path / "base"
    names = host_shards(hosted, 10, mixed_docs, row_group_size=2)
    # the least it accepts: 6 of the 10 (the shard read, the one still being packed,
    # prefetch_shards=2 ahead, one for a rank out of step, the val shard) and copies of the
    # buffered documents (about one); the resume below starts at it too, with the killed run's
    # partial download
    limit = 6 * max(shards_in(hosted).values()) + copies(hosted, names)
    directory = cache_dir(base)
    # a link of 1 MB/s: a shard takes ~0.15 s, so a download is under way most of the time
    server = ShardServer(str(hosted), rate=1e6)
    env = stream_env(base, server.url, len(names), limit)
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    killed.mkdir(), resumed.mkdir()
    try:
        with open(killed / "log", "w") as log:
            worker = subprocess.Popen(
                [sys.executable, os.path.join(TESTS, "stream_worker.py"), str(killed), "1000"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            partial = kill_mid_download(worker, killed, directory, min_batches=13)
        finally:
            worker.kill()  # (already, unless that failed)
            worker.wait()
        server.throttle.rate = None
        before = read_lines(killed / "rank0.jsonl")
        k = len(before)
        have = os.path.getsize(os.path.join(directory, partial + ".tmp"))
        stale = [owner for owner, row in ledger_loaders(directory).items()
                 if row["pid"] == worker.pid]
        assert len(stale) == 1  # the killed loader's row in the ledger is left behind

        num_after = 25  # about 5 more shards, past those the dead loader was reading
        expected = on_disk(hosted, k + num_after)
        assert before == expected[:k]
        with open(tmp_path / "state.json", "w") as f:
            json.dump(before[-1]["state"], f)

        mark = len(server.gets)
        result = subprocess.run([sys.executable, os.path.join(TESTS, "stream_worker.py"),
                                 str(resumed), str(num_after), str(tmp_path / "state.json")],
                                capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        after = server.gets[mark:]
    finally:
        server.close()
    assert read_lines(resumed / "rank0.jsonl") == expected[k:]
    # the half-downloaded shard is resumed from the bytes it kept, not fetched again from byte 0
    assert next(wanted for name, wanted in after if name == partial) == f"bytes={have}-"
    # the dead loader's row pins nothing: the resumed run dropped it (its process is gone), and
    # kept the budget
    assert stale[0] not in ledger_loaders(directory)
    assert sum(shards_in(directory).values()) <= limit


def lingering_docs(i: int) -> list[str]:
    """100 documents of 18-77 characters: those longer than a row (T=32) wait in the buffer for
    shards on end."""
    rng = random.Random(i)
    return [f"shard {i} doc {j}: " + letters(rng, rng.randint(1, 60)) for j in range(100)]


@pytest.mark.slow
def test_a_resume_after_a_kill_reads_the_buffered_documents_from_the_dead_loaders_copies(tmp_path):
    hosted, base = tmp_path / "hosted", tmp_path / "base"
    names = host_shards(hosted, 10, lingering_docs, row_group_size=16)
    # the least it accepts, as above
    limit = 6 * max(shards_in(hosted).values()) + copies(hosted, names)
    directory = cache_dir(base)
    server = ShardServer(str(hosted))
    env = stream_env(base, server.url, len(names), limit)
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    killed.mkdir(), resumed.mkdir()
    # the worker stops after a state whose buffer spans 5 shards (the most these shards give) and
    # idles, its loader open: its fetching thread copies those documents and fetches ahead, which
    # needs the room of some of them
    expected = on_disk(hosted, 400)
    num = next(i + 1 for i, batch in enumerate(expected)
               if i >= 100 and len(buffered_shards(batch["state"])) >= 5)
    state = expected[num - 1]["state"]
    try:
        with open(killed / "log", "w") as log:
            worker = subprocess.Popen(
                [sys.executable, os.path.join(TESTS, "stream_worker.py"), str(killed), str(num)],
                stdout=log, stderr=subprocess.STDOUT, env=dict(env, STREAM_WORKER_IDLE="1"))
        try:
            for _ in range(2000):  # 20 s: until a shard of its last state's buffer is evicted
                assert worker.poll() is None, (killed / "log").read_text()
                written = killed / "rank0.jsonl"
                if os.path.exists(written) and len(read_lines(written)) == num:
                    gone = {names[p] for p in buffered_shards(state)} - set(os.listdir(directory))
                    if gone:
                        break
                time.sleep(0.01)
            else:
                raise AssertionError("no shard of the last state's buffer was evicted")
        finally:
            worker.kill()
            worker.wait()
        before = read_lines(killed / "rank0.jsonl")
        assert before[-1]["state"] == state
        expected = on_disk(hosted, len(before) + 20)
        assert before == expected[:len(before)]
        with open(tmp_path / "state.json", "w") as f:
            json.dump(state, f)
        mark = len(server.gets)
        result = subprocess.run([sys.executable, os.path.join(TESTS, "stream_worker.py"),
                                 str(resumed), "20", str(tmp_path / "state.json")],
                                capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        after = {name for name, _ in server.gets[mark:]}
    finally:
        server.close()
    assert read_lines(resumed / "rank0.jsonl") == expected[len(before):]
    assert not gone & after  # read from the copies, not fetched again
    assert sum(shards_in(directory).values()) <= limit


def kill_mid_download(worker, out, directory, min_batches: int) -> str:
    """SIGKILL the worker (no cleanup of any kind) once it has written min_batches batches and a
    shard is partly downloaded; that shard's name. The worker is stopped (SIGSTOP) while the
    directory is looked at, so what the test sees is what the kill leaves."""
    for _ in range(2000):  # 10 s
        assert worker.poll() is None, (out / "log").read_text()
        if (os.path.exists(out / "rank0.jsonl")
                and len(read_lines(out / "rank0.jsonl")) >= min_batches):
            worker.send_signal(signal.SIGSTOP)
            partial = [name.removesuffix(".tmp") for name in os.listdir(directory)
                       if name.endswith(".parquet.tmp")
                       and os.path.getsize(os.path.join(directory, name)) > 0]
            if partial:
                worker.kill()
                return partial[0]
            worker.send_signal(signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("no download was seen under way")


@pytest.mark.slow
def test_a_resume_elsewhere_fetches_the_buffered_documents_shards_first(tmp_path):
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 10, mixed_docs, row_group_size=2)
    expected = on_disk(hosted, 23)
    state = expected[12]["state"]  # one the killed run above wrote too
    # two shards before the stream's own
    assert buffered_shards(state) == [1, 2, 3] and state["next"][1] == 3
    server = ShardServer(str(hosted))
    try:  # on another machine: an empty cache
        loader = streaming(tmp_path / "cache", server.url, len(names), prefetch_shards=2,
                           resume_state_dict=state)
        resumed = take_written(loader, 10)
        loader.close()
    finally:
        server.close()
    assert resumed == expected[13:]
    fetched = server.fetched()
    # 1, 2 (buffered), 3, 4, 5 (read); never 0
    assert fetched == names[1:1 + len(fetched)] and len(fetched) >= 5


# -----------------------------------------------------------------------------
# Failures: a server that goes away, a missing shard, a full disk, a budget too small

# two attempts 10 ms apart, each silent for at most 2 s, 10 s for a file: an error within seconds
LIMITS = Limits(max_attempts=2, backoff_base=0.01, timeout=2, deadline=10)


def streaming(cache, url: str, num_shards: int, **kwargs):
    """The loader of the tests above, streaming into cache; shards are fetched only as they are
    read (prefetch_shards=0), so the test knows which shard a failure hits."""
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(cache), stream=True, num_shards=num_shards, base_url=url,
        **{"prefetch_shards": 0, "download_limits": LIMITS, **LOADER, **kwargs})



def batches_until_error(loader, max_batches: int) -> tuple[list[dict], Exception]:
    """The batches next() gives, then the error it raises (within a minute); fails after
    max_batches."""
    got = []
    error = outcome(lambda: [got.extend(take_written(loader, 1)) for _ in range(max_batches + 1)])
    assert isinstance(error, Exception), f"{len(got)} batches and no error"
    return got, error


def test_a_server_gone_mid_run_is_an_error_naming_the_shard_and_its_url(tmp_path):
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 3, equal_docs(48, 20), row_group_size=2)  # 12 batches a shard
    expected = on_disk(hosted, 36)
    server = ShardServer(str(hosted))
    loader = streaming(tmp_path / "cache", server.url, len(names))
    try:
        got = take_written(loader, 1)  # shard 0 arrived
        server.close()
        more, error = batches_until_error(loader, 36)
    finally:
        loader.close()
    assert got + more == expected[:len(got + more)] and len(more) >= 9  # the rest of shard 0
    assert isinstance(error, ConnectionError)
    url = f"{server.url}/{names[1]}"
    assert str(error).startswith(f"could not fetch shard {names[1]} from {url}: "), error
    assert "gave up after 2 attempts" in str(error)


@pytest.mark.slow
def test_a_server_gone_silent_mid_download_is_an_error_not_a_hang(tmp_path):
    hosted = tmp_path / "hosted"
    # ~150 KB shards: 3 of the server's blocks
    names = host_shards(hosted, 3, mixed_docs, row_group_size=2)
    server = ShardServer(str(hosted))
    loader = streaming(tmp_path / "cache", server.url, len(names),
                       download_limits=Limits(max_attempts=2, backoff_base=0.01, timeout=0.5,
                                              deadline=10))
    try:
        take_written(loader, 1)
        # the connection stays open, and after the block in flight nothing more comes
        server.throttle.rate = 1.0
        _, error = batches_until_error(loader, 20)
    finally:
        loader.close()
        server.close()
    assert isinstance(error, ConnectionError)
    assert str(error).startswith(
        f"could not fetch shard {names[1]} from {server.url}/{names[1]}: "), error
    assert "timed out" in str(error)


def test_an_outage_over_before_its_shard_is_read_does_not_end_the_run(tmp_path, monkeypatch):
    # a fetch ahead that fails is tried again when the reader needs the shard: without prefetching
    # the same short outage would pass unnoticed, so prefetching must not turn it into the end of
    # the run minutes later
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 4, equal_docs(48, 20), row_group_size=2)  # 12 batches a shard
    expected = on_disk(hosted, 40)
    outage, refused = threading.Event(), []
    serve = shard_server._Handler.do_GET

    # during the outage, a whole-file GET of shard 2 is answered 503 (its footer is served)
    def do_get(handler):
        if (outage.is_set() and handler.path.endswith(names[2])
                and "Range" not in handler.headers):
            refused.append(handler.path)
            handler.send_error(503)
        else:
            serve(handler)

    monkeypatch.setattr(shard_server._Handler, "do_GET", do_get)
    server = ShardServer(str(hosted))
    outage.set()
    try:
        loader = streaming(tmp_path / "cache", server.url, len(names), prefetch_shards=2)
        try:
            got = take_written(loader, 1)  # shard 0 is read; shards 1 and 2 are fetched ahead
            for _ in range(1000):
                if len(refused) == LIMITS.max_attempts:
                    break
                time.sleep(0.01)
            # the fetch of shard 2 gave up, long before it is read
            assert len(refused) == LIMITS.max_attempts
            outage.clear()
            got += take_written(loader, 39)  # shard 2 is read from about batch 24 on
        finally:
            loader.close()
    finally:
        server.close()
    assert got == expected


def test_a_shard_missing_on_the_server_is_an_error_naming_it(tmp_path):
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 3, equal_docs(48, 20), row_group_size=2)
    expected = on_disk(hosted, 36)
    server = ShardServer(str(hosted))
    try:
        loader = streaming(tmp_path / "cache", server.url, len(names))  # reads every footer
        os.remove(hosted / names[1])  # gone from the server since: a 404
        try:
            got, error = batches_until_error(loader, 36)
        finally:
            loader.close()
    finally:
        server.close()
    assert got == expected[:len(got)] and len(got) >= 10
    assert isinstance(error, ConnectionError)
    assert str(error).startswith(
        f"could not fetch shard {names[1]} from {server.url}/{names[1]}: "), error
    assert "404" in str(error)


def test_a_server_down_at_the_start_is_an_error_at_the_call(tmp_path):
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 3, equal_docs(48, 20), row_group_size=2)
    server = ShardServer(str(hosted))
    server.close()
    error = outcome(lambda: streaming(tmp_path / "cache", server.url, len(names)))
    assert isinstance(error, ConnectionError), error
    # (its first request: the listing of the shards)
    assert str(error).startswith(f"could not read the shard listing {server.url}/index.json: ")


def test_a_full_disk_is_an_enospc_error_naming_the_directory(tmp_path, monkeypatch):
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    names = host_shards(hosted, 3, equal_docs(48, 20), row_group_size=2)
    expected = on_disk(hosted, 36)
    server = ShardServer(str(hosted))
    loader = streaming(cache, server.url, len(names))
    try:
        got = take_written(loader, 1)
        # the disk fills up while shard 0 is read: 1 KB left (a shard is ~7 KB)
        monkeypatch.setattr(eviction.shutil, "disk_usage",
                            lambda path: SimpleNamespace(free=1000))
        more, error = batches_until_error(loader, 36)
    finally:
        loader.close()
        server.close()
    assert got + more == expected[:len(got + more)] and len(more) >= 9
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert str(error).startswith(f"[Errno {errno.ENOSPC}] {cache}: fetching {names[1]} needs "
                                 ), error
    assert "bytes but 1000 are free (the disk is full); free some space" in str(error)
    assert not os.path.exists(cache / names[1]) and server.fetched() == names[:1]


def test_a_budget_below_what_must_be_held_is_refused_at_the_call(tmp_path):
    hosted = tmp_path / "hosted"
    names = host_shards(hosted, 3, mixed_docs, row_group_size=2)
    server = ShardServer(str(hosted))
    try:
        # the shard read, the one still being packed, prefetch_shards=2 ahead and one for a rank out
        # of step (but a split of 3 shards has no more: 3), and the val shard at its size
        least = least_limit(hosted, names)
        small = least - 1
        with pytest.raises(ValueError) as raised:
            streaming(tmp_path / "cache", server.url, len(names), prefetch_shards=2,
                      cache_limit=small)
        assert server.fetched() == []  # refused before any download
        streaming(tmp_path / "cache", server.url, len(names), prefetch_shards=2,
                  cache_limit=least).close()
    finally:
        server.close()
    lines = str(raised.value).split("\n")
    assert lines[0] == (f"cache_limit={small:,} bytes is below what this streaming loader must "
                        f"hold at once, {least:,} bytes ({size_up(least)}):"), lines
    # the terms: the 3 shards whole (a split of 3 has no more), the val shard, the copies
    assert lines[1] == ("  shards read, packed from and fetched ahead: the 3 largest whole: the "
                        "one read, the one packed from, prefetch_shards=2 ahead and one for a "
                        "local rank out of step (at most the split's 3): "
                        f"{sum(shards_in(hosted)[name] for name in names):,} bytes")
    assert lines[2].startswith("  the val shard: not on disk yet, never evicted: ")
    room = copies(hosted, names)
    assert lines[3].endswith(f"for each of 1 local rank(s): {room:,} bytes")
    # their sum is more than all the data, at which nothing is evicted: the least
    assert lines[4] == (f"  these add up to {least + room:,} bytes, more than all the shards it "
                        f"may hold and the copies kept, {least:,} bytes: at that limit no shard "
                        "is ever evicted, so that is the least")
    # (a new, empty cache: no other data_dir would need less); the number to pass last
    assert lines[5:] == ["To need less: lower prefetch_shards, prefetch, tokenizer_batch_size or "
                         "buffer_size.", f"pass cache_limit={least} or more"]


@pytest.mark.slow
def test_every_local_rank_checks_the_machines_least_and_a_merged_resume_at_it_runs(
        tmp_path, monkeypatch):
    """2 ranks' states merged for 3 ranks of one machine, each given the whole merge. Shards of 4
    row groups of 25 documents: rank 0 reads 50 of each, ranks 1 and 2 read 25, so their 36
    documents read ahead span one more shard. Every local rank's budget check counts what all of
    them read first (their plans' shards, from 8 old buffers of 40) and the most any of them packs
    from, so they accept the same least cache_limit; at it, 3 torchrun ranks resume into an empty
    cache exactly, without waiting for room."""
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    names = host_shards(hosted, 12, lingering_docs, row_group_size=25)
    out.mkdir()
    settings = dict(buffer_size=40, tokenizer_batch_size=12, prefetch_shards=0)
    states = [on_disk(hosted, 150, rank, 2, **settings)[-1]["state"] for rank in range(2)]
    merged = merge_states(states, 3, data_dir=str(hosted))
    with open(tmp_path / "merged.json", "w") as f:
        json.dump(merged, f)
    server = ShardServer(str(hosted))
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        leasts = []
        for rank in range(3):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            leasts.append(least_accepted(lambda limit: streaming(
                tmp_path / "probe", server.url, len(names), cache_limit=limit, rank=rank,
                world_size=3, resume_state_dict=merged, **settings)))
        assert leasts[0] == leasts[1] == leasts[2], leasts
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=3",
               os.path.join(TESTS, "stream_worker.py"), str(out), "30",
               str(tmp_path / "merged.json")]
        env = dict(stream_env(tmp_path / "base", server.url, len(names), leasts[0]),
                   STREAM_WORKER_LOADER=json.dumps(settings))
        # (a stall would wait 600 s for room: the timeout ends it)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        server.close()
    for rank in range(3):
        expected = on_disk(hosted, 30, rank, 3, merged, **settings)
        assert read_lines(out / f"rank{rank}.jsonl") == expected


# -----------------------------------------------------------------------------
# The least cache_limit, while another loader of the machine downloads or after one was
# interrupted: a partial download is not a shard the cache may never evict (it becomes a fetched
# shard, or the next loader resumes it)


def stall_after_one_block(cache, server, names) -> None:
    """The footers are read into cache's catalog at full speed; then the server sends one more
    64 KB block and nothing after it (the next waits 18 hours), so the first shard a loader fetches
    stays half downloaded."""
    # (a train loader reads the val shard's footer too: its budget)
    names = names + [get_dataset().val_filename]
    read_catalog(str(cache), names, [f"{server.url}/{name}" for name in names], LIMITS)
    server.throttle.rate = 1.0


def wait_for_partial(path) -> None:
    for _ in range(1000):  # 10 s
        if os.path.exists(path) and os.path.getsize(path) == BLOCK:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} did not appear")


@pytest.mark.slow
def test_a_local_rank_starting_while_another_downloads_is_accepted(tmp_path):
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    names = host_shards(hosted, 3, mixed_docs, row_group_size=2)
    expected = on_disk(hosted, 6, rank=1, world_size=2)
    limit = least_limit(hosted, names)
    server = ShardServer(str(hosted))
    stall_after_one_block(cache, server, names)
    rank0 = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit,
                      rank=0, world_size=2)
    try:
        wait_for_partial(cache / f"{names[0]}.tmp")
        rank1 = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit,
                          rank=1, world_size=2)
        server.throttle.rate = None
        got = take_written(rank1, 6)  # once rank 0's attempt has timed out and resumed its download
        rank1.close()
    finally:
        rank0.close()
        server.close()
    assert got == expected


@pytest.mark.slow
def test_a_run_interrupted_mid_download_restarts_with_its_cache_limit(tmp_path):
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    names = host_shards(hosted, 3, mixed_docs, row_group_size=2)
    expected = on_disk(hosted, 6)
    limit = least_limit(hosted, names)
    server = ShardServer(str(hosted))
    stall_after_one_block(cache, server, names)
    try:
        interrupted = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit)
        wait_for_partial(cache / f"{names[0]}.tmp")
        interrupted.close()  # what it leaves: its download of shard 0, half done
        server.throttle.rate = None
        again = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit)
        got = take_written(again, 6)
        again.close()
    finally:
        server.close()
    assert got == expected


def test_a_local_rank_starting_as_another_download_completes_is_accepted(tmp_path, monkeypatch):
    # a shard just renamed into place, before the loader that fetched it has checked it against the
    # catalog, is not one the user put there (which the cache may never evict): the moment is held
    # open by pausing that check
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    names = host_shards(hosted, 3, mixed_docs, row_group_size=2)
    expected = on_disk(hosted, 6, rank=1, world_size=2)
    limit = least_limit(hosted, names)
    paused, resume = threading.Event(), threading.Event()
    check = fetcher.read_catalog

    # a fetching thread's catalog check of the shard it just downloaded waits
    def held_check(*args, **kwargs):
        if threading.current_thread().name == "nanochat-shards":
            paused.set()
            resume.wait(10)
        return check(*args, **kwargs)

    monkeypatch.setattr(fetcher, "read_catalog", held_check)
    server = ShardServer(str(hosted))
    rank0 = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit,
                      rank=0, world_size=2)
    try:
        assert paused.wait(10)
        # downloaded, its check not done
        assert shards_in(cache) == {names[0]: shards_in(hosted)[names[0]]}
        try:
            rank1 = streaming(cache, server.url, len(names), prefetch_shards=2, cache_limit=limit,
                              rank=1, world_size=2)
        finally:
            resume.set()
        got = take_written(rank1, 6)
        rank1.close()
    finally:
        resume.set()
        rank0.close()
        server.close()
    assert got == expected
