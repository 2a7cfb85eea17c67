"""
The loaders (nanochat/dataloader.py) against the reference oracle (tests/oracle.py), token for
token: random shards (uneven row groups, empty texts, documents longer than a row), batch shapes,
buffer and tokenizer batch sizes, ranks and world sizes, across epoch boundaries, with and without
the background threads, and resumed from a yielded state. Then bad input, background failures,
shutdown (close() while a tokenizer call runs, and the interpreter's exit during one), CUDA
transfer (skipped without a GPU), and tokenizers that return lists of ints (nanochat's) or other
arrays against our numpy path. Multi-process sharding lives in test_distributed.py.
Run: python -m pytest tests/test_dataloader.py -q
"""

import gc
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import oracle
from conftest import (REPO_ROOT, ByteTokenizer, outcome, slow_beyond, worker_env, write_shard,
                      write_shards)
from nanochat.dataloader import (tokenizing_distributed_data_loader,
                                 tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import split_parquet_files

BESTFIT = tokenizing_distributed_data_loader_with_state_bos_bestfit
CONCAT = tokenizing_distributed_data_loader_with_state


def random_corpus(rng: random.Random, data_dir, max_len):
    """2-4 shards of uneven sizes and row groups; texts from empty to longer than a row."""
    files = []
    for _ in range(rng.randint(2, 4)):
        n = rng.randint(1, 60)
        files.append(["".join(rng.choice("abcdefgh ")
                              for _ in range(rng.choice([0, rng.randint(0, max_len)])))
                      for _ in range(n)])
    for i, texts in enumerate(files):
        write_shard(data_dir / f"shard_{i:05d}.parquet", texts, row_group_size=rng.randint(1, 12))
    return files


def random_config(seed, tmp_path):
    """A random corpus in tmp_path and loader settings. A rank drawn without documents becomes
    rank 0, which has the first row group of every shard (the oracle loops forever on a rank
    without documents; test_rank_without_row_groups covers our error there)."""
    rng = random.Random(seed)
    T = rng.randint(4, 48)
    files = random_corpus(rng, tmp_path, max_len=3 * T)
    world_size = rng.randint(1, 3)
    cfg = dict(B=rng.randint(1, 4), T=T, tokenizer_batch_size=rng.randint(1, 10),
               rank=rng.randrange(world_size), world_size=world_size, data_dir=str(tmp_path))
    if not usable_rank(files, cfg):
        cfg["rank"] = 0
    assert usable_rank(files, cfg), cfg
    return rng, files, cfg


def as_lists(inputs, targets):
    return inputs.tolist(), targets.tolist()


NANOCHAT_KEYS = ("pq_idx", "rg_idx", "epoch")


def nanochat_keys(state):
    """nanochat's part of a state: what the oracle tracks."""
    return {k: state[k] for k in NANOCHAT_KEYS}


def assert_same_stream(loader, reference, n_batches):
    for k in range(n_batches):
        inputs, targets, state = next(loader)
        exp_inputs, exp_targets, exp_state = next(reference)
        assert inputs.dtype == torch.int64 and targets.dtype == torch.int64
        assert as_lists(inputs, targets) == (exp_inputs, exp_targets), f"batch {k} differs"
        assert nanochat_keys(state) == exp_state, f"state of batch {k} differs"


def past_two_epochs(files, cfg) -> int:
    """Enough batches to pass the end of the data at least twice (byte tokens, BOS each)."""
    total = sum(len(t.encode()) + 1 for f in files for t in f)
    return 2 * total // (cfg["B"] * (cfg["T"] + 1)) + 3


def check_exact_resume(rng, tok, cfg, kw, states, batches, loader=BESTFIT):
    """Resumed from 3 states taken mid-run: the same batches and the same states as without the
    stop."""
    n_batches = len(batches)
    for k in rng.sample(range(n_batches - 1), min(3, n_batches - 1)):
        resumed = loader(tok, cfg["B"], cfg["T"], "train", resume_state_dict=states[k], **kw)
        for j in range(k + 1, n_batches):
            inputs, targets, state = next(resumed)
            assert as_lists(inputs, targets) == batches[j], (
                f"resumed after batch {k}: batch {j} differs")
            assert state == states[j]
        resumed.close()


def usable_rank(files, cfg, split="train"):
    """Whether this rank of the split gets any document."""
    paths = split_parquet_files(split, cfg["data_dir"])
    return any(pq.ParquetFile(p).metadata.num_rows and any(
        pq.ParquetFile(p).metadata.row_group(rg).num_rows
        for rg in range(cfg["rank"], pq.ParquetFile(p).num_row_groups, cfg["world_size"]))
        for p in paths)


@pytest.mark.parametrize("seed", slow_beyond(range(40), 4))
def test_bestfit_matches_oracle(seed, tmp_path):
    rng, files, cfg = random_config(seed, tmp_path)
    buffer_size = rng.choice([1, 2, 5, 17, 40])
    prefetch = rng.choice([0, 1, 3])
    tok = ByteTokenizer()
    paths = split_parquet_files("train", cfg["data_dir"])
    loader = BESTFIT(tok, cfg["B"], cfg["T"], "train",
                     tokenizer_batch_size=cfg["tokenizer_batch_size"], device="cpu",
                     buffer_size=buffer_size, data_dir=cfg["data_dir"], rank=cfg["rank"],
                     world_size=cfg["world_size"], prefetch=prefetch)
    reference = oracle.bestfit_loader(tok, paths, cfg["B"], cfg["T"], cfg["tokenizer_batch_size"],
                                      buffer_size, cfg["rank"], cfg["world_size"])
    n_batches = past_two_epochs(files, cfg)
    states, batches = [], []
    for k in range(n_batches):
        inputs, targets, state = next(loader)
        exp_inputs, exp_targets, exp_state = next(reference)
        assert as_lists(inputs, targets) == (exp_inputs, exp_targets), f"batch {k} differs"
        assert nanochat_keys(state) == exp_state
        assert (inputs[:, 0] == tok.bos).all()  # every row starts with BOS
        states.append(state)
        batches.append(as_lists(inputs, targets))
    assert states[-1]["epoch"] >= 2, "the test should cross an epoch boundary"
    loader.close()
    kw = dict(tokenizer_batch_size=cfg["tokenizer_batch_size"], device="cpu",
              buffer_size=buffer_size, data_dir=cfg["data_dir"], rank=cfg["rank"],
              world_size=cfg["world_size"], prefetch=prefetch)

    check_exact_resume(rng, tok, cfg, kw, states, batches)

    # nanochat's form of the state resumes approximately, exactly as nanochat's resume does
    k = rng.randrange(n_batches)
    resumed = BESTFIT(tok, cfg["B"], cfg["T"], "train", resume_state_dict=nanochat_keys(states[k]),
                      **kw)
    reference = oracle.bestfit_loader(tok, paths, cfg["B"], cfg["T"], cfg["tokenizer_batch_size"],
                                      buffer_size, cfg["rank"], cfg["world_size"],
                                      resume=nanochat_keys(states[k]))
    assert_same_stream(resumed, reference, 5)
    resumed.close()


@pytest.mark.parametrize("seed", slow_beyond(range(24), 3))
def test_policies_match_oracle(seed, tmp_path):
    # long_doc_policy "split" / "split_reuse" against the token-tagged oracle, then exact resume
    rng, files, cfg = random_config(1000 + seed, tmp_path)
    policy = rng.choice(["split", "split_reuse"])
    overlap = rng.choice([0, rng.randint(0, cfg["T"] - 1)])
    buffer_size, prefetch = rng.choice([1, 3, 8, 30]), rng.choice([0, 2])
    tok = ByteTokenizer()
    kw = dict(tokenizer_batch_size=cfg["tokenizer_batch_size"], device="cpu",
              buffer_size=buffer_size, data_dir=cfg["data_dir"], rank=cfg["rank"],
              world_size=cfg["world_size"], prefetch=prefetch,
              long_doc_policy=policy, split_overlap=overlap)
    loader = BESTFIT(tok, cfg["B"], cfg["T"], "train", **kw)
    reference = oracle.bestfit_policy_loader(tok, split_parquet_files("train", cfg["data_dir"]),
                                             cfg["B"], cfg["T"], cfg["tokenizer_batch_size"],
                                             buffer_size, cfg["rank"], cfg["world_size"], policy,
                                             overlap)
    n_batches = past_two_epochs(files, cfg)
    states, batches = [], []
    for k in range(n_batches):
        inputs, targets, state = next(loader)
        exp_inputs, exp_targets, cropped = next(reference)
        assert as_lists(inputs, targets) == (exp_inputs, exp_targets), f"batch {k} differs"
        assert (inputs[:, 0] == tok.bos).all()  # every row starts with BOS
        # targets are the inputs shifted by one, except the masked overlap targets; rows are full
        kept = targets[:, :-1] != -100
        assert torch.equal(targets[:, :-1][kept], inputs[:, 1:][kept]) and (inputs >= 0).all()
        stats = loader.stats
        assert stats["tokens_cropped"] == cropped
        # the accounting closes: every tokenized token is emitted once, cropped, or still buffered
        assert stats["tokens_emitted"] == (k + 1) * cfg["B"] * (cfg["T"] + 1)
        assert stats["tokens_tokenized"] == (stats["tokens_emitted"] - stats["tokens_bos_added"]
                                             - stats["tokens_repeated"]
                                             + stats["tokens_cropped"] + stats["buffer_tokens"])
        assert stats["tokens_masked"] == sum(row.count(-100) for row in exp_targets) + (
            states[-1]["counters"]["tokens_masked"] if states else 0)
        states.append(state)
        batches.append(as_lists(inputs, targets))
    loader.close()
    if policy == "split_reuse":
        assert loader.stats["tokens_cropped"] == 0
    mine = [t for path in split_parquet_files("train", cfg["data_dir"])  # this rank's row groups
            for g in range(cfg["rank"], pq.ParquetFile(path).num_row_groups, cfg["world_size"])
            for t in pq.ParquetFile(path).read_row_group(g).column("text").to_pylist()]
    if policy == "split_reuse" or any(len(t.encode()) + 1 > cfg["T"] + 1 for t in mine):
        assert loader.stats["docs_split"] > 0 and any(s["pieces"] for s in states), (
            "not vacuous: pieces buffered")
    assert states[-1]["epoch"] >= 2, "the test should cross an epoch boundary"
    check_exact_resume(rng, tok, cfg, kw, states, batches)


@pytest.mark.parametrize("seed", slow_beyond(range(20), 3))
def test_concat_matches_oracle(seed, tmp_path):
    rng, files, cfg = random_config(seed, tmp_path)
    tok = ByteTokenizer()
    paths = split_parquet_files("train", cfg["data_dir"])
    B, T = cfg["B"], cfg["T"]
    kw = dict(tokenizer_batch_size=cfg["tokenizer_batch_size"], device="cpu",
              data_dir=cfg["data_dir"], rank=cfg["rank"], world_size=cfg["world_size"],
              prefetch=rng.choice([0, 2]))
    loader = CONCAT(tok, B, T, "train", **kw)
    reference = oracle.concat_loader(tok, paths, B, T, cfg["tokenizer_batch_size"], cfg["rank"],
                                     cfg["world_size"])
    states, batches = [], []
    for k in range(past_two_epochs(files, cfg)):
        inputs, targets, state = next(loader)
        exp_inputs, exp_targets, exp_state = next(reference)
        assert as_lists(inputs, targets) == (exp_inputs, exp_targets), f"batch {k} differs"
        assert nanochat_keys(state) == exp_state
        # B*T tokens consumed per batch; the last target, among others, is still buffered
        stats = loader.stats
        assert stats["tokens_emitted"] == (k + 1) * B * T and stats["tokens_cropped"] == 0
        assert (stats["tokens_tokenized"] == stats["tokens_emitted"] + stats["buffer_tokens"]
                and stats["buffer_tokens"] >= 1)
        states.append(state)
        batches.append(as_lists(inputs, targets))
    assert states[-1]["epoch"] >= 2, "the test should cross an epoch boundary"
    loader.close()

    check_exact_resume(rng, tok, cfg, kw, states, batches, CONCAT)

    # nanochat's form: approximate, as nanochat's resume
    k = rng.randrange(len(states))
    resumed = CONCAT(tok, B, T, "train", resume_state_dict=nanochat_keys(states[k]), **kw)
    reference = oracle.concat_loader(tok, paths, B, T, cfg["tokenizer_batch_size"], cfg["rank"],
                                     cfg["world_size"], resume=nanochat_keys(states[k]))
    assert_same_stream(resumed, reference, 4)
    resumed.close()


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(files=st.lists(st.lists(st.text("abc xyz", max_size=25), min_size=1, max_size=12),
                      min_size=1, max_size=3),
       row_group_size=st.integers(1, 5), world_size=st.integers(1, 3), data=st.data())
def test_concat_batches_cut_the_stream(files, row_group_size, world_size, data):
    # consecutive batches share one token (the last target is the next batch's first input), and
    # every batch's inputs, flattened, then the last batch's last target, are exactly this rank's
    # token stream, nothing skipped or repeated; a loader resumed from the state of any batch
    # yields the next one
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    B, T, tbs = data.draw(st.integers(1, 3), label="B"), data.draw(st.integers(1, 12), label="T"), \
        data.draw(st.integers(1, 6), label="tokenizer_batch_size")
    groups = [[texts[i:i + row_group_size] for i in range(0, len(texts), row_group_size)]
              for texts in files]
    epoch = [t for doc in (d for file in groups for g in file[rank::world_size] for d in g)
             for t in [ByteTokenizer.bos] + list(doc.encode())]
    assume(epoch)  # (a rank without row groups is an error: test_rank_without_row_groups)
    n = len(epoch) // (B * T) + 2  # into the second epoch
    stream = epoch * (n * B * T // len(epoch) + 2)
    with tempfile.TemporaryDirectory() as data_dir:
        write_shards(data_dir, files + [["val"]], row_group_size=row_group_size)
        kw = dict(tokenizer_batch_size=tbs, device="cpu", data_dir=data_dir, rank=rank,
                  world_size=world_size,
                  prefetch=data.draw(st.sampled_from([0, 2]), label="prefetch"))
        loader = CONCAT(ByteTokenizer(), B, T, "train", **kw)
        run = [(x.clone(), y.clone(), s) for x, y, s in (next(loader) for _ in range(n))]
        loader.close()
        for (_, targets, _), (inputs, _, _) in zip(run, run[1:]):
            assert targets[-1, -1] == inputs[0, 0]
        for inputs, targets, _ in run:  # targets are the inputs shifted by one, across rows too
            assert torch.equal(targets.flatten()[:-1], inputs.flatten()[1:])
        assert [t for x, _, _ in run for t in x.flatten().tolist()] + [
            run[-1][1][-1, -1].item()] == stream[:n * B * T + 1]
        assert run[-1][2]["epoch"] >= 2
        for k in range(n - 1):
            resumed = CONCAT(ByteTokenizer(), B, T, "train", resume_state_dict=run[k][2], **kw)
            x, y, s = next(resumed)
            assert (torch.equal(x, run[k + 1][0]) and torch.equal(y, run[k + 1][1])
                    and s == run[k + 1][2])
            resumed.close()


@pytest.mark.slow
@pytest.mark.parametrize("buffer_size", [10_000, 100_000])
def test_bestfit_matches_oracle_large_buffers(buffer_size, tmp_path):
    rng = random.Random(buffer_size)
    n_docs = buffer_size + 5_000
    texts = ["x" * int(rng.lognormvariate(2.5, 1.0)) for _ in range(n_docs)]
    write_shards(tmp_path, [texts[: n_docs // 2], texts[n_docs // 2:], ["val"]],
                 row_group_size=1024)
    tok = ByteTokenizer()
    paths = split_parquet_files("train", str(tmp_path))
    loader = BESTFIT(tok, 4, 128, "train", device="cpu", buffer_size=buffer_size,
                     data_dir=str(tmp_path))
    reference = oracle.bestfit_loader(tok, paths, 4, 128, buffer_size=buffer_size)
    assert_same_stream(loader, reference, 3)


def test_val_split_and_stateless_wrappers(tmp_path):
    files = [["train doc %d" % i for i in range(20)], ["val doc %d" % i for i in range(20)]]
    write_shards(tmp_path, files, row_group_size=4)
    tok = ByteTokenizer()
    kw = dict(device="cpu", data_dir=str(tmp_path))
    inputs, targets = next(tokenizing_distributed_data_loader_bos_bestfit(tok, 2, 16, "val",
                                                                          buffer_size=3, **kw))
    assert b"val doc" in bytes(t for t in inputs.flatten().tolist() if t < 256)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    inputs, targets = next(tokenizing_distributed_data_loader(tok, 2, 16, "train", **kw))
    assert b"train doc" in bytes(t for t in inputs.flatten().tolist() if t < 256)


def test_yielded_tensors_are_reused_views(tmp_path):
    write_shards(tmp_path, [["abc" * 10] * 50, ["v"]], row_group_size=5)
    loader = BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", buffer_size=2,
                     data_dir=str(tmp_path))
    x1, y1, _ = next(loader)
    x2, y2, _ = next(loader)
    # one [inputs | targets] buffer, overwritten by the next batch (documented)
    assert x1.data_ptr() == x2.data_ptr() and y1.data_ptr() == y2.data_ptr()
    assert y1.data_ptr() == x1.data_ptr() + 2 * 8 * 8


# -----------------------------------------------------------------------------
# bad input: clear errors at the call, never a hang


@pytest.fixture
def small_dir(tmp_path):
    write_shards(tmp_path, [["hello world"] * 10, ["val"] * 3], row_group_size=2)
    return str(tmp_path)


@pytest.mark.parametrize("loader", [BESTFIT, CONCAT])
@pytest.mark.parametrize("name,kwargs", [
    ("B", dict(B=0)), ("T", dict(T=-1)), ("tokenizer_threads", dict(tokenizer_threads=0)),
    ("tokenizer_batch_size", dict(tokenizer_batch_size=0)), ("split", dict(split="test")),
    ("prefetch", dict(prefetch=-1)), ("rank", dict(rank=2, world_size=2)), ("B", dict(B=2.5)),
])
def test_bad_arguments(loader, name, kwargs, small_dir):
    args = dict(B=2, T=8, split="train", device="cpu", data_dir=small_dir) | kwargs
    with pytest.raises(ValueError, match=name):
        loader(ByteTokenizer(), **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(long_doc_policy="truncate"),
     r"long_doc_policy must be one of \('crop', 'split', 'split_reuse'\)"),
    (dict(long_doc_policy="split", split_overlap=8),
     r"split_overlap must be an integer in \[0, 7\]"),
    (dict(long_doc_policy="split", split_overlap=-1), "split_overlap must be"),
    (dict(split_overlap=2), "split_overlap needs long_doc_policy='split' or 'split_reuse'"),
])
def test_bad_long_doc_policy(kwargs, match, small_dir, tmp_path):
    with pytest.raises(ValueError, match=match):  # at the call, not at the first batch
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=small_dir, **kwargs)
    from nanochat.dataloader import (
        pretokenized_distributed_data_loader_with_state_bos_bestfit as PRETOKENIZED,
    )
    with pytest.raises(ValueError, match=match):
        PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path), **kwargs)


