"""
Units written on worker processes (nanochat/data/processing/pair_workers.py): in this process or
on 2 spawned workers, each loading the job's tokenizer, each unit's PairResult handed back once,
the pairs the same either way; a worker killed mid-pair stops the run with one clear error and no
pair installed. Run:
    python -m pytest tests/data/processing/test_pair_workers.py -q
"""

import functools
import os

from conftest import ByteArrayTokenizer
from nanochat.data.processing.inputs import PairToWrite
from nanochat.data.processing.pair_workers import pair_results
from nanochat.data.processing.units import PretokenizeJob


def inputs(tmp_path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        path = tmp_path / "in" / f"{i}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f'{{"text": "document {i}"}}\n' * (i + 1))
        paths.append(str(path))
    return paths


def pairs_written(directory) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        if not name.startswith("."):
            with open(os.path.join(directory, name), "rb") as f:
                out[name] = f.read()
    return out


def test_in_this_process_and_on_two_workers(tmp_path):
    paths = inputs(tmp_path, 4)
    job = PretokenizeJob(paths, str(tmp_path), ByteArrayTokenizer, "unused")
    here = [PairToWrite(p, str(tmp_path / "here" / str(i))) for i, p in enumerate(paths)]
    results = list(pair_results(job, here, 1, 1))
    assert [r.source for r in results] == paths  # in order, in this process
    assert [r.stats["documents"] for r in results] == [1, 2, 3, 4]
    assert all(r.error is None for r in results)
    # on workers: each loads its tokenizer with the job's load_tokenizer
    there = [PairToWrite(p, str(tmp_path / "there" / str(i))) for i, p in enumerate(paths)]
    results = list(pair_results(job, there, 2, 1))
    assert sorted(r.source for r in results) == paths  # each once, in completion order
    assert sorted(r.stats["documents"] for r in results) == [1, 2, 3, 4]
    assert pairs_written(tmp_path / "there") == pairs_written(tmp_path / "here")


def test_a_worker_that_dies_stops_the_run_with_one_clear_error(tmp_path):
    import signal
    import threading
    import time

    from pausing_tokenizer import PausingTokenizer

    paths = inputs(tmp_path, 2)
    with open(paths[1], "w") as f:
        f.write('{"text": "PAUSE here"}\n')
    (tmp_path / "pause").write_text("")
    job = PretokenizeJob(paths, str(tmp_path), functools.partial(PausingTokenizer, str(tmp_path)),
                         "unused")
    units = [PairToWrite(p, str(tmp_path / "out" / str(i))) for i, p in enumerate(paths)]
    caught = []

    def run():
        try:
            list(pair_results(job, units, 2, 1))
        except ChildProcessError as e:
            caught.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.time() + 60
    while not (tmp_path / "pid").exists():
        assert time.time() < deadline, "the worker never paused"
        time.sleep(0.05)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    thread.join(60)
    assert [str(e) for e in caught] == [
        "a pretokenize worker process died (killed, or out of memory?); the pairs written are "
        "complete and no partial one is installed: rerun the same command to write the rest"]
    assert not os.path.exists(tmp_path / "out" / "1.idx")
