"""
Slurm's variables as ranks (nanochat/data/processing/slurm.py): a step's tasks, an array's tasks,
both together, a batch script without srun (one task, whatever its --ntasks), an array of ids that
are no range refused; the command reading them as it reads torchrun's (a flag first, each of rank
and world size on its own), a rerun at another world size finishing what dead ranks left. Run:
    python -m pytest tests/data/processing/test_slurm.py -q
"""

import json
import os

import pytest

from conftest import ByteArrayTokenizer
from nanochat import pretokenize
from nanochat.data.base.layout import list_token_shards
from nanochat.data.processing.slurm import slurm_share

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}


def array(task_id, count, low, high, step=1) -> dict:
    return {"SLURM_ARRAY_TASK_ID": str(task_id), "SLURM_ARRAY_TASK_COUNT": str(count),
            "SLURM_ARRAY_TASK_MIN": str(low), "SLURM_ARRAY_TASK_MAX": str(high),
            "SLURM_ARRAY_TASK_STEP": str(step)}


def byte_tokenizer(_directory):
    return ByteArrayTokenizer()


def test_the_shares_slurm_gives():
    assert slurm_share({}) is None  # not under Slurm
    assert slurm_share(STEP)[:2] == (3, 4)  # srun's task 3 of 4
    assert slurm_share(array(5, 4, 1, 7, 2))[:2] == (2, 4)  # --array=1-7:2: ids 1 3 5 7
    assert slurm_share(array(12, 8, 10, 17))[:2] == (2, 8)  # --array=10-17
    # an array of 2-task steps: array task 3 of 4, task 1 of 2
    both = slurm_share({**STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
                        **array(3, 4, 0, 3)})
    assert both.rank == 7 and both.world_size == 8
    assert both.what == "task 1 of 2 of srun's step; array task 3 of 4 -> rank 7 of 8"
    # the batch script itself (no srun: no step id; Slurm 26.05 may write a negative one) is one
    # task: SLURM_PROCID=0 of SLURM_NTASKS=4 there would leave 3/4 of the units to no one
    for step_id in ({}, {"SLURM_STEP_ID": "-5"}):
        batch = slurm_share({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", **step_id})
        assert batch[:2] == (0, 1) and "run without srun is one task" in batch.what
    with pytest.raises(ValueError, match=r"array task 3 of ids 0..7 \(step 1, 3 tasks\) is not a "
                                         r"range of ids: submit --array=0-2"):
        slurm_share(array(3, 3, 0, 7))  # --array=0,3,7
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not a number"):
        slurm_share({**STEP, "SLURM_PROCID": "x"})


def test_the_command_takes_its_share_from_slurm_and_a_rerun_at_another_size_finishes(
        tmp_path, monkeypatch, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in "abcde":
        (raw / f"{name}.jsonl").write_text(json.dumps({"text": f"text {name}"}) + "\n")
    # the command with the byte tokenizer: what it loads from --tokenizer-dir is not under test
    monkeypatch.setattr(pretokenize.RustBPETokenizer, "from_directory",
                        staticmethod(byte_tokenizer))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / pretokenize.TOKENIZER_FILENAME).write_bytes(b"x")
    out = tmp_path / "out"
    argv = ["--input", str(raw), "--output", str(out), "--tokenizer-dir", str(tmp_path / "tok"),
            "--num-workers", "1"]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for key, value in {**STEP, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    assert pretokenize.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Slurm: task 1 of 2 of srun's step -> rank 1 of 2" in printed
    assert "5 inputs in 5 units of work, 2 for rank 1/2" in printed
    train = str(out / "train")
    assert [os.path.basename(p) for p in list_token_shards(train)] == ["b", "d"]
    # rank 0 died; the rerun is an array of 3 tasks: each finishes its share of what is left
    for key in STEP:
        monkeypatch.delenv(key)
    for task in range(3):
        for key, value in array(task, 3, 0, 2).items():
            monkeypatch.setenv(key, value)
        assert pretokenize.main(argv) == 0
    assert [os.path.basename(p) for p in list_token_shards(train)] == list("abcde")


def test_each_of_rank_and_world_size_comes_from_its_flag_else_torchrun_else_slurm(monkeypatch):
    def share(*flags):
        return pretokenize._share(pretokenize._parser().parse_args(
            ["--input", "in", "--output", "out", *flags]), None)

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert share() == (0, 1)
    for key, value in STEP.items():  # srun's task 3 of 4
        monkeypatch.setenv(key, value)
    assert share() == (3, 4)
    assert share("--world-size", "4") == (3, 4)  # one flag: the other still from Slurm
    assert share("--rank", "1") == (1, 4)
    assert share("--rank", "0", "--world-size", "5") == (0, 5)
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert share() == (1, 2)  # torchrun's, not Slurm's
    assert share("--rank", "0") == (0, 2)