def test_bad_buffer_size(small_dir):
    with pytest.raises(ValueError, match="buffer_size"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=small_dir, buffer_size=0)


def test_missing_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m nanochat.dataset"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no parquet shards"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=str(tmp_path / "empty"))
    # the default dataset directory (NANOCHAT_BASE_DIR points into tmp) has nothing either
    with pytest.raises(FileNotFoundError, match="python -m nanochat.dataset"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu")


def test_single_shard_means_empty_train_split(tmp_path):
    write_shards(tmp_path, [["only one"] * 4], row_group_size=2)
    with pytest.raises(FileNotFoundError, match="train split is empty"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=str(tmp_path))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_rank_without_row_groups(tmp_path, prefetch):
    # 2 train files of 1 row group each, 3 ranks: rank 2 gets nothing (the reference spins forever)
    write_shards(tmp_path, [["a b c"] * 3, ["d e f"] * 3, ["val"]], row_group_size=8)
    loader = BESTFIT(ByteTokenizer(), 1, 8, "train", device="cpu", data_dir=str(tmp_path),
                     rank=2, world_size=3, prefetch=prefetch)
    with pytest.raises(ValueError, match="rank 2 of world size 3 receives no documents"):
        next(loader)


@pytest.mark.parametrize("state,key", [
    ({"rg_idx": 0, "epoch": 1}, "pq_idx"),
    ({"pq_idx": 0, "epoch": 1}, "rg_idx"),
    ({"pq_idx": "0", "rg_idx": 0, "epoch": 1}, "pq_idx"),
    ({"pq_idx": 0, "rg_idx": 1.0, "epoch": 1}, "rg_idx"),
    ({"pq_idx": 0, "rg_idx": 0, "epoch": 0}, "epoch"),
    ({"pq_idx": 5, "rg_idx": 0, "epoch": 1}, "pq_idx"),
    ({"pq_idx": 0, "rg_idx": 99, "epoch": 1}, "rg_idx"),
])
def test_bad_resume_state(state, key, small_dir):
    with pytest.raises(ValueError, match=key):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=small_dir,
                resume_state_dict=state)


