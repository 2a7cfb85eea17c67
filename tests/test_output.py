"""
Output a person reads: progress bars that leave a log file clean (a plain line per quarter, never a
'\\r' frame), and every command's --help naming the command as it is run (`python -m scripts.X`,
`python -m nanochat.X`).

Run: python -m pytest tests/test_output.py -q
"""

import importlib
import io
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, write_shards
from nanochat.data.base.files import progress_bar



def _run_logged(args: list[str], log_path: str) -> str:
    """`python -m ARGS` from the repo root, stdout and stderr into one file, as a job's log is."""
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, stdout=log,
                              stderr=subprocess.STDOUT, timeout=120)
    with open(log_path, newline="") as f:  # newline="": a '\r' stays a '\r'
        text = f.read()
    assert done.returncode == 0, text
    return text


# -----------------------------------------------------------------------------
# Progress bars


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_a_line_per_quarter_and_no_frames():
    stream = io.StringIO()
    with progress_bar(total=8, desc="reading", unit="file", file=stream, mininterval=0) as bar:
        for _ in range(8):
            bar.update(1)
            bar.write("a line of its own", file=stream)  # what tqdm.write and log lines do
    text = stream.getvalue()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("reading:")]
    assert [line.split("|")[0] for line in lines] == [
        "reading:   0%", "reading:  25%", "reading:  50%", "reading:  75%", "reading: 100%"]
    assert [line.split("|")[1].split(" [")[0] for line in lines] == [
        " 0/8", " 2/8", " 4/8", " 6/8", " 8/8"]
    assert text.count("a line of its own\n") == 8


def test_off_a_terminal_the_last_line_says_where_it_stopped():
    stream = io.StringIO()
    with progress_bar(total=10, desc="files", file=stream, mininterval=0) as bar:
        bar.update(3)  # then stopped: an error, Ctrl-C
    assert [line.split("|")[0] for line in stream.getvalue().splitlines()] == [
        "files:   0%", "files:  30%"]
    stream = io.StringIO()
    with progress_bar(total=None, desc="bytes", unit="B", file=stream) as bar:
        bar.update(5)  # no total: a count and a rate, no percentage
    assert stream.getvalue().splitlines()[-1].startswith("bytes: 5B [")


def test_lines_false_and_progress_false_write_nothing():
    for kwargs in ({"lines": False}, {"progress": False}):
        stream = io.StringIO()
        with progress_bar(total=4, file=stream, **kwargs) as bar:
            bar.update(4)
        assert stream.getvalue() == "", kwargs


def test_on_a_terminal_a_bar():
    stream = _Terminal()
    with progress_bar(total=4, desc="reading", file=stream, mininterval=0) as bar:
        bar.update(4)
    # frames drawn over each other, each after a '\r'
    text = stream.getvalue()
    assert text.startswith("\rreading:   0%|") and "\rreading: 100%|" in text


@pytest.mark.slow
def test_tok_train_into_a_log_file(tmp_path):
    """The reported case: tok_train's bar in a log file was one long line of '\\r' frames."""
    data_dir = str(tmp_path / "shards")
    texts = [f"document {i} says hello to the tokenizer, number {i * 7}." for i in range(400)]
    write_shards(data_dir, [texts[:150], texts[150:300], texts[300:]], 25)
    log = _run_logged(["scripts.tok_train", "--vocab-size", "300", "--data-dir", data_dir,
                       "--out-dir", str(tmp_path / "tok")], str(tmp_path / "tok_train.log"))
    assert "\r" not in log
    reading = [line for line in log.splitlines() if line.startswith("reading:")]
    assert reading[0].startswith("reading:   0%| 0/12 [")  # 6 + 6 row groups of train
    assert reading[-1].startswith("reading: 100%| 12/12 [")
    assert len(reading) <= 5  # the start, then at most one line per quarter
    assert "trained on " in log and "saved tokenizer to " in log


def test_verify_into_a_log_file_counts_every_file(tmp_path):
    """--verify's bar ends at 100%: the checks are zipped with their paths, the bar asked first."""
    write_shards(str(tmp_path / "data"), [[f"doc {i}" for i in range(8)] for _ in range(5)], 4)
    log = _run_logged(["nanochat.dataset", "--verify", "--data-dir", str(tmp_path / "data")],
                      str(tmp_path / "verify.log"))
    assert "\r" not in log
    lines = [line.split("|")[0] for line in log.splitlines() if line.startswith("checking:")]
    assert lines[0] == "checking:   0%" and lines[-1] == "checking: 100%", log


def test_repackage_into_a_log_file(tmp_path):
    source = tmp_path / "docs.txt"
    source.write_text("".join(f"document number {i}\n\n" for i in range(50)))
    log = _run_logged(["nanochat.dataset", "repackage", str(source), "--out",
                       str(tmp_path / "shards"), "--docs-per-shard", "10"],
                      str(tmp_path / "repackage.log"))
    assert "\r" not in log
    lines = [line.split("|")[0] for line in log.splitlines() if line.startswith(("reading:",
                                                                                  "writing:"))]
    assert lines[0] == "reading:   0%" and lines[-1] == "writing: 100%"
    assert "reading: 100%" in lines


# -----------------------------------------------------------------------------
# --help names the command as it is run


def _commands() -> list[str]:
    scripts = sorted(name[:-3] for name in os.listdir(os.path.join(REPO_ROOT, "scripts"))
                     if name.endswith(".py")
                     and "\ndef main(" in open(os.path.join(REPO_ROOT, "scripts", name)).read())
    nanochat = ["dataset", "pretokenize", "tokenizer", "shard_cache", "mixture"]
    return [f"scripts.{name}" for name in scripts] + [f"nanochat.{name}" for name in nanochat]


def test_the_commands_are_all_there():
    assert {"scripts.tok_train", "scripts.tok_eval", "scripts.bench_dataloader",
            "scripts.record_behaviour", "nanochat.dataset"} <= set(_commands())


@pytest.mark.parametrize("command", _commands())
def test_help_names_the_command_as_it_is_run(command, capsys):
    module = importlib.import_module(command)
    main = (getattr(module, "main", None)
            or importlib.import_module("nanochat.data.mixtures.curriculum").main)
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {command} "), out[:200]


def test_help_from_a_subprocess_names_the_command(tmp_path):
    """As a user runs it: the usage line is the command typed, not the file's name."""
    done = subprocess.run([sys.executable, "-m", "scripts.tok_train", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m scripts.tok_train ")
