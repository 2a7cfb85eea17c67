"""
The loader in a worker process (workers=1, the default outside the tests): every kind of loader
yields there the batches and states it yields on threads in this process, token for token; a state
it yields resumes exactly, and elastically once merged; every mistake that can be found before data
is read (arguments, data_dir, the resume state, a streamed source) fails at the call, in this
process, before a worker starts, and what those checks log is said once; a failure in the worker
reaches next() printed once, its message the last line; close() ends the process within its bound,
and so does the trainer's death; under torchrun each rank runs its own worker. The worker process is
real: `python -m nanochat.data.loader.worker`, started and killed here. Run: python -m pytest
tests/data/loader/test_worker.py -q   (about a minute: each worker takes ~1.5 s to start)
"""

import gc
import json
import functools
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from conftest import TESTS, ByteTokenizer, outcome, take, write_shards
from nanochat.dataloader import (pretokenized_distributed_data_loader_with_state_bos_bestfit,
                                 tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import index_to_filename
from nanochat.data.fetch.errors import HostNotFoundError
from nanochat.mixture import (CurriculumComplete,
                              pretokenized_mixture_loader_with_state_bos_bestfit)
from nanochat.data.loader.build import LoaderSpec, build_loader
from nanochat.data.loader.worker import CLOSE_TIMEOUT, WorkerTraceback, WorkerUnavailable
from nanochat.resume import merge_states
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.data.fetch.serve import ShardServer

BOS = ByteTokenizer.bos

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Parquet shards of random texts, and pretokenized shards (two buckets for mixtures)."""
    root = tmp_path_factory.mktemp("worker")
    rng = np.random.default_rng(0)
    texts = [[f"{s}.{i} " + "xyz " * int(rng.integers(0, 40)) for i in range(200)]
             for s in range(4)]
    write_shards(root / "parquet", texts, row_group_size=25)
    for name, mean in (("", 30), ("long", 90), ("short", 10)):
        for split in ("train", "val"):
            directory = root / "tokens" / split / name
            os.makedirs(directory, exist_ok=True)
            for s in range(2):
                lengths = np.maximum(1, rng.geometric(1 / mean, size=300))
                entries = [np.concatenate(([BOS], rng.integers(0, 256, k - 1))).astype(np.uint16)
                           for k in lengths]
                write_token_shard(str(directory / f"shard_{s:03d}"), entries, [0] * len(entries),
                                  np.uint16)
    return root


def parquet(function, **kwargs):
    def make(corpus, tokenizer=None, **more):
        return function(tokenizer or ByteTokenizer(), 4, 32, "train", device="cpu",
                        data_dir=str(corpus / "parquet"),
                        **{"tokenizer_batch_size": 8} | kwargs | more)
    return make


def pretokenized(corpus, **more):
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(
        4, 32, "train", device="cpu", data_dir=str(corpus / "tokens"), bos_token=BOS,
        buffer_size=16, chunk_size=64, batch_size=16, **more)


CURRICULUM = [{"tokens": 6_000, "mix": {"long": 0.5, "short": 0.5}},
              {"tokens": 3_000, "mix": {"long": 0.2, "short": 0.8}}]


def mixture(corpus, **more):
    return pretokenized_mixture_loader_with_state_bos_bestfit(
        4, 32, "train", CURRICULUM, device="cpu", data_dir=str(corpus / "tokens"),
        bos_token=BOS, buffer_size=16, chunk_size=64, batch_size=16, **more)


LOADERS = {
    "bestfit": parquet(tokenizing_distributed_data_loader_with_state_bos_bestfit, buffer_size=16),
    "bestfit, split, attention_info, traced": parquet(
        tokenizing_distributed_data_loader_with_state_bos_bestfit, buffer_size=16,
        long_doc_policy="split", split_overlap=4, attention_info=True, trace_documents=True),
    "bestfit, shuffled, rank 1 of 2": parquet(
        tokenizing_distributed_data_loader_with_state_bos_bestfit, buffer_size=16, shuffle=True,
        seed=3, rank=1, world_size=2),
    "concat": parquet(tokenizing_distributed_data_loader_with_state),
    "pretokenized": pretokenized,
    "mixture": mixture,
}


def take_traced(loader, n: int) -> list:
    """n batches, copied (a yielded batch's memory is reused), with the loader's trace."""
    out = []
    for _ in range(n):
        batch = next(loader)
        out.append([x.clone() if isinstance(x, torch.Tensor)
                    else {k: v.clone() for k, v in x.items()} if isinstance(x, dict) and
                    all(isinstance(v, torch.Tensor) for v in x.values())
                    else json.loads(json.dumps(x)) for x in batch] + [loader.documents])
    return out


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert len(a) == len(b), f"batch {i}"
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), f"batch {i}"
            elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            else:
                assert x == y, f"batch {i}"


def gone(pid: int) -> bool:
    """The process has ended (a zombie counts: it runs nothing, its parent has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


# -----------------------------------------------------------------------------
# The same batches and states, and exact resume


@pytest.mark.slow
@pytest.mark.parametrize("kind", LOADERS)
def test_a_worker_yields_what_threads_yield(kind, corpus):
    make = LOADERS[kind]
    threads = make(corpus, workers=0)
    worker = make(corpus, workers=1)
    assert threads.worker_pid is None and worker.worker_pid is not None
    n = 12
    assert_same(take_traced(worker, n), take_traced(threads, n))
    # a state the worker yielded resumes exactly, in a worker
    state = take_traced(worker, 1)[0][2]
    expected = take_traced(threads, 6)[1:]
    resumed = make(corpus, workers=1, resume_state_dict=state)
    assert_same(take_traced(resumed, 5), expected)
    for loader in (threads, worker, resumed):
        loader.close()
    assert wait_gone(worker.worker_pid, CLOSE_TIMEOUT + 1)


@pytest.mark.slow
def test_an_elastic_resume_in_a_worker_is_the_one_on_threads(corpus):
    # two ranks' states, taken in workers at one step, merged for one rank: the resumed loader
    # yields in a worker what it yields on threads
    parquet_dir = str(corpus / "parquet")
    make = parquet(tokenizing_distributed_data_loader_with_state_bos_bestfit, buffer_size=16)
    states = []
    for rank in (0, 1):
        loader = make(corpus, workers=1, rank=rank, world_size=2)
        states.append(take_traced(loader, 4)[-1][2])
        loader.close()
    merged = merge_states(states, 1, data_dir=parquet_dir)
    resumed = [make(corpus, workers=workers, rank=0, world_size=1, resume_state_dict=merged)
               for workers in (1, 0)]
    assert_same(take_traced(resumed[0], 8), take_traced(resumed[1], 8))
    for loader in resumed:
        loader.close()


@pytest.mark.slow
def test_a_mixture_stops_in_the_trainer_as_on_threads(corpus):
    outcomes = []
    for workers in (0, 1):
        loader = mixture(corpus, workers=workers)  # (9,000 tokens: 71 batches)
        with pytest.raises(CurriculumComplete) as stop:
            for _ in range(1000):
                next(loader)
        outcomes.append((stop.value.state, loader.stats["tokens_emitted"]))
        loader.close()
    assert outcomes[0] == outcomes[1]


@pytest.mark.slow
def test_without_state_and_the_environment_default(corpus, monkeypatch):
    monkeypatch.setenv("NANOCHAT_LOADER_WORKERS", "1")
    loader = tokenizing_distributed_data_loader_bos_bestfit(
        ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(corpus / "parquet"))
    assert loader.worker_pid is not None and len(next(loader)) == 2
    loader.close()
    monkeypatch.setenv("NANOCHAT_LOADER_WORKERS", "2")
    with pytest.raises(ValueError, match="NANOCHAT_LOADER_WORKERS must be 0 or 1, got '2'"):
        LOADERS["bestfit"](corpus)
    with pytest.raises(ValueError, match="workers must be an integer in \\[0, 1\\]"):
        LOADERS["bestfit"](corpus, workers=3)
    # prefetch=0 runs everything in the caller: no worker either
    assert LOADERS["bestfit"](corpus, workers=1, prefetch=0).worker_pid is None


@pytest.mark.slow
def test_streamed_in_a_worker(corpus, tmp_path):
    hosted = tmp_path / "hosted"  # the dataset's names: the last shard is val
    os.makedirs(hosted)
    names = sorted(os.listdir(corpus / "parquet"))
    for i, name in zip([0, 1, 2, 6542], names):
        os.link(corpus / "parquet" / name, hosted / index_to_filename(i))
    server = ShardServer(str(hosted))
    try:
        def make(workers):
            return tokenizing_distributed_data_loader_with_state_bos_bestfit(
                ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(tmp_path / "cache"),
                stream=True, num_shards=3, base_url=server.url, tokenizer_batch_size=8,
                buffer_size=16, workers=workers)
        on_disk = take_traced(tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(hosted),
            tokenizer_batch_size=8, buffer_size=16), 10)
        loader = make(1)
        assert loader.worker_pid is not None
        # the cache lives in the worker: cache_status() asks it, here from another thread while
        # next() runs, and both get their own answers
        statuses = []
        asking = threading.Thread(target=lambda: statuses.extend(
            loader.cache_status() for _ in range(20)))
        asking.start()
        assert_same(take_traced(loader, 10), on_disk)
        asking.join(30)
        assert len(statuses) == 20 and all(len(s.loaders) == 1 for s in statuses)
        assert loader.cache_status().fetched_bytes > 0
        loader.close()
    finally:
        server.close()


# -----------------------------------------------------------------------------
# Failures, and the worker's end


class FailingTokenizer(ByteTokenizer):
    """Fails on a text that holds "2.7 " (importable by the worker: it imports this module); its
    message is made from the text, so that the source line that raises it does not show it."""

    def encode(self, texts, prepend=None, num_threads=0):
        for text in texts:
            if text.startswith("2.7 "):
                raise ValueError("cannot encode document " + text.split()[0])
        return super().encode(texts, prepend=prepend, num_threads=num_threads)


class SlowTokenizer(ByteTokenizer):
    """Takes 5 s a call for each batch of documents after its first `fast` ones: the worker stays
    inside a call (longer than close()'s CLOSE_TIMEOUT of 3 s, and what the test does meanwhile).
    (The state's one-text probe is never slow.)"""

    def __init__(self, fast: int = 0):
        super().__init__()
        self.fast = fast

    def encode(self, texts, prepend=None, num_threads=0):
        if len(texts) > 1:
            if self.fast == 0:
                time.sleep(5)
            self.fast = max(0, self.fast - 1)
        return super().encode(texts, prepend=prepend, num_threads=num_threads)


@pytest.mark.slow
def test_status_while_next_waits_and_a_dropped_loader_waits_for_nothing(corpus, tmp_path):
    hosted = tmp_path / "hosted"
    os.makedirs(hosted)
    for i, name in zip([0, 1, 2, 6542], sorted(os.listdir(corpus / "parquet"))):
        os.link(corpus / "parquet" / name, hosted / index_to_filename(i))
    server = ShardServer(str(hosted))
    try:
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            SlowTokenizer(), 4, 32, "train", device="cpu", data_dir=str(tmp_path / "cache"),
            stream=True, num_shards=3, base_url=server.url, tokenizer_batch_size=64,
            buffer_size=16, workers=1)
        waiting = threading.Thread(target=lambda: outcome(lambda: take_traced(loader, 3), 60),
                                   daemon=True)
        waiting.start()  # next() waits for the worker, inside a 5-s call
        time.sleep(0.5)
        status = outcome(loader.cache_status, 5)  # answered by the worker's other thread
        assert not isinstance(status, Exception) and len(status.loaders) == 1, status
        loader.close()
    finally:
        server.close()
    # a loader dropped without close() while its worker is inside a long call
    loader = LOADERS["bestfit"](corpus, workers=1, tokenizer=SlowTokenizer(fast=1),
                                tokenizer_batch_size=64)
    next(loader)  # from the first call's documents; the calls after it take 5 s
    time.sleep(0.5)
    pid = loader.worker_pid

    def drop():
        nonlocal loader
        loader = None
        gc.collect()

    assert outcome(drop, 60) is None  # (a hang guard only)
    # garbage collection asked the worker to stop and did not wait: the worker is still inside its
    # 5-s call (a drop that waited for it to end, or killed it after CLOSE_TIMEOUT, finds it gone)
    assert not gone(pid)
    assert wait_gone(pid, CLOSE_TIMEOUT + 1)


def printed(error: BaseException) -> str:
    """What Python prints for an exception nobody catches: its traceback, its causes first."""
    return "".join(traceback.format_exception(error))


@pytest.mark.slow
def test_a_failure_in_the_worker_is_printed_once_its_message_last(corpus):
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        FailingTokenizer(), 4, 32, "train", device="cpu", data_dir=str(corpus / "parquet"),
        tokenizer_batch_size=8, workers=1)
    pid = loader.worker_pid
    with pytest.raises(ValueError, match="cannot encode document 2.7") as raised:
        for _ in range(1000):
            next(loader)
    text = printed(raised.value)
    # the worker's traceback once, as the cause: where it was raised there, and which process
    cause = raised.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert f"pid {pid}" in str(cause) and "in encode" in str(cause)
    # the error's own text once, on the last line; no frame twice
    assert text.count("cannot encode document 2.7") == 1
    assert text.rstrip("\n").splitlines()[-1] == "ValueError: cannot encode document 2.7"
    frames = [line for line in text.splitlines() if line.lstrip().startswith('File "')]
    assert len(frames) == len(set(frames)) and len(frames) < 25
    with pytest.raises(ValueError, match="cannot encode document 2.7"):  # and it stays failed
        next(loader)
    assert wait_gone(pid, CLOSE_TIMEOUT + 1)


