"""
The two calls any engine drives (nanochat/data/processing/units.py): plan_units lists every unit of
a job once its output is checked and its settings recorded, and tokenize_unit writes one unit's
pair. Driven as another engine would (threads, in reverse order, each unit twice), the output equals
the command's byte for byte; a written unit comes back with no counts, a bad input with its error
(not raised); a tokenizer retrained in place is loaded again; and pretokenize_job checks its
arguments as the command does. Run:
    python -m pytest tests/data/processing/test_units.py -q
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ByteArrayTokenizer, output_files
from nanochat import pretokenize
from nanochat.data.processing.pretokenize_run import PretokenizeRun, run_pretokenize
from nanochat.data.processing import units
from nanochat.data.processing.units import PretokenizeJob, plan_units, tokenize_unit


def test_another_engine_writes_what_the_command_writes(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, n in (("a", 300), ("b", 5), ("c", 1)):
        (raw / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{name} document {i}"}) + "\n" for i in range(n)))
    (tmp_path / "val.jsonl").write_text('{"text": "val"}\n')

    def job(out):
        return PretokenizeJob([str(raw)], str(tmp_path / out), ByteArrayTokenizer,
                              str(tmp_path / "val.jsonl"), val_inputs=[str(tmp_path / "val.jsonl")],
                              max_length=16, overlap=4, unit_bytes=2048)

    assert run_pretokenize(PretokenizeRun(job("command"), 2, 0, 1, 0.0)) == 0
    engine = job("engine")
    units = plan_units(engine)
    assert os.path.exists(tmp_path / "engine" / "pretokenize.json")  # recorded by the plan
    parts = -(-os.path.getsize(raw / "a.jsonl") // 2048)  # a is split, the others whole
    assert parts > 1 and [os.path.basename(u.prefix) for u in units] == [
        f"a.part-{k:05d}-of-{parts:05d}" for k in range(parts)] + ["b", "c", "val"]
    with ThreadPoolExecutor(4) as pool:  # in reverse order, each unit twice at once
        results = list(pool.map(lambda u: tokenize_unit(engine, u), units[::-1] * 2))
    assert all(r.error is None for r in results)
    written = [r for r in results if r.stats is not None]
    assert len(written) == len(units)  # once each: the other writer found the pair done
    assert output_files(tmp_path / "engine") == output_files(tmp_path / "command")
    # a bad input's error comes back, for the engine not to retry it
    (raw / "d.jsonl").write_text("not json\n")
    bad = [u for u in plan_units(engine) if u.source.endswith("d.jsonl")]
    assert tokenize_unit(engine, bad[0]).error.startswith("ValueError: ")


def test_pretokenize_job_checks_its_arguments(tmp_path):
    job = pretokenize.pretokenize_job(["~/in"], "~/out", tokenizer_dir=str(tmp_path), unit_mb=1)
    assert job.inputs == [os.path.expanduser("~/in")] and job.unit_bytes == 2**20
    assert job.tokenizer_file == os.path.join(str(tmp_path), pretokenize.TOKENIZER_FILENAME)
    # absolute for workers that run elsewhere (the command's Ray executor); a store's address as is
    job = pretokenize.pretokenize_job(["in", "s3://b/in"], "out", tokenizer_dir="tok",
                                      absolute=True)
    assert job.inputs == [os.path.abspath("in"), "s3://b/in"] and job.output == os.path.abspath(
        "out") and job.tokenizer_file == os.path.join(os.path.abspath("tok"), "tokenizer.json")
    assert pretokenize.pretokenize_job(["in"], "out").output == "out"  # as given, for messages
    for kwargs, message in (({"max_length": 8, "overlap_size": 5}, "overlap_size 5 must be"),
                            ({"overlap_size": 2}, "overlap_size 2 needs max_length"),
                            ({"convention": "gpt"}, "convention must be one of"),
                            ({"unit_mb": 0}, "unit_mb must be a number of MB > 0"),
                            ({"unit_mb": float("inf")}, "unit_mb must be a number of MB > 0")):
        with pytest.raises(ValueError, match=message):
            pretokenize.pretokenize_job(["in"], "out", tokenizer_dir=str(tmp_path), **kwargs)
    assert pretokenize.pretokenize_job(["in"], "out", unit_mb=None).unit_bytes is None


def test_a_tokenizer_retrained_in_place_is_loaded_again(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "abc"}\n')
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text("one")
    job = PretokenizeJob([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), ByteArrayTokenizer,
                         str(tokenizer_file))
    first = units.job_tokenizer(job)
    assert units.job_tokenizer(job) is first  # once per process
    tokenizer_file.write_text("retrained")
    os.utime(tokenizer_file, ns=(0, os.stat(tokenizer_file).st_mtime_ns + 10**9))
    assert units.job_tokenizer(job) is not first
