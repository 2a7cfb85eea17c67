"""
One pretokenize run (nanochat/data/processing/pretokenize_run.py) from a PretokenizeRun record:
the pairs and pretokenize.json written, the summary printed, a rerun skipping what is done, a rank
writing only its share, and a bad input failing alone (exit status 1). A byte-level tokenizer
under tmp_path; the command line's own tests are in tests/test_pretokenize.py. Run:
    python -m pytest tests/data/processing/test_pretokenize_run.py -q
"""

import dataclasses
import json
import os

from conftest import ByteArrayTokenizer
from nanochat.data.processing.pretokenize_run import PretokenizeRun, run_pretokenize
from nanochat.data.processing.units import PretokenizeJob
from nanochat.data.base.layout import list_token_shards


def a_run(tmp_path, **changes) -> PretokenizeRun:
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    for name in ("a", "b", "c"):
        (raw / f"{name}.jsonl").write_text(json.dumps({"text": f"text of {name}"}) + "\n")
    tokenizer_file = tmp_path / "tokenizer.pkl"
    tokenizer_file.write_bytes(b"bytes")
    job = PretokenizeJob(inputs=[str(raw)], output=str(tmp_path / "out"),
                         load_tokenizer=ByteArrayTokenizer, tokenizer_file=str(tokenizer_file))
    run = PretokenizeRun(job=job, num_workers=1, rank=0, world_size=1, lock_timeout=0.0)
    return dataclasses.replace(run, **changes)


def test_a_run_then_a_rerun(tmp_path, capsys):
    run = a_run(tmp_path)
    assert run_pretokenize(run) == 0
    out = capsys.readouterr().out
    assert "3 inputs in 3 units of work, 3 for this run; 0 already done (their .idx exists), " \
           "skipped; 3 to write on 1 process" in out
    assert "wrote 3/3 shards to " + run.job.output in out and "3 documents -> 3 entries" in out
    train = os.path.join(run.job.output, "train")
    assert list_token_shards(train) == [os.path.join(train, n) for n in ("a", "b", "c")]
    with open(os.path.join(run.job.output, "pretokenize.json")) as f:
        assert json.load(f)["vocab_size"] == 257
    assert run_pretokenize(run) == 0
    assert "3 already done (their .idx exists), skipped; 0 to write" in capsys.readouterr().out


def test_a_rank_writes_its_share_and_a_bad_input_fails_alone(tmp_path, capsys):
    run = a_run(tmp_path, rank=1, world_size=2)
    assert run_pretokenize(run) == 0
    assert "3 inputs in 3 units of work, 1 for rank 1/2" in capsys.readouterr().out
    assert list_token_shards(os.path.join(run.job.output, "train")) == [
        os.path.join(run.job.output, "train", "b")]
    (tmp_path / "raw" / "d.jsonl").write_text('{"text": \n')
    run = dataclasses.replace(run, rank=0, world_size=1)
    assert run_pretokenize(run) == 1
    out = capsys.readouterr().out
    assert "wrote 2/3 shards" in out and out.rstrip().endswith("failed (1): d.jsonl")
