"""
Pairs written on worker processes (nanochat/data/processing/pair_workers.py): in this process
with the caller's tokenizer, or on 2 spawned workers that load theirs with load_tokenizer, each
input's PairResult handed back once, the pairs the same either way. Run:
    python -m pytest tests/data/processing/test_pair_workers.py -q
"""

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
