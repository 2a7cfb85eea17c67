"""
Tests for tokenizing on processes (nanochat/data/loader/tokenize_procs.py) and the rule that sizes
them (nanochat/data/base/checks.py's resolve_tokenizer_processes, and resolve_tokenizer_threads
for a loader that tokenizes on threads): batches and states are the same,
token for token, at every count of processes and with the tokenizer's threads, for a tokenizer that
returns arrays (ours) and one that returns lists (as nanochat's); a resume taken at one count goes
on exactly at another; a tokenizing process that dies ends the loader with an error that says so,
never a hang. Run:
    python -m pytest tests/data/loader/test_tokenize_procs.py -q
"""

import os
import signal
import time

import pytest

from conftest import (ByteArrayTokenizer, ByteTokenizer, assert_same_batches, outcome,
                      take_batches)
from nanochat.data.base.checks import (MAX_TOKENIZER_THREADS, MIN_TOKENIZER_PROCESSES,
                                      resolve_tokenizer_processes, resolve_tokenizer_threads)
from nanochat.data.loader.order import DocBatch
from nanochat.data.loader.rows import Encoder, token_batches
from nanochat.data.loader.tokenize_procs import IN_FLIGHT, encoded_on_processes
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.tokenizer import RustBPETokenizer
from scripts.list_tokenizer import ListTokenizer

TEXTS = dict(lengths=range(5, 300))
TOKENIZER_TEXTS = [f"the {i} quick brown foxes jump over {i * 7} lazy dogs" for i in range(300)]


def _batches(n: int, size: int = 5) -> list[DocBatch]:
    texts = [f"document {i}: " + "words and more words " * (i % 17) for i in range(n * size)]
    return [DocBatch(texts[i:i + size], list(range(i, i + size)), i) for i in range(0, len(texts),
                                                                                   size)]


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), ByteArrayTokenizer()],
                         ids=["lists", "arrays"])
def test_processes_give_the_threads_documents_in_order(tokenizer):
    batches = _batches(3 * IN_FLIGHT * 2 + 1)  # more than are ever out at once
    encoder = Encoder(tokenizer, 2)
    expected = list(token_batches(iter(batches), encoder))
    got = list(encoded_on_processes(iter(batches), encoder, 2))
    assert len(got) == len(expected) == len(batches)
    for one, other in zip(got, expected):
        assert [d.tolist() for d in one.docs] == [d.tolist() for d in other.docs]
        assert [d.dtype for d in one.docs] == [d.dtype for d in other.docs]
        assert (one.overlaps, one.keys, one.after, one.starts) == (
            other.overlaps, other.keys, other.after, other.starts)


class FailsOnSeven(ByteTokenizer):
    """A tokenizer whose encode fails on a text that holds a 7 (bad data, in one process)."""

    def encode(self, texts, prepend=None, num_threads=1):
        if any("7" in text for text in texts):
            raise ValueError("cannot encode a 7")
        return super().encode(texts, prepend, num_threads)


def test_an_error_in_a_process_reaches_the_loader_as_it_was_raised():
    batches = _batches(4)  # the second holds "document 7"
    got = encoded_on_processes(iter(batches), Encoder(FailsOnSeven(), 1), 2)
    with pytest.raises(ValueError, match="cannot encode a 7"):
        list(got)


# -----------------------------------------------------------------------------
# The same batches at every count, through the public loader and its worker


def _loader(tokenizer, parquet_dir, **kwargs):
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, 2, 64, "train", device="cpu", buffer_size=16, tokenizer_batch_size=6,
        data_dir=parquet_dir, rank=0, world_size=1, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ours", "lists"])
def test_batches_and_states_are_the_same_at_every_count(kind, tokenizer_dir, parquet_dir):
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    tokenizer = tokenizer if kind == "ours" else ListTokenizer(tokenizer)
    expected = take_batches(_loader(tokenizer, parquet_dir, workers=0), 12)
    # (threads in the worker against threads here: tests/data/loader/test_worker.py)
    for processes in (1, 3):
        got = take_batches(_loader(tokenizer, parquet_dir, workers=1,
                                   tokenizer_processes=processes), 12)
        assert_same_batches(got, expected)


@pytest.mark.slow
def test_a_resume_taken_at_one_count_goes_on_exactly_at_another(tokenizer_dir, parquet_dir):
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    whole = take_batches(_loader(tokenizer, parquet_dir, workers=0), 10)
    first = take_batches(_loader(tokenizer, parquet_dir, workers=1, tokenizer_processes=3), 4)
    assert_same_batches(first, whole[:4])
    for processes in (2, 0):
        rest = take_batches(_loader(tokenizer, parquet_dir, workers=1,
                                    tokenizer_processes=processes,
                                    resume_state_dict=first[-1][2]), 6)
        assert_same_batches(rest, whole[4:])