class NoWorker:
    """Stands in for WorkerBatches where a mistake must be found before any worker starts."""

    def __init__(self, job):
        raise AssertionError(f"a worker process was started for {job.build}")


def _state(make, **more) -> dict:
    """The state after 2 batches of a loader on threads."""
    loader = make(workers=0, **more)
    state = take_traced(loader, 2)[-1][2]
    loader.close()
    return state


def mistakes(corpus, tmp_path) -> dict:
    """A loader call with a mistake it can find before reading data -> (exception, message)."""
    parquet_dir = str(corpus / "parquet")

    def bestfit(data_dir=parquet_dir, B=4, **more):
        return tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), B, 32, "train", device="cpu", data_dir=str(data_dir),
            tokenizer_batch_size=8, **{"buffer_size": 16} | more)

    def concat(data_dir):
        return tokenizing_distributed_data_loader_with_state(
            ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(data_dir))

    shard = os.path.join(parquet_dir, sorted(os.listdir(parquet_dir))[0])
    (tmp_path / "empty").mkdir()
    write_shards(tmp_path / "val_only", [["one document"]], 1)
    tokens = str(corpus / "tokens")
    return {
        "data_dir is a file": (lambda: bestfit(shard), ValueError, "is a file, not a directory"),
        "an empty data_dir": (lambda: concat(tmp_path / "empty"),
                              FileNotFoundError, "no parquet shards in"),
        "no such data_dir": (lambda: bestfit(tmp_path / "nowhere"),
                             FileNotFoundError, "does not exist"),
        "a split with no files": (lambda: bestfit(tmp_path / "val_only"),
                                  FileNotFoundError, "the train split is empty"),
        "another kind of data": (
            lambda: pretokenized_distributed_data_loader_with_state_bos_bestfit(
                4, 32, "train", device="cpu", data_dir=parquet_dir, bos_token=BOS),
            ValueError, "holds parquet shards, not a pretokenize output"),
        "a bad argument": (lambda: bestfit(buffer_size=0),
                           ValueError, "buffer_size must be an integer >= 1"),
        "a state taken with another B": (
            lambda: bestfit(B=2, resume_state_dict=_state(bestfit)),
            ValueError, "taken on another configuration (B: state 4, loader 2)"),
        "a model's state dict": (
            lambda: pretokenized(corpus, resume_state_dict={"weight": torch.zeros(2)}),
            ValueError, "is not a loader state"),
        "a mixture's state with another B": (
            lambda: pretokenized_mixture_loader_with_state_bos_bestfit(
                2, 32, "train", CURRICULUM, device="cpu", data_dir=tokens, bos_token=BOS,
                buffer_size=16, chunk_size=64, batch_size=16,
                resume_state_dict=_state(lambda **kw: mixture(corpus, **kw))),
            ValueError, "taken on another configuration"),
        "a curriculum of a bucket that is not there": (
            lambda: pretokenized_mixture_loader_with_state_bos_bestfit(
                4, 32, "train", [{"tokens": 100, "mix": {"gone": 1.0}}], device="cpu",
                data_dir=tokens, bos_token=BOS),
            ValueError, "curriculum phase 1: unknown bucket 'gone'"),
        "a streamed host that does not resolve": (  # (.invalid never resolves: RFC 2606)
            lambda: bestfit(tmp_path / "cache", stream=True,
                            base_url="http://nanochat-shards.invalid/x"),
            HostNotFoundError, "cannot resolve the host 'nanochat-shards.invalid'"),
    }


