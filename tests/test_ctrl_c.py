"""
Ctrl-C on a command line: one line on stderr that says what stopped and what a rerun does, exit
status 130, never a traceback; and nothing is lost: a rerun ends with the bytes of a run never
stopped. Every command line (`python -m nanochat.X`, `python -m scripts.X`) ends through
nanochat.data.base.cli.run; the download and repackage are stopped here for real, by SIGINT to their
process group, as a terminal sends it (pretokenize: tests/test_pretokenize.py; serve:
tests/data/fetch/test_own_shards.py). Run: python -m pytest tests/test_ctrl_c.py -q   (about 20 s)
"""

import ast
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, assert_interrupted, ctrl_c, write_shard
from nanochat.data.base.datasets import list_parquet_files
from nanochat.dataset import interrupted
from nanochat.data.fetch.serve import ShardServer, Throttle

# the one command line that is not a person's: the loader's worker process, which ignores Ctrl-C
# (its trainer decides, and closes it)
NOT_COMMANDS = {"nanochat/data/loader/worker.py"}


def _commands() -> list[str]:
    return sorted(f"{folder}/{name}" for folder in ("nanochat", "scripts")
                  for name in os.listdir(os.path.join(REPO_ROOT, folder))
                  if name.endswith(".py") and f"{folder}/{name}" not in NOT_COMMANDS
                  and 'if __name__ == "__main__":'
                  in open(os.path.join(REPO_ROOT, folder, name)).read())


def _calls(nodes) -> set[str]:
    return {node.func.id for tree in nodes for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


@pytest.mark.parametrize("path", _commands())
def test_every_command_line_ends_through_cli_run(path):
    tree = ast.parse(open(os.path.join(REPO_ROOT, path)).read())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and ast.unparse(node.test) == "__name__ == '__main__'")
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    called = _calls([block])
    # run() itself, or a function of the module that calls it (pretokenize's command())
    called |= _calls([functions[name] for name in called if name in functions])
    assert "run" in called, f"{path}'s __main__ does not end through nanochat.data.base.cli.run"
    imported = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "nanochat.data.base.cli" for alias in node.names}
    assert "run" in imported
    # and nothing else at the top of the module takes the name: a def run() of its own would be
    # what __main__ calls
    others = [node.lineno for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == "run"
              or isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "run"
                                                      for t in node.targets)
              or isinstance(node, (ast.Import, ast.ImportFrom))
              and getattr(node, "module", None) != "nanochat.data.base.cli"
              and any((alias.asname or alias.name) == "run" for alias in node.names)]
    assert not others, f"{path} binds run again at line(s) {others}, hiding cli.run"


RUN = """
import sys, time
from nanochat.data.base.cli import run

def main():
    open(sys.argv[1], "w").close()  # under way
    time.sleep(60)

run(main, "sleep stopped; it changes nothing: rerun it")
"""


def test_run_says_what_stopped_in_one_line_and_exits_130(tmp_path):
    ready = tmp_path / "ready"
    code, out, err = ctrl_c([sys.executable, "-c", RUN, str(ready)], ready.exists, cwd=REPO_ROOT)
    assert_interrupted(code, err, "interrupted: sleep stopped; it changes nothing: rerun it")
    assert out == ""


def test_each_subcommand_of_the_dataset_says_what_it_stopped():
    assert interrupted(["-n", "8"]).startswith("the download stopped; ")
    assert interrupted(["--verify"]).startswith("--verify stopped; it changes nothing")
    assert interrupted(["--ver", "--data-dir", "x"]).startswith("--verify stopped")  # (argparse's)
    assert interrupted(["repackage", "a.jsonl", "--out", "x"]).startswith("repackage stopped; ")
    assert interrupted(["serve", "x"]).startswith("serve stopped; ")


# -----------------------------------------------------------------------------
# The download: stopped mid-way, then resumed


def _host(directory) -> dict[str, bytes]:
    """Four shards under the default dataset's names (three train, then val), ~0.2 MB each."""
    rng = random.Random(0)
    os.makedirs(directory)
    for i in (0, 1, 2, 6542):
        write_shard(os.path.join(directory, f"shard_{i:05d}.parquet"),
                    ["".join(rng.choice("abcdefghij ") for _ in range(2000)) for _ in range(200)],
                    50)
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}


