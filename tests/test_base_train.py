"""
scripts/base_train.py end to end, in subprocesses as a user runs it: a tiny GPT on tiny shards
(~30 s on 2 cores). Trained straight for 12 steps, then stopped after step 6 and resumed from its
checkpoint: steps 7..12 must give the same losses, float for float, and the same val losses.
That needs the loader's exact resume; a loader that replays its stream from the start checks the
training side alone (model, optimizer, RNG, step count, evaluation).

    python -m pytest tests/test_base_train.py -q
"""

import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import scripts.base_train as base_train
from conftest import REPO_ROOT, write_shards
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.tokenizer import RustBPETokenizer
from scripts.demo import generate_documents

STEPS = 12
RESUME_STEP = 6
# tiny on purpose: B*T = 64 tokens per step, so a row group of 16 documents lasts several steps and
# the buffer of 8 still holds documents at the checkpoint: the resume must carry them over exactly
TINY = ["--depth", "2", "--width", "32", "--heads", "2", "--B", "2", "--T", "32",
        "--buffer-size", "8", "--steps", str(STEPS), "--eval-every", "4", "--eval-batches", "2",
        "--lr", "1e-2", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 train shards and a val shard of short English-like documents (20-300 characters, so
    rows hold one to several documents), row groups of 16, and a 300-token BPE trained on them."""
    root = tmp_path_factory.mktemp("base_train")
    rng = random.Random(0)
    texts = [doc[:rng.randint(20, 300)] for doc in generate_documents(320, seed=1)]
    write_shards(root / "data", [texts[i:i + 80] for i in range(0, len(texts), 80)],
                 row_group_size=16)
    tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), 300)
    tokenizer.save(str(root / "tokenizer"))
    return root


def train(corpus, tmp_path, name, *args):
    """Run base_train in a subprocess; returns its JSON log."""
    return train_side_by_side(corpus, tmp_path, {name: args})[name]


def train_side_by_side(corpus, tmp_path, runs: dict) -> dict:
    """Run base_train once for each name -> args in `runs`, in subprocesses that run at once;
    returns their JSON logs by name."""
    started = {name: subprocess.Popen(
        [sys.executable, "-m", "scripts.base_train", *TINY, "--data-dir", str(corpus / "data"),
         "--tokenizer-dir", str(corpus / "tokenizer"), "--log-json", str(tmp_path / f"{name}.json"),
         *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, args in runs.items()}
    logs = {}
    try:
        for name, run in started.items():
            stdout, stderr = run.communicate(timeout=120)
            assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
            with open(tmp_path / f"{name}.json") as f:
                logs[name] = json.load(f) | {"stdout": stdout}
    finally:
        for run in started.values():
            run.kill()
            run.wait()
    return logs


@pytest.fixture(scope="module")
def straight_twice(corpus, tmp_path_factory):
    """The uninterrupted run, 12 steps, twice at once."""
    return train_side_by_side(corpus, tmp_path_factory.mktemp("straight"),
                              {"straight": (), "again": ()})


@pytest.fixture(scope="module")
def straight(straight_twice):
    return straight_twice["straight"]


@pytest.fixture(scope="module")
def checkpoint_dir(corpus, tmp_path_factory):
    """A run that saves every 3 steps and stops after step 6, as if killed."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    checkpoint_dir = tmp_path / "checkpoints"
    log = train(corpus, tmp_path, "stopped", "--save-every", "3",
                "--checkpoint-dir", str(checkpoint_dir), "--stop-after-step", str(RESUME_STEP))
    assert log["stopped"] is True
    assert sorted(log["losses"]) == [str(s) for s in range(1, RESUME_STEP + 1)]
    return checkpoint_dir


@pytest.mark.slow
def test_straight_run_is_deterministic_and_learns(straight, straight_twice):
    again = straight_twice["again"]
    assert again["losses"] == straight["losses"]
    assert again["val"] == straight["val"]
    losses = [straight["losses"][str(s)] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > losses[-1]  # it learns something
    # the first loss is about ln(vocab): the init predicts roughly uniformly
    assert abs(losses[0] - math.log(300)) < 1.0
    assert sorted(straight["val"], key=int) == ["4", "8", "12"]
    for result in straight["val"].values():
        assert math.isfinite(result["loss"]) and 0 < result["bpb"] < 10
    # every step prints its loss in full, for people who compare by eye
    assert f"loss {losses[-1]!r}" in straight["stdout"]
    # and the loader's figures since the step before, in one rounded line: nothing masked under crop
    figures = [line for line in straight["stdout"].splitlines() if line.startswith("loader:")]
    assert len(figures) == STEPS, straight["stdout"][-2000:]
    for line in figures:
        assert re.fullmatch(r"loader: wait \d+\.\d% \| [\d.]+[kMG]? tok/s in, [\d.]+[kMG]? out \| "
                            r"crop \d+\.\d% masked 0\.0% \| \d+\.\d docs/row", line), line


@pytest.mark.slow
def test_checkpoints_are_complete_and_plain(checkpoint_dir):
    # no .tmp left
    assert sorted(os.listdir(checkpoint_dir)) == ["step_000003.pt", "step_000006.pt"]
    checkpoint = torch.load(checkpoint_dir / "step_000006.pt", weights_only=True)
    assert checkpoint["step"] == RESUME_STEP
    assert len(checkpoint["dataloader_state_dicts"]) == 1  # one process, one loader state
    assert {"model", "optimizer", "rng_state", "model_config"} <= checkpoint.keys()


@pytest.fixture(scope="module")
def resumed(corpus, checkpoint_dir, tmp_path_factory):
    """Steps 7..12, resumed from the step-6 checkpoint."""
    return train(corpus, tmp_path_factory.mktemp("resumed"), "resumed", "--checkpoint-dir",
                 str(checkpoint_dir), "--resume-from-step", str(RESUME_STEP))


@pytest.mark.slow
def test_resume_runs_to_the_end(resumed):
    assert f"continuing with step {RESUME_STEP + 1}" in resumed["stdout"]
    assert resumed["stopped"] is False
    assert sorted(resumed["losses"], key=int) == [str(s) for s in range(RESUME_STEP + 1, STEPS + 1)]
    assert all(math.isfinite(x) for x in resumed["losses"].values())
    assert sorted(resumed["val"], key=int) == ["8", "12"]


@pytest.mark.slow
def test_resume_is_exact(straight, resumed):
    # the resume point is worth testing: documents are still waiting in the loader's buffer
    assert straight["buffer_docs"][str(RESUME_STEP)] > 0
    expected = {step: loss for step, loss in straight["losses"].items() if int(step) > RESUME_STEP}
    assert resumed["losses"] == expected  # bitwise: json round-trips floats exactly
    assert resumed["val"] == {step: v for step, v in straight["val"].items()
                              if int(step) > RESUME_STEP}


class ReplayingLoader:
    """The real loader with an exact resume by brute force: the state is the number of batches
    yielded, and resuming replays the stream from the start and drops that many. Slow, obviously
    right, and independent of the loader's own state, so it tests the training side alone."""

    def __init__(self, *args, resume_state_dict=None, **kwargs):
        self.loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, **kwargs)
        self.stats = {}
        self.batches = 0
        for _ in range(0 if resume_state_dict is None else resume_state_dict["batches"]):
            next(self)

    def __next__(self):
        inputs, targets, _ = next(self.loader)
        self.stats = self.loader.stats
        self.batches += 1
        return inputs, targets, {"batches": self.batches}

    def figures(self):
        return self.loader.figures()

    def close(self):
        self.loader.close()


@pytest.mark.slow
def test_training_side_of_resume_is_exact(corpus, tmp_path, monkeypatch):
    """Model, optimizer, RNG, step count and evaluation resume exactly, whatever the loader does."""
    monkeypatch.setattr(base_train, "tokenizing_distributed_data_loader_with_state_bos_bestfit",
                        ReplayingLoader)
    common = [*TINY, "--data-dir", str(corpus / "data"),
              "--tokenizer-dir", str(corpus / "tokenizer"),
              "--checkpoint-dir", str(tmp_path / "checkpoints")]
    logs = {}
    for name, args in [("straight", []),
                       ("stopped", ["--save-every", "3", "--stop-after-step", "6"]),
                       ("resumed", ["--resume-from-step", "3"])]:
        assert base_train.main([*common, "--log-json", str(tmp_path / f"{name}.json"), *args]) == 0
        with open(tmp_path / f"{name}.json") as f:
            logs[name] = json.load(f)
    straight, stopped, resumed = logs["straight"], logs["stopped"], logs["resumed"]
    assert stopped["losses"] == {step: x for step, x in straight["losses"].items()
                                 if int(step) <= 6}
    assert resumed["losses"] == {step: x for step, x in straight["losses"].items()
                                 if int(step) > 3}
    assert resumed["val"] == straight["val"]


@pytest.mark.slow
def test_missing_checkpoint_names_the_path(corpus, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "scripts.base_train", *TINY, "--data-dir", str(corpus / "data"),
         "--tokenizer-dir", str(corpus / "tokenizer"), "--checkpoint-dir", str(tmp_path),
         "--resume-from-step", "5"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "FileNotFoundError" in result.stderr
    assert str(tmp_path / "step_000005.pt") in result.stderr


@pytest.mark.slow
def test_resume_on_another_world_size(corpus, tmp_path):
    """Elastic: 2 processes under torchrun save a checkpoint, 1 process resumes it; the loader
    states of both ranks are merged, so the resumed rank first trains on what both had left."""
    checkpoint_dir = tmp_path / "checkpoints"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "scripts.base_train", *TINY, "--data-dir", str(corpus / "data"),
         "--tokenizer-dir", str(corpus / "tokenizer"), "--save-every", "3",
         "--checkpoint-dir", str(checkpoint_dir), "--stop-after-step", "3"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = torch.load(checkpoint_dir / "step_000003.pt", weights_only=True)
    assert [s["config"]["rank"] for s in saved["dataloader_state_dicts"]] == [0, 1]
    log = train(corpus, tmp_path, "elastic", "--checkpoint-dir", str(checkpoint_dir),
                "--resume-from-step", "3")
    assert "world size changed from 2 to 1" in log["stdout"]
    assert sorted(log["losses"], key=int) == [str(s) for s in range(4, STEPS + 1)]
    assert all(math.isfinite(loss) for loss in log["losses"].values())


@pytest.mark.slow
def test_resume_is_exact_with_split_documents(corpus, tmp_path):
    # long_doc_policy="split_reuse" with an overlap: the checkpoint's loader state holds pieces of
    # split documents, and the resumed losses still equal the uninterrupted run's, float for float
    policy = ["--long-doc-policy", "split_reuse", "--split-overlap", "3",
              "--checkpoint-dir", str(tmp_path / "ck")]
    straight = train_side_by_side(corpus, tmp_path, {
        "straight": policy, "stopped": (*policy, "--save-every", "3",
                                             "--stop-after-step", str(RESUME_STEP))})["straight"]
    state = torch.load(tmp_path / "ck" / f"step_{RESUME_STEP:06d}.pt",
                       weights_only=True)["dataloader_state_dicts"][0]
    assert state["pieces"] and state["config"]["long_doc_policy"] == "split_reuse"
    resumed = train(corpus, tmp_path, "resumed", *policy, "--resume-from-step", str(RESUME_STEP))
    assert resumed["losses"] == {s: v for s, v in straight["losses"].items()
                                 if int(s) > RESUME_STEP}
    # split_reuse crops nothing; the pieces' repeated tokens are masked (their targets are -100)
    figures = [line for line in straight["stdout"].splitlines() if line.startswith("loader:")]
    assert len(figures) == STEPS and all("| crop 0.0% masked " in line for line in figures)
    assert any(not re.search(r"masked 0\.0%", line) for line in figures), figures