@pytest.mark.parametrize("case", [
    "data_dir is a file", "an empty data_dir", "no such data_dir", "a split with no files",
    "another kind of data", "a bad argument", "a state taken with another B",
    "a model's state dict", "a mixture's state with another B",
    "a curriculum of a bucket that is not there", "a streamed host that does not resolve"])
def test_a_mistake_found_before_reading_fails_at_the_call_in_this_process(
        case, corpus, tmp_path, monkeypatch):
    call, kind, message = mistakes(corpus, tmp_path)[case]
    monkeypatch.setenv("NANOCHAT_LOADER_WORKERS", "1")  # the default outside the tests
    monkeypatch.setattr("nanochat.data.loader.build.WorkerBatches", NoWorker)
    with pytest.raises(kind, match=re.escape(message)) as raised:
        call()
    # one traceback, from this call, ending with the error: no worker's, no message twice
    text = printed(raised.value)
    assert "WorkerTraceback" not in text and "worker process" not in text
    assert text.endswith("".join(traceback.format_exception_only(raised.value)))
    assert text.count(str(raised.value)) == 1


def test_a_cache_limit_below_the_least_fails_at_the_call(corpus, tmp_path, monkeypatch):
    server = ShardServer(str(corpus / "parquet"))
    monkeypatch.setattr("nanochat.data.loader.build.WorkerBatches", NoWorker)
    try:
        with pytest.raises(ValueError, match="cache_limit=1,000 bytes is below what") as raised:
            tokenizing_distributed_data_loader_with_state_bos_bestfit(
                ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(tmp_path / "cache"),
                stream=True, base_url=server.url, cache_limit=1000, workers=1)
    finally:
        server.close()
    assert printed(raised.value).count("cache_limit=1,000 bytes") == 1