def test_resume_state_without_epoch_is_accepted(small_dir):
    # nanochat's concatenating loader's states carry only pq_idx and rg_idx
    _, _, state = next(CONCAT(ByteTokenizer(), 1, 4, "train", device="cpu", data_dir=small_dir,
                              resume_state_dict={"pq_idx": 0, "rg_idx": 1}))
    assert state["epoch"] == 1


class BadTokenizer(ByteTokenizer):
    def __init__(self, result):
        self.result = result

    def encode(self, texts, prepend=None, num_threads=1):
        return self.result(texts)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("result,error,match", [
    (lambda texts: "not a list", TypeError, "list of token-id lists"),
    (lambda texts: [["a", "b"] for _ in texts], TypeError, "lists of ints"),
    (lambda texts: [[256, 1.5] for _ in texts], TypeError, "lists of ints"),
    (lambda texts: [[1, 2] for _ in texts], ValueError, "BOS"),
    (lambda texts: [[256, 70000] for _ in texts], ValueError, "out of range"),
    (lambda texts: [(256, -1) for _ in texts], ValueError, "out of range"),
    (lambda texts: [[] for _ in texts], ValueError, "BOS"),
    (lambda texts: ["ab" for _ in texts], TypeError, "element of type str"),
    (lambda texts: [np.array([256, 1.5]) for _ in texts], TypeError, "lists of ints"),
    (lambda texts: [np.array([256, 70000]) for _ in texts], ValueError, "out of range"),
    (lambda texts: [np.array([1, 2], dtype=np.uint16) for _ in texts], ValueError, "BOS"),
])
def test_bad_tokenizer_output(result, error, match, prefetch, small_dir):
    loader = BESTFIT(BadTokenizer(result), 2, 8, "train", device="cpu", data_dir=small_dir,
                     prefetch=prefetch)
    with pytest.raises(error, match=match):
        next(loader)