def _tokenizing(pid: int) -> list[int]:
    """The tokenizing processes process pid started: its children that run tokenize_procs."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except OSError:  # (gone since it was listed)
                continue
            if parent == pid and b"nanochat.data.loader.tokenize_procs" in command:
                found.append(int(entry))
    return found


@pytest.mark.slow
def test_a_tokenizing_process_killed_ends_the_loader_with_an_error(tokenizer_dir, parquet_dir):
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    loader = _loader(tokenizer, parquet_dir, workers=1, tokenizer_processes=2)
    try:
        next(loader)
        worker = loader.worker_pid
        deadline = time.monotonic() + 30
        while len(_tokenizing(worker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tokenizing = _tokenizing(worker)
        assert len(tokenizing) == 2, f"the worker started {len(tokenizing)} tokenizing processes"
        os.kill(tokenizing[0], signal.SIGKILL)

        def drain():
            for _ in range(3000):  # the epoch repeats: the error comes long before this ends
                next(loader)
            return "3000 more batches, and no error"

        ended = outcome(drain, 60.0)
        assert isinstance(ended, Exception) and "a tokenizing process of the loader died" in str(
            ended), ended
    finally:
        loader.close()


# -----------------------------------------------------------------------------
# How many: the CPUs this rank may use, less one for the trainer


def a_machine(monkeypatch, cpus: int, local_ranks: str | None) -> None:
    """This rank may use `cpus` CPUs, on a machine of `local_ranks` ranks (None: not torchrun)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)


@pytest.mark.parametrize("cpus, local_ranks, expected", [
    (16, None, 15), (16, "1", 15), (128, "8", 15), (64, "4", 15), (16, "8", 0), (3, None, 2),
    (2, None, 0), (1, None, 0), (24, "2", 11)])
def test_the_default_is_the_ranks_share_of_the_cpus_less_one(cpus, local_ranks, expected,
                                                             monkeypatch):
    a_machine(monkeypatch, cpus, local_ranks)
    assert resolve_tokenizer_processes(None, workers=1) == expected
    assert expected == 0 or expected >= MIN_TOKENIZER_PROCESSES
    assert resolve_tokenizer_processes(None, workers=0) == 0  # in the caller: threads only


def test_the_argument_overrides_the_default_and_is_checked(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert resolve_tokenizer_processes(3, workers=1) == 3
    assert resolve_tokenizer_processes(0, workers=1) == 0
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(ValueError, match="tokenizer_processes"):
            resolve_tokenizer_processes(bad, workers=1)
    with pytest.raises(ValueError, match="needs the loader's worker process: pass workers=1"):
        resolve_tokenizer_processes(2, workers=0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve_tokenizer_processes(None, workers=1)


@pytest.mark.parametrize("cpus, local_ranks, expected", [
    (1, None, 1), (2, None, 1), (3, None, 2), (4, None, 3), (5, None, 4), (128, None, 4),
    (16, "8", 1), (24, "8", 2)])
def test_threads_default_to_the_ranks_share_less_one_from_1_to_4(cpus, local_ranks, expected,
                                                                 monkeypatch):
    a_machine(monkeypatch, cpus, local_ranks)
    assert resolve_tokenizer_threads(None) == expected <= MAX_TOKENIZER_THREADS
    assert resolve_tokenizer_threads(7) == 7  # the argument first
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ValueError, match="tokenizer_threads"):
            resolve_tokenizer_threads(bad)


class ThreadsTokenizer(ByteTokenizer):
    """Says how many threads each call for a batch of documents was given (the state's one-text
    probe asks for 1)."""

    def __init__(self):
        self.asked = set()

    def encode(self, texts, prepend=None, num_threads=1):
        if len(texts) > 1:
            self.asked.add(num_threads)
        return super().encode(texts, prepend=prepend, num_threads=num_threads)


@pytest.mark.parametrize("cpus, argument, expected", [(2, None, 1), (5, None, 4), (2, 3, 3)])
def test_a_loader_on_threads_calls_the_tokenizer_with_the_sized_threads(cpus, argument, expected,
                                                                        parquet_dir,
                                                                        monkeypatch):
    a_machine(monkeypatch, cpus, None)
    tokenizer = ThreadsTokenizer()
    loader = _loader(tokenizer, parquet_dir, workers=0, tokenizer_threads=argument)
    take_batches(loader, 3)
    loader.close()
    assert tokenizer.asked == {expected}


def test_the_environment_sets_the_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("NANOCHAT_TOKENIZER_PROCESSES", "3")
    assert resolve_tokenizer_processes(None, workers=1) == 3
    assert resolve_tokenizer_processes(None, workers=0) == 0  # in the caller: threads
    assert resolve_tokenizer_processes(5, workers=1) == 5  # the argument first
    monkeypatch.setenv("NANOCHAT_TOKENIZER_PROCESSES", "many")
    with pytest.raises(ValueError, match="NANOCHAT_TOKENIZER_PROCESSES"):
        resolve_tokenizer_processes(None, workers=1)
