"""
Shards served on 127.0.0.1 for the streaming tests, and the loaders that read them: streamed into a
cache, and on disk, the oracle. The module-scoped fixtures `hosted_once` (7 train shards and the val
shard, their server), `expected` (the on-disk loader's first 260 batches) and `streamed` (a cache a
loader left within a tight cache_limit) are shared by the files that import them.
Not a test file: tests/data/streaming/test_*.py import it.
"""

import gzip
import json
import logging
import os
import shutil
import time
from collections import Counter

import pytest
import torch

from conftest import FAST, ByteTokenizer, hosting
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.dataloader import (tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import index_to_filename

VAL = index_to_filename(6542)  # the default dataset's (ClimbMix's) val shard
LOADERS = {"bestfit": tokenizing_distributed_data_loader_with_state_bos_bestfit,
           "concat": tokenizing_distributed_data_loader_with_state}


# tokenizer batches of 8: what a loader reads ahead stays within a shard of these small ones (300
# documents), so the least cache_limit is a few shards (budget.packing_shards)
def stream_loader(kind, server, cache, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, num_shards=7,
                  base_url=server.url, download_limits=FAST, tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=str(cache), **kwargs)


def disk_loader(kind, hosted_dir, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=hosted_dir, **kwargs)


def split_dir(hosted_dir, directory, num_train: int) -> str:
    """A directory with the first num_train hosted train shards and the val shard: the on-disk
    oracle's."""
    os.makedirs(directory)
    for name in [index_to_filename(i) for i in range(num_train)] + [VAL]:
        shutil.copy(os.path.join(hosted_dir, name), directory)
    return str(directory)


def kept_texts(cache, name: str) -> dict[tuple[int, int], str]:
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


def streaming(cache, server, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, num_shards=7,
                  base_url=server.url, download_limits=FAST, tokenizer_batch_size=8,
                  buffer_size=20) | kwargs
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(cache), **kwargs)


def on_disk(hosted_once, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8,
                  buffer_size=20) | kwargs
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(hosted_once), **kwargs)


def batches(loader, n: int) -> list:
    """The next n batches (inputs, targets, state), copied; the loader is closed after."""
    out = []
    try:
        for inputs, targets, state in loader:
            out.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
            if len(out) == n:
                break
    finally:
        loader.close()
    return out


def same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, ((a, b, s), (x, y, t)) in enumerate(zip(got, expected)):
        assert torch.equal(a, x) and torch.equal(b, y) and s == t, f"batch {i}"


def footers(server) -> Counter:
    """How many footer requests (a Range of the file's end) the server answered, per shard."""
    return Counter(name for name, wanted in server.gets if wanted and wanted.startswith("bytes=-"))


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.fixture(scope="module")
def hosted_once(tmp_path_factory):
    """The hosted shards and their server, shared by the tests of a file (none changes them)."""
    with hosting(tmp_path_factory.mktemp("hosted")) as shards:
        yield shards


@pytest.fixture(scope="module")
def expected(hosted_once):
    """The on-disk loader's first 260 batches: the oracle."""
    return batches(on_disk(hosted_once[0]), 260)


@pytest.fixture(scope="module")
def streamed(hosted_once, expected, tmp_path_factory):
    """A cache left by a streaming loader that took 200 batches within a tight cache_limit (so it
    evicted shards and kept copies of buffered documents), and its last state."""
    _, server, sizes = hosted_once
    cache = tmp_path_factory.mktemp("streamed") / "cache"
    # about the least it accepts: (packing 2 + prefetch_shards=1 + 1) x the largest, val, copies
    limit = int(5.2 * sizes[-1])
    first = batches(streaming(cache, server, cache_limit=limit, prefetch_shards=1), 200)
    same(first, expected[:200])
    return cache, first[-1][2], limit


def batches_of(loader, n: int) -> list:
    """The next n batches, copied, the loader left open."""
    out = []
    for inputs, targets, state in loader:
        out.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
        if len(out) == n:
            break
    return out


def all_train_shards_fetched(cache, server) -> list[str]:
    """The 7 train shards' names, once a streaming loader (closed since) has fetched them all."""
    names = [index_to_filename(i) for i in range(7)]
    loader = streaming(cache, server, prefetch_shards=6, workers=0)
    batches_of(loader, 1)
    for _ in range(1000):
        if all((cache / name).exists() for name in names):
            break
        time.sleep(0.01)
    loader.close()
    return names