def test_tokenizer_without_methods(small_dir):
    with pytest.raises(TypeError, match="get_bos_token_id"):
        BESTFIT(object(), 2, 8, "train", device="cpu", data_dir=small_dir)


def test_cuda_requested_without_gpu(small_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    with pytest.raises(ValueError, match="no CUDA GPU"):
        BESTFIT(ByteTokenizer(), 2, 8, "train", device="cuda", data_dir=small_dir)


# -----------------------------------------------------------------------------
# background threads: failures reach the caller, early stops end the threads


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("nanochat-")]


def wait_for_no_loader_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return loader_threads()


def test_bad_shard_in_background_raises_on_next(tmp_path):
    write_shards(tmp_path, [["good text"] * 40], row_group_size=4)
    write_shard(tmp_path / "shard_00001.parquet", [None, "x"], row_group_size=2)  # a null text
    write_shards(tmp_path / "unused", [["v"]], row_group_size=1)
    (tmp_path / "shard_00002.parquet").write_bytes(
        (tmp_path / "unused" / "shard_00000.parquet").read_bytes())
    loader = BESTFIT(ByteTokenizer(), 1, 8, "train", device="cpu", data_dir=str(tmp_path),
                     buffer_size=2, tokenizer_batch_size=2, prefetch=2)
    with pytest.raises(ValueError, match=r"shard_00001.parquet row group 0"):
        for _ in range(1000):
            next(loader)
    # the same error again on the next call, never a hang
    with pytest.raises(ValueError, match=r"shard_00001.parquet row group 0"):
        next(loader)
    assert wait_for_no_loader_threads() == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["break", "close", "gc"])
