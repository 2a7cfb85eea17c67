"""
pretokenize on a real Ray cluster (nanochat/data/processing/ray_executor.py): one local cluster for
the module (ray.init(num_cpus=2), offline). Its output equals the local executor's byte for byte,
parts of a split input included; a task's worker killed with kill -9 in the middle of a pair is
retried, and no partial pair is installed; a driver killed in the middle takes its tasks with it,
and a rerun skips the written pairs and completes identical; a corrupt input and a task that raises
fail once, named, the other pairs installed; a store's shards (moto's S3) are read by the tasks;
the command with no address starts a cluster of its own; without Ray, --executor ray is one line.
Run:
    python -m pytest tests/data/processing/test_ray_executor.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import _s3_env, output_files
from pausing_tokenizer import pausing_job, run_job
from nanochat.pretokenize import main

ray = pytest.importorskip("ray")  # a dev requirement: CI has it

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_TEXTS = [f"document {i} about ray tasks and their retries" for i in range(200)]
TEXTS = {"prefix": "ray"}  # parquet_dir's documents


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):
    """A local Ray cluster of 2 CPUs for the module. Its workers inherit this process's environment
    as it is now: the tests' modules on the path, the S3 endpoint of the session's moto server."""
    with pytest.MonkeyPatch.context() as mp:
        _s3_env(mp, tmp_path_factory.mktemp("aws"), s3_server.endpoint)
        mp.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def jsonl_inputs(directory, pause_at: str | None = None, **extra: str):
    """a.jsonl of 1100 documents (two encode batches; the second starts with pause_at), and
    b.jsonl, c.jsonl of a few; extra: more files, name -> their text."""
    os.makedirs(directory, exist_ok=True)
    lines = [f"document {i} of a" for i in range(1100)]
    if pause_at:
        lines[1024] = pause_at + " " + lines[1024]
    files = {"a.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in lines),
             "b.jsonl": '{"text": "bee"}\n{"text": "buzz"}\n', "c.jsonl": '{"text": "sea"}\n',
             **extra}
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return str(directory)


def wait_for(path, timeout=60.0) -> str:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} did not appear in {timeout:g}s"
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


def test_a_ray_run_equals_a_local_run(cluster, parquet_dir, tokenizer_dir, tmp_path, capsys):
    argv = ["--input", parquet_dir, "--tokenizer-dir", tokenizer_dir, "--max-length", "16",
            "--overlap-size", "4", "--unit-mb", "0.001"]  # every parquet shard in parts
    local, on_ray = str(tmp_path / "local"), str(tmp_path / "ray")
    assert main(argv + ["--output", local, "--num-workers", "1"]) == 0
    capsys.readouterr()
    assert main(argv + ["--output", on_ray, "--executor", "ray"]) == 0
    printed = capsys.readouterr()
    assert "on Ray (a cluster on this machine)" in printed.out and "0 skipped" in printed.out
    assert "pretokenize: 100%" in printed.err  # the driver's bar
    files = output_files(on_ray)
    assert files == output_files(local) and "pretokenize.json" in files
    assert "train/shard_00000.part-00000-of-00004.idx" in files  # split: row groups of 8 of 30


def paused_driver(tmp_path, cluster, **popen):
    """The local executor's output of jsonl_inputs in tmp_path/local, then a driver process running
    the job on Ray into tmp_path/ray, its task on a.jsonl paused in the middle of the pair: (the
    inputs, the pause directory, the output, the driver, the paused worker's pid)."""
    inputs = jsonl_inputs(tmp_path / "in", pause_at="PAUSE")
    pause = tmp_path / "pause"
    pause.mkdir()
    assert run_job(pausing_job(inputs, str(tmp_path / "local"), str(pause)), "local") == 0
    (pause / "pause").write_text("")
    out = tmp_path / "ray"
    driver = subprocess.Popen([sys.executable, os.path.join(TESTS, "pausing_tokenizer.py"),
                               inputs, str(out), str(pause), cluster], **popen)
    try:
        return inputs, pause, out, driver, int(wait_for(pause / "pid"))
    except BaseException:
        driver.kill()
        raise


def test_a_killed_worker_is_retried_and_no_partial_pair_is_installed(cluster, tmp_path):
    _, pause, out, driver, worker = paused_driver(tmp_path, cluster, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True)
    try:
        # in the middle of a's pair: its first batch is in the temporary file, no pair installed
        assert os.path.getsize(out / "train" / "a.bin.tmp") > 0
        assert not os.path.exists(out / "train" / "a.idx")
        os.kill(worker, signal.SIGKILL)
        (pause / "pause").unlink()  # the retry goes through
        printed, _ = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 0, printed
    assert "wrote 3/3 shards" in printed, printed
    assert output_files(out) == output_files(tmp_path / "local")
    assert not [n for n in os.listdir(out / "train") if n.endswith(".tmp")]


def test_a_killed_driver_takes_its_tasks_and_a_rerun_completes(cluster, tmp_path, capsys):
    inputs, pause, out, driver, worker = paused_driver(
        tmp_path, cluster, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(out / "train" / "b.idx"), wait_for(out / "train" / "c.idx")
    finally:
        driver.kill()  # kill -9
    driver.wait()
    # Ray ends the dead driver's tasks: the paused worker goes too, its pair never installed
    deadline = time.time() + 60
    while _alive(worker):
        assert time.time() < deadline, f"the dead driver's task (pid {worker}) still runs"
        time.sleep(0.1)
    assert not os.path.exists(out / "train" / "a.idx")
    (pause / "pause").unlink()
    capsys.readouterr()
    assert run_job(pausing_job(inputs, str(out), str(pause)), "ray", cluster) == 0
    assert "2 already done (their .idx exists), skipped; 1 to write" in capsys.readouterr().out
    assert output_files(out) == output_files(tmp_path / "local")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by its parent) is gone for our purpose
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_corrupt_input_and_a_raising_task_fail_once_and_alone(cluster, tmp_path, capsys):
    inputs = jsonl_inputs(tmp_path / "in", **{"d.jsonl": '{"text": "fine"}\n{"text": \n',
                                              "e.jsonl": '{"text": "RAISE now"}\n'})
    pause = tmp_path / "pause"
    pause.mkdir()
    out = tmp_path / "ray"
    assert run_job(pausing_job(inputs, str(out), str(pause)), "ray", cluster) == 1
    printed = capsys.readouterr().out
    assert f"failed: {inputs}/d.jsonl: ValueError: {inputs}/d.jsonl line 2: invalid JSON" in printed
    assert (f"failed: {inputs}/e.jsonl: the task raised RuntimeError: a tokenizer bug, raised on "
            "purpose") in printed
    assert "wrote 3/5 shards" in printed
    assert printed.rstrip().endswith("failed (2): d.jsonl, e.jsonl")
    assert sorted(n for n in os.listdir(out / "train") if n.endswith(".idx")) == [
        "a.idx", "b.idx", "c.idx"]


def test_a_stores_shards_are_read_by_the_tasks(cluster, s3, parquet_dir, tokenizer_dir, tmp_path):
    for name in sorted(os.listdir(parquet_dir)):
        s3.upload(os.path.join(parquet_dir, name), f"data/{name}")
    argv = ["--tokenizer-dir", tokenizer_dir, "--num-workers", "1"]
    assert main(argv + ["--input", parquet_dir, "--output", str(tmp_path / "local")]) == 0
    assert main(argv + ["--input", s3.url("data"), "--output", str(tmp_path / "ray"),
                        "--executor", "ray"]) == 0
    assert output_files(tmp_path / "ray") == output_files(tmp_path / "local")
    assert not os.listdir(tmp_path / "ray" / ".inputs" / "train")  # each staged copy removed


def test_with_no_address_the_command_starts_a_cluster_of_its_own(cluster, tokenizer_dir,
                                                                 tmp_path):
    inputs = jsonl_inputs(tmp_path / "in")
    argv = ["--input", inputs, "--tokenizer-dir", tokenizer_dir]
    assert main(argv + ["--output", str(tmp_path / "local"), "--num-workers", "1"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "nanochat.pretokenize", *argv, "--output",
                           "ray", "--executor", "ray"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "to write on Ray (a cluster on this machine)" in done.stdout
    assert "Started a local Ray instance" in done.stderr  # its own, not the module's
    assert output_files(tmp_path / "ray") == output_files(tmp_path / "local")


def test_without_ray_the_executor_is_one_line(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from nanochat.pretokenize import command; "
            "command()")
    jsonl_inputs(tmp_path / "in")
    done = subprocess.run([sys.executable, "-c", code, "--input", str(tmp_path / "in"),
                           "--output", str(tmp_path / "out"), "--executor", "ray",
                           "--tokenizer-dir", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--executor ray needs Ray: pip install 'nanochat-data[ray]'"), done.stderr