@pytest.mark.slow
def test_ctrl_c_on_a_download_then_a_rerun_resumes_it(tmp_path):
    hosted = _host(tmp_path / "hosted")
    server = ShardServer(str(tmp_path / "hosted"), rate=200e3)  # ~4 s for the whole download
    data = tmp_path / "data"
    command = [sys.executable, "-m", "nanochat.dataset", "-n", "3", "-w", "2",
               "--base-url", server.url, "--data-dir", str(data)]
    try:
        # stopped once its first shard is installed, and another on its way
        def under_way():
            names = os.listdir(data) if data.is_dir() else []
            return "shard_00000.parquet" in names and any(n.endswith(".tmp") for n in names)

        code, _, err = ctrl_c(command, under_way, cwd=REPO_ROOT)
        assert_interrupted(code, err, "interrupted: " + interrupted(command[3:]))
        installed = {n for n in os.listdir(data) if n.endswith(".parquet")}
        partial = {n.removesuffix(".tmp") for n in os.listdir(data) if n.endswith(".parquet.tmp")}
        assert installed < set(hosted) and partial, "it was not stopped mid-way"
        for name in installed:  # what it installed is whole
            assert (data / name).read_bytes() == hosted[name]
        server.throttle = Throttle(None)
        before = len(server.gets)
        # the same command again, to its end
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        # the partial downloads resumed where they were: a ranged request each
        ranged = {name for name, wanted in server.gets[before:] if wanted}
        assert partial <= ranged
    finally:
        server.close()
    assert sorted(os.listdir(data)) == sorted(
        [n for n in hosted] + [n + ".json" for n in hosted] + [f".{n}.lock" for n in hosted])
    for name, data_bytes in hosted.items():
        assert (data / name).read_bytes() == data_bytes


# the files bar takes 5 s to write its first line (one file of four: "files:  25%"), so Ctrl-C lands
# while it is drawn with tqdm's lock held; the other worker then logs its file's end through that
# lock (logging_redirect_tqdm), and a new file's bar takes it too
SLOW_BAR = """
import os, runpy, sys, time
class SlowBar:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if text.startswith("files:  25%"):
            open(os.environ["DRAWING"], "w").close()
            time.sleep(5)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = SlowBar(sys.stderr)
sys.argv = ["python -m nanochat.dataset"] + sys.argv[1:]
runpy.run_module("nanochat.dataset", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_the_files_bar_is_drawn_ends_the_download(tmp_path):
    hosted = _host(tmp_path / "hosted")
    server = ShardServer(str(tmp_path / "hosted"), rate=200e3)
    data, drawing = tmp_path / "data", tmp_path / "drawing"
    args = ["-n", "3", "-w", "2", "--base-url", server.url, "--data-dir", str(data)]
    try:
        # the first line is being drawn, and both first files are in (the second one's log waits)
        def drawn():
            return drawing.exists() and all((data / f"shard_0000{i}.parquet").exists()
                                            for i in (0, 1))

        code, _, err = ctrl_c([sys.executable, "-c", SLOW_BAR] + args, drawn,
                              cwd=REPO_ROOT, env=dict(os.environ, DRAWING=str(drawing)))
    finally:
        server.close()
    assert_interrupted(code, err, "interrupted: " + interrupted(args))
    installed = [n for n in os.listdir(data) if n.endswith(".parquet")]
    assert installed and set(installed) < set(hosted)
    for name in installed:  # what it installed is whole
        assert (data / name).read_bytes() == hosted[name]


# -----------------------------------------------------------------------------
# repackage: stopped while it writes shards, then run again

SLOW_REPACKAGE = """
import runpy, sys, time
import pyarrow.parquet as pq
write_table = pq.write_table
def slow(*args, **kwargs):  # 0.3 s a shard: a run of 12 shards lasts ~4 s
    write_table(*args, **kwargs)
    time.sleep(0.3)
pq.write_table = slow
sys.argv = ["python -m nanochat.dataset"] + sys.argv[1:]
runpy.run_module("nanochat.dataset", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_on_repackage_leaves_no_shard_and_a_rerun_writes_them_all(tmp_path):
    rng = random.Random(2)
    with open(tmp_path / "my.jsonl", "w") as f:
        for j in range(600):
            f.write(json.dumps({"text": f"doc {j} " + "word " * rng.randint(1, 50)}) + "\n")
    args = ["repackage", str(tmp_path / "my.jsonl"), "--out", str(tmp_path / "out"),
            "--docs-per-shard", "50"]
    out = tmp_path / "out"
    code, _, err = ctrl_c([sys.executable, "-c", SLOW_REPACKAGE] + args,
                          lambda: (out / "shard_00001.parquet").exists(), cwd=REPO_ROOT)
    assert_interrupted(code, err, "interrupted: " + interrupted(args))
    # a part of the shards would be read with the wrong val (its last): none is left, nor a .tmp
    assert os.listdir(out) == []
    for directory in ("out", "clean"):  # the same command again, and a run never stopped
        done = subprocess.run([sys.executable, "-m", "nanochat.dataset"] + args[:3]
                              + [str(tmp_path / directory), "--docs-per-shard", "50"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    shards = list_parquet_files(str(out))
    assert len(shards) == 12
    assert [open(p, "rb").read() for p in shards] == [
        open(p, "rb").read() for p in list_parquet_files(str(tmp_path / "clean"))]