def test_early_stop_ends_threads(how, small_dir):
    assert wait_for_no_loader_threads() == []
    loader = tokenizing_distributed_data_loader_bos_bestfit(ByteTokenizer(), 2, 8, "train",
                                                            device="cpu", data_dir=small_dir,
                                                            prefetch=3)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert loader_threads(), "prefetch should run background threads"
    if how == "close":
        loader.close()
    elif how == "gc":
        del loader
        gc.collect()
    else:
        loader = None  # a for-loop break, then the loader goes out of scope
    assert wait_for_no_loader_threads() == []


EXIT_SCRIPT = """
import atexit, sys, threading
names = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("nanochat-"))
# registered first, so it runs after the loader's hook
atexit.register(lambda: print("at exit:", names()))
sys.path.insert(0, "tests")
from conftest import ByteTokenizer
from nanochat.dataloader import tokenizing_distributed_data_loader_bos_bestfit
loader = tokenizing_distributed_data_loader_bos_bestfit(ByteTokenizer(), 2, 8, "train",
                                                        device="cpu", data_dir=sys.argv[1],
                                                        prefetch=3)
next(loader)
print("running:", names())
"""


@pytest.mark.slow
def test_a_loader_never_closed_stops_its_threads_at_exit(small_dir):
    # a script that just ends: the threads must be stopped before the interpreter finalizes, or
    # one of them can be cut off inside a C++ call (pyarrow, the tokenizer) and abort the process
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, small_dir], cwd=REPO_ROOT,
                            env=worker_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    running, at_exit = result.stdout.splitlines()
    assert "nanochat-packing" in running and "nanochat-tokenize" in running
    assert at_exit == "at exit: []"