@pytest.mark.slow
def test_what_the_checks_at_the_call_log_is_said_once(corpus, caplog, capfd):
    # rank 0 of 2's state, given to a run of one rank: resumed approximately, with a warning
    make = parquet(tokenizing_distributed_data_loader_with_state_bos_bestfit, buffer_size=16)
    state = _state(lambda **kw: make(corpus, **kw), rank=0, world_size=2)
    capfd.readouterr()
    caplog.clear()
    loader = make(corpus, workers=1, rank=0, world_size=1, resume_state_dict=state)
    next(loader)  # (the worker has built the loader, and logged what it logs, before its first)
    loader.close()
    warning = "resume_state_dict is another rank's state (world_size: state 2, loader 1)"
    assert sum(warning in r.getMessage() for r in caplog.records) == 1  # here, at the call
    assert warning not in capfd.readouterr().err  # the worker, which checks it again, is quiet


@pytest.mark.parametrize("kind", ["bestfit", "mixture"])
def test_the_worker_builds_from_the_pickled_spec_not_the_public_function(kind, corpus,
                                                                         monkeypatch):
    jobs = []

    class Recorded:  # stands in for WorkerBatches: keeps the job, and the loader runs here
        def __init__(self, job):
            jobs.append(job)
            raise WorkerUnavailable("recorded")

    monkeypatch.setattr("nanochat.data.loader.build.WorkerBatches", Recorded)
    here = LOADERS[kind](corpus, workers=1)
    expected = take(here, 3)
    here.close()
    (job,) = jobs
    # the builder of ours and the spec it builds from, on the worker's CPU
    assert isinstance(job.build, functools.partial) and job.build.args[-1] == "cpu"
    if kind == "bestfit":
        assert job.build.func is build_loader and isinstance(job.build.args[0], LoaderSpec)
    else:  # (the mixture's own builder, from its buckets' specs)
        assert job.build.func.__module__ == "nanochat.mixture"
        assert all(isinstance(spec, LoaderSpec) for spec, _ in job.build.args[0].walks.values())
    # what the worker does with it: unpickled and built, with no public loader function to call
    for name in ("tokenizing_distributed_data_loader_with_state_bos_bestfit",
                 "pretokenized_mixture_loader_with_state_bos_bestfit"):
        module = "nanochat.mixture" if "mixture" in name else "nanochat.dataloader"
        monkeypatch.setattr(f"{module}.{name}", NoWorker)
    loader = pickle.loads(pickle.dumps(job)).build()
    got = [batch for batch, _ in zip(loader.row_batches(), range(3))]
    loader.close()
    assert [b.state for b in got] == [e[2] for e in expected]


