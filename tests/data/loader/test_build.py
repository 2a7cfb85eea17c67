"""
Tests for the builder (nanochat/data/loader/build.py): a LoaderSpec filled by hand, as the public
loader fills one, built by make_loader (workers=0) and by build_loader, yields exactly the batches
and states of tokenizing_distributed_data_loader_with_state_bos_bestfit on the same tiny shards;
DeviceBatches on cpu writes a batch's rows, with masked targets, into the tensors it yields; and
row_split's and flat_split's shapes. Run:
    python -m pytest tests/data/loader/test_build.py -q
"""

import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, assert_same_batches, sample_texts, take_batches, write_shards
from nanochat.data.base.datasets import split_parquet_files
from nanochat.data.base.state import loader_config, tokenizer_fingerprint
from nanochat.data.loader.build import (IGNORE_INDEX, DataLoader, DeviceBatches, LoaderSpec, Run,
                                        build_loader, flat_split, make_loader, one_walk, row_split,
                                        run_ahead)
from nanochat.data.loader.order import ParquetReader
from nanochat.data.loader.prefetch import Prefetcher
from nanochat.data.loader.rows import Encoder
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit

B, T, BUFFER, BATCH = 2, 16, 8, 4


@pytest.fixture
def data_dir(tmp_path):
    """3 tiny shards (2 train, 1 val) of 12 documents, row groups of 4."""
    write_shards(tmp_path, [sample_texts(seed, 12) for seed in range(3)], 4)
    return str(tmp_path)


def spec_of(data_dir: str, prefetch: int) -> LoaderSpec:
    """The spec the public best-fit loader fills for the train split, rank 0 of 1."""
    tokenizer = ByteTokenizer()
    reader = ParquetReader(split_parquet_files("train", data_dir))
    config = loader_config("bestfit", "parquet", "train", reader.paths, B=B, T=T,
                           buffer_size=BUFFER, batch_size=BATCH,
                           tokenizer=tokenizer_fingerprint(tokenizer), rank=0, world_size=1,
                           policy=("crop", 0))
    return LoaderSpec(kind="bestfit", reader=reader, encoder=Encoder(tokenizer, 1), config=config,
                      rank=0, world_size=1, batch_size=BATCH, B=B, T=T, buffer_size=BUFFER,
                      prefetch=prefetch)


def public(data_dir: str, prefetch: int) -> DataLoader:
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B, T, "train", tokenizer_threads=1, tokenizer_batch_size=BATCH,
        device="cpu", buffer_size=BUFFER, data_dir=data_dir, rank=0, world_size=1,
        prefetch=prefetch, workers=0)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_make_loader_with_workers_0_yields_the_public_loaders_batches(data_dir, prefetch):
    run = Run(B, T, "train", "cpu", prefetch, True, 0)
    loader = make_loader(DataLoader, run, lambda: one_walk(spec_of(data_dir, prefetch), None))
    assert isinstance(loader, DataLoader) and loader.worker_pid is None
    got = take_batches(loader, 12)
    assert_same_batches(got, take_batches(public(data_dir, prefetch), 12))
    assert got[0][0][:, 0].tolist() == [256, 256]  # every row starts with BOS


def test_build_loader_resumed_from_a_state_continues_the_fresh_loaders_batches(data_dir):
    first = take_batches(build_loader(spec_of(data_dir, 0), None, "cpu"), 4)
    state = first[1][2]
    resumed = take_batches(build_loader(spec_of(data_dir, 0), state, "cpu"), 2)
    assert_same_batches(resumed, first[2:4])


def test_device_batches_on_cpu_write_the_rows_and_mask_targets():
    transfer = DeviceBatches(2, 3, "cpu")
    inputs = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint16)
    targets = np.array([[2, 3, 7], [5, 6, 8]], dtype=np.uint16)
    x, y = transfer(inputs, targets, [(1, 0, 2)])
    assert (x.dtype, y.dtype, x.device.type) == (torch.long, torch.long, "cpu")
    assert x.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert y.tolist() == [[2, 3, 7], [IGNORE_INDEX, IGNORE_INDEX, 8]]
    assert transfer.buffer.tolist() == [1, 2, 3, 4, 5, 6, 2, 3, 7, -100, -100, 8]
    host = np.arange(12, dtype=np.int64)
    x, y = transfer.from_host(host)
    assert (x.tolist(), y.tolist()) == ([[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]])
    host[0] = 99  # on cpu: views of the host memory, not copies
    assert x[0, 0].item() == 99


def test_row_split_and_flat_split_shapes():
    rows = np.arange(2 * 5).reshape(2, 5)  # B=2 rows of T + 1 = 5 tokens
    inputs, targets = row_split(rows)
    assert inputs.shape == targets.shape == (2, 4)
    assert (inputs.tolist(), targets.tolist()) == ([[0, 1, 2, 3], [5, 6, 7, 8]],
                                                   [[1, 2, 3, 4], [6, 7, 8, 9]])
    inputs, targets = flat_split(2, 3)(np.arange(7))  # B*T + 1 tokens
    assert (inputs.tolist(), targets.tolist()) == ([[0, 1, 2], [3, 4, 5]], [[1, 2, 3], [4, 5, 6]])


def test_run_ahead_with_depth_0_returns_the_source_itself():
    source = iter([1, 2, 3])
    assert run_ahead(source, 0, "unused") is source  # prefetch=0: no thread, all in the caller
    ahead = run_ahead(iter([1, 2, 3]), 2, "test-run-ahead")
    assert isinstance(ahead, Prefetcher) and list(ahead) == [1, 2, 3]