class SlowTokenizer(ByteTokenizer):
    """A byte tokenizer whose calls on the loader's threads wait first, until the test sets
    `release` or `delay` seconds have passed: a long call that nothing interrupts. Counts the calls
    started and ended."""

    def __init__(self, delay: float):
        self.delay, self.started, self.ended = delay, 0, 0
        self.in_call, self.release = threading.Event(), threading.Event()

    def encode(self, texts, prepend=None, num_threads=1):
        # (not the fingerprint's call, at the start)
        if threading.current_thread().name.startswith("nanochat-"):
            self.started += 1
            self.in_call.set()
            self.release.wait(self.delay)
            self.ended += 1
        return super().encode(texts, prepend, num_threads)


class SlowArrayTokenizer(SlowTokenizer):
    """The same with encode_to_arrays, as ours: the loader keeps two calls running at once."""

    def encode_to_arrays(self, texts, prepend=None, num_threads=1):
        return [np.array(ids, dtype=np.uint16) for ids in self.encode(texts, prepend, num_threads)]


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", [SlowTokenizer, SlowArrayTokenizer])
def test_close_returns_while_a_tokenizer_call_runs(tokenizer, small_dir):
    tok = tokenizer(delay=300.0)  # the calls end when the test releases them
    loader = BESTFIT(tok, 2, 8, "train", device="cpu", data_dir=small_dir, prefetch=2)
    got = []

    def consume():  # waits in next() for the first batch, which the tokenizer holds up
        try:
            got.append(next(loader))
        except StopIteration:
            got.append("StopIteration")

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert tok.in_call.wait(60)
    # close() returns while the call it cannot interrupt still runs (held until released below):
    # a close() that waited for the call would stall here
    assert outcome(loader.close, 60) is None
    assert tok.ended == 0 < tok.started, "close() waited for the tokenizer call"
    started = tok.started
    consumer.join(60)
    # the waiting next() ends: nothing came out
    assert not consumer.is_alive() and got == ["StopIteration"]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(loader)
    threads = loader_threads()
    assert threads, "a thread should still be inside the call"
    tok.release.set()
    for thread in threads:  # each ends when its call does
        thread.join(60)
    assert [t.name for t in threads if t.is_alive()] == []
    # the calls running at close() ended, and none started after
    assert tok.ended == tok.started == started >= 1


@pytest.mark.parametrize("prefetch", [0, 3])
def test_nothing_comes_out_after_close(prefetch, small_dir):
    loader = BESTFIT(ByteTokenizer(), 2, 8, "train", device="cpu", data_dir=small_dir,
                     prefetch=prefetch)
    next(loader)
    deadline = time.monotonic() + 10
    while prefetch and not loader._source._items and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prefetch or loader._source._items, "not vacuous: the next batches are ready"
    loader.close()
    for _ in range(2):
        with pytest.raises(StopIteration):  # as from a closed generator
            next(loader)
    assert list(loader) == []
    assert wait_for_no_loader_threads() == []


BUSY_EXIT_SCRIPT = """
import sys, threading, time
import torch
sys.path.insert(0, "tests")
from conftest import ByteTokenizer
from nanochat.dataloader import tokenizing_distributed_data_loader_bos_bestfit
torch.set_num_threads(1)
in_call = threading.Event()

# once `busy`, each call spends 1.5 s in torch's C++ code, without the GIL
class Busy(ByteTokenizer):
    busy = False

    def encode(self, texts, prepend=None, num_threads=1):
        if self.busy:
            print("call started", flush=True)
            in_call.set()
            a, t0 = torch.randn(500, 500), time.monotonic()
            while time.monotonic() - t0 < 1.5:
                a @ a
            print("call ended", flush=True)
        return super().encode(texts, prepend, num_threads)

tokenizer = Busy()
loader = tokenizing_distributed_data_loader_bos_bestfit(tokenizer, 2, 8, "train", device="cpu",
                                                        data_dir=sys.argv[1], prefetch=2)
next(loader)
tokenizer.busy = True

def drain():  # the read-ahead may be full: taking batches makes the loader tokenize again
    try:
        for _ in loader:
            pass
    except Exception:
        pass

threading.Thread(target=drain, daemon=True).start()
in_call.wait(30)
print("exiting", flush=True)
"""