def test_a_tokenizer_that_cannot_be_pickled_runs_here_with_a_warning(corpus, caplog):
    class Local(ByteTokenizer):  # (a class inside a function: pickle cannot name it)
        pass

    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        Local(), 4, 32, "train", device="cpu", data_dir=str(corpus / "parquet"), workers=1)
    assert loader.worker_pid is None
    assert "not in a worker process" in caplog.text and "workers=0" in caplog.text
    in_threads = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), 4, 32, "train", device="cpu", data_dir=str(corpus / "parquet"))
    assert_same(take_traced(loader, 3), take_traced(in_threads, 3))
    loader.close()


@pytest.mark.slow
def test_close_is_bounded_from_another_thread_while_next_waits(corpus):
    loader = LOADERS["bestfit"](corpus, workers=1)
    next(loader)
    pid = loader.worker_pid
    closer = threading.Timer(0.2, loader.close)
    closer.start()
    result = outcome(lambda: [next(loader) for _ in range(10**6)], CLOSE_TIMEOUT + 5)
    assert isinstance(result, StopIteration)
    assert wait_gone(pid, CLOSE_TIMEOUT + 1)
    with pytest.raises(StopIteration):
        next(loader)
    with pytest.raises(RuntimeError, match="the loader is closed"):
        loader._batches.status()  # (what cache_status() asks of a streaming loader's worker)