@pytest.mark.slow
def test_exit_during_a_tokenizer_call_is_clean(small_dir):
    # the script ends while a loader thread is inside a C++ call: the interpreter must neither
    # abort ('terminate called without an active exception', as a daemon thread cut off there
    # does) nor start another call
    result = subprocess.run([sys.executable, "-c", BUSY_EXIT_SCRIPT, small_dir], cwd=REPO_ROOT,
                            env=worker_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr
    assert result.stdout.splitlines() == ["call started", "exiting", "call ended"]


# -----------------------------------------------------------------------------
# CUDA transfer (skipped without a GPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_batches_match_cpu(tmp_path):
    rng = random.Random(1)
    write_shards(tmp_path, [["w" * rng.randint(0, 300) for _ in range(400)], ["v"]],
                 row_group_size=16)
    kw = dict(buffer_size=20, data_dir=str(tmp_path))
    cpu = BESTFIT(ByteTokenizer(), 4, 64, "train", device="cpu", **kw)
    gpu = BESTFIT(ByteTokenizer(), 4, 64, "train", device="cuda", **kw)
    pointers = set()
    for _ in range(20):
        x, y, s = next(cpu)
        gx, gy, gs = next(gpu)
        assert gx.is_cuda and gy.is_cuda and gx.dtype == torch.int64
        assert torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y) and gs == s
        pointers.add(gx.data_ptr())
    assert len(pointers) == 1  # one device buffer, reused


# -----------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("policy,overlap", [("crop", 0), ("split", 5), ("split_reuse", 0)])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_stats_describe_the_yielded_batches(prefetch, policy, overlap, tmp_path):
    rng = random.Random(7)
    write_shards(tmp_path, [["y" * rng.randint(0, 120) for _ in range(300)], ["v"]],
                 row_group_size=10)
    B, T = 3, 40
    loader = BESTFIT(ByteTokenizer(), B, T, "train", device="cpu", buffer_size=12,
                     tokenizer_batch_size=7, data_dir=str(tmp_path), prefetch=prefetch,
                     long_doc_policy=policy, split_overlap=overlap)
    assert loader.stats == {}  # nothing yielded yet
    bos_per_row = []
    for k in range(1, 30):
        inputs, targets, _ = next(loader)
        rows = torch.cat([inputs, targets[:, -1:]], dim=1)
        bos_per_row += (rows == ByteTokenizer.bos).sum(dim=1).tolist()
        s = loader.stats
        # every placement starts with BOS, so documents per row are countable from the rows
        # themselves
        assert s["docs_per_row_max"] == max(bos_per_row)
        assert s["docs_per_row_mean"] == pytest.approx(sum(bos_per_row) / len(bos_per_row))
        assert s["tokens_emitted"] == k * B * (T + 1)  # what was yielded, not what was read ahead
        # every tokenized token is emitted once, cropped, or still buffered; pieces add a BOS and
        # overlap
        assert s["tokens_tokenized"] == (s["tokens_emitted"] - s["tokens_bos_added"]
                                         - s["tokens_repeated"]
                                         + s["tokens_cropped"] + s["buffer_tokens"])
        assert s["tokens_masked"] == int((targets == -100).sum()) + (masked_before if k > 1 else 0)
        masked_before = s["tokens_masked"]
        # refilled to 12 before each placement, and the last placement of a batch took one out
        assert s["buffer_docs"] >= 11 and s["wait_seconds"] >= 0
    assert max(bos_per_row) >= 2
    if policy == "crop":
        assert (s["tokens_cropped"] > 0 and s["docs_split"] == 0
                and s["doc_start_visible_share"] == 1)
        assert s["tokens_bos_added"] == s["tokens_repeated"] == s["tokens_masked"] == 0
    else:  # documents of up to 121 tokens in rows of 41: many are split, and their pieces placed
        assert (s["docs_split"] > 0 and s["tokens_bos_added"] > 0
                and 0.3 < s["doc_start_visible_share"] < 1)
        assert s["crop_share"] < 0.05 if policy == "split" else s["tokens_cropped"] == 0
        assert s["tokens_masked"] == s["tokens_repeated"] and (
            (s["tokens_repeated"] > 0) == (overlap > 0))


def test_real_tokenizer_fast_path_matches_oracle(tmp_path):
    # nanochat's tokenizer has encode_to_arrays (numpy, no Python ints); the oracle uses encode
    # (lists)
    from nanochat.tokenizer import RustBPETokenizer
    rng = random.Random(3)
    words = ["the", "data", "loader", "packs", "rows", "of", "tokens", "123", "4567", "é", "ünï",
             "\n"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 80))) for _ in range(300)]
    write_shards(tmp_path, [docs[:150], docs[150:280], docs[280:]], row_group_size=16)
    tok = RustBPETokenizer.train_from_iterator(iter(docs), 300)
    assert hasattr(tok, "encode_to_arrays")
    paths = split_parquet_files("train", str(tmp_path))
    loader = BESTFIT(tok, 3, 32, "train", device="cpu", buffer_size=20, tokenizer_batch_size=10,
                     data_dir=str(tmp_path))
    reference = oracle.bestfit_loader(tok, paths, 3, 32, tokenizer_batch_size=10, buffer_size=20)
    assert_same_stream(loader, reference, 40)
    # and with this tokenizer the loader overlaps consecutive encode calls: resume stays exact
    kw = dict(device="cpu", buffer_size=20, tokenizer_batch_size=10, data_dir=str(tmp_path))
    loader = BESTFIT(tok, 3, 32, "train", **kw)
    run = [(x.clone(), y.clone(), s) for x, y, s in (next(loader) for _ in range(30))]
    resumed = BESTFIT(tok, 3, 32, "train", resume_state_dict=run[11][2], **kw)
    for x, y, s in run[12:]:
        rx, ry, rs = next(resumed)
        assert torch.equal(rx, x) and torch.equal(ry, y) and rs == s


# -----------------------------------------------------------------------------
# tokenizers that return lists of ints (nanochat's own, any duck-typed one)


class ListTokenizer:
    """A trained BPE seen through the documented interface only: encode returns lists of Python
    ints, there is no encode_to_arrays. with_enc also exposes the tiktoken Encoding as `enc`, as
    nanochat's RustBPETokenizer does. Records how many encode calls ran at once."""

    def __init__(self, tok, with_enc: bool):
        self._tok = tok
        if with_enc:
            self.enc = tok.enc
        self._lock = threading.Lock()
        self.running = self.most_at_once = 0

    def get_bos_token_id(self):
        return self._tok.get_bos_token_id()

    def get_vocab_size(self):
        return self._tok.get_vocab_size()

    def encode(self, texts, prepend=None, num_threads=1):
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            time.sleep(0.001)  # give a second call the chance to start, were one made
            return self._tok.encode(texts, prepend=prepend, num_threads=num_threads)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture(scope="module")
def bpe_corpus():
    rng = random.Random(5)
    words = ["the", "data", "loader", "packs", "rows", "of", "tokens", "123", "4567", "é", "ünï",
             "\n"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 90))) for _ in range(130)]
    from nanochat.tokenizer import RustBPETokenizer
    return docs, RustBPETokenizer.train_from_iterator(iter(docs), 300)


@pytest.mark.parametrize("with_enc", [False, True])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_list_tokenizer_matches_ours(with_enc, prefetch, bpe_corpus, tmp_path):
    # the loader converts the lists itself: the same batches and states as from our numpy arrays
    docs, tok = bpe_corpus
    write_shards(tmp_path, [docs[:60], docs[60:120], docs[120:]], row_group_size=16)
    kw = dict(device="cpu", buffer_size=20, tokenizer_batch_size=10, data_dir=str(tmp_path),
              prefetch=prefetch)
    ours = BESTFIT(tok, 4, 64, "train", **kw)
    lists = ListTokenizer(tok, with_enc)
    loader = BESTFIT(lists, 4, 64, "train", **kw)
    run = []
    for k in range(60):  # the train split holds ~8,800 tokens: ~30 batches
        x, y, s = next(loader)
        ox, oy, ostate = next(ours)
        assert torch.equal(x, ox) and torch.equal(y, oy), f"batch {k} differs"
        assert s == ostate, f"state of batch {k} differs"
        run.append((x.clone(), y.clone(), s))
    assert run[-1][2]["epoch"] >= 2, "the test should cross an epoch boundary"
    assert lists.most_at_once == 1  # a tokenizer that returns lists is called one batch at a time
    loader.close()
    # a state taken with the list tokenizer resumes ours exactly
    resumed = BESTFIT(tok, 4, 64, "train", resume_state_dict=run[24][2], **kw)
    for x, y, s in run[25:40]:
        rx, ry, rs = next(resumed)
        assert torch.equal(rx, x) and torch.equal(ry, y) and rs == s


class WideTokenizer(ByteTokenizer):
    """Byte tokens shifted past 2**16: storage is uint32."""

    bos = 70_000

    def get_vocab_size(self):
        return 70_257

    def encode(self, texts, prepend=None, num_threads=1):
        return [[prepend] + [70_001 + b for b in t.encode()] for t in texts]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_wide_vocabulary_is_stored_in_uint32(prefetch, small_dir):
    loader = BESTFIT(WideTokenizer(), 2, 8, "train", device="cpu", data_dir=small_dir,
                     prefetch=prefetch)
    inputs, targets, _ = next(loader)
    assert (inputs[:, 0] == 70_000).all() and inputs.min() >= 70_000 and targets.max() < 70_257
    too_wide = BadTokenizer(lambda texts: [[70_000, 2**32] for _ in texts])
    too_wide.get_vocab_size = WideTokenizer().get_vocab_size
    with pytest.raises(ValueError, match=r"out of range \[0, 4294967295\] for uint32"):
        next(BESTFIT(too_wide, 2, 8, "train", device="cpu", data_dir=small_dir, prefetch=prefetch))


class Int64ArrayTokenizer(ByteTokenizer):
    def encode(self, texts, prepend=None, num_threads=1):
        return [np.array(ids, dtype=np.int64)
                for ids in super().encode(texts, prepend, num_threads)]


def test_arrays_of_another_dtype_are_converted(small_dir):
    kw = dict(device="cpu", data_dir=small_dir, buffer_size=3, tokenizer_batch_size=2)
    loader = BESTFIT(Int64ArrayTokenizer(), 2, 8, "train", **kw)
    reference = BESTFIT(ByteTokenizer(), 2, 8, "train", **kw)
    for _ in range(10):
        (x, y, s), (rx, ry, rs) = next(loader), next(reference)
        assert torch.equal(x, rx) and torch.equal(y, ry) and s == rs