TRAINER = """
import os, sys, time
sys.path.insert(0, {tests!r})
from conftest import ByteTokenizer
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
    ByteTokenizer(), 4, 32, "train", device="cpu", data_dir={data!r}, workers=1)
next(loader)
print(loader.worker_pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_worker(corpus):
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER.format(tests=TESTS, data=str(corpus / "parquet"))],
        stdout=subprocess.PIPE, text=True)
    try:
        pid = int(outcome(trainer.stdout.readline, 60))
        assert not gone(pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        assert wait_gone(pid, CLOSE_TIMEOUT + 2), "the worker outlived its trainer"
    finally:
        trainer.kill()


@pytest.mark.slow
def test_under_torchrun_each_rank_runs_its_own_worker(tmp_path):
    from dist_worker import emitted  # (the loaders and shards of test_distributed)
    from test_distributed import run_torchrun
    files = [[f"{s}-{i} " + "ab" * (i % 17) for i in range(40)] for s in range(3)]
    write_shards(tmp_path / "data", files, row_group_size=5)
    os.environ["NANOCHAT_LOADER_WORKERS"] = "1"
    try:
        workers = run_torchrun(2, tmp_path / "data", tmp_path / "workers.json", num_batches=20)
    finally:
        os.environ["NANOCHAT_LOADER_WORKERS"] = "0"
    # each rank's batches on threads, made here
    threads = [json.loads(json.dumps(emitted(str(tmp_path / "data"), 20, rank=rank, world_size=2)))
               for rank in range(2)]
    assert [r["workers"] for r in threads] == [[False, False]] * 2
    assert [r["workers"] for r in workers] == [[True, True]] * 2
    for r in threads + workers:
        del r["workers"]
    assert workers == threads
