"""
Mixture buckets written in place by `python -m nanochat.pretokenize --bucket NAME`, and the
README's mixture walkthrough run as written: jsonl files -> one pretokenize run per bucket (train
and val) -> `python -m nanochat.mixture validate` -> batches from the mixture loader, every row
checked against its bucket's entries. Also where a bucket's settings and locks live, reruns, a
bucket of another tokenizer, and a bucket's pairs being byte for byte those of a plain run.
Hermetic: tiny jsonl files and a 300-token tokenizer trained in-process, all under tmp_path; the
walkthrough's CLIs run as real processes.
Run: python -m pytest tests/data/mixtures/test_buckets.py -q
"""

import json
import logging
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from filelock import FileLock

from conftest import sample_texts, worker_env
from nanochat.mixture import (BucketExhausted, CurriculumComplete,
                              pretokenized_mixture_loader_with_state_bos_bestfit as MIX)
from nanochat.pretokenize import main as pretokenize
from nanochat.data.pretokenized.token_shards import TokenShard
from nanochat.data.base.layout import list_token_shards
from nanochat.tokenizer import RustBPETokenizer

# each bucket writes its own kind of text, so that no entry of one bucket is an entry of another
WORDS = {"web": "the river stone cloud paper walks under over bright morning".split(),
         "code": "def return self if else for in range print None".split(),
         "math": "1 2 3 4 5 6 7 8 9 + - = x y".split()}


# a bucket's documents: 1 to ~60 of its words, some longer than the web bucket's windows
TEXTS = {bucket: dict(words=words, lengths=(1, 5, 15, 60), prefix=bucket)
         for bucket, words in WORDS.items()}
TOKENIZER_TEXTS = [t for b in WORDS for t in sample_texts(0, 60, **TEXTS[b])]


def _jsonl(path, texts) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def _files(directory) -> dict:
    """{relative path: bytes} of every file under directory, lock files included."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return out


def _entries(directory) -> dict[tuple, int]:
    """{entry tokens: overlap prefix} of every pair in directory."""
    out = {}
    for prefix in list_token_shards(directory):
        shard = TokenShard(prefix)
        for i in range(len(shard)):
            out[tuple(shard.entry(i).tolist())] = int(shard.overlaps[i])
    return out


def _segments(row: list[int], bos: int) -> list[tuple[int, list[int]]]:
    """(start, tokens) of each piece of a row that starts with BOS."""
    starts = [i for i, t in enumerate(row) if t == bos]
    return [(s, row[s:e]) for s, e in zip(starts, starts[1:] + [len(row)])]


# -----------------------------------------------------------------------------
# The README's walkthrough


@pytest.mark.slow
def test_readme_mixture_walkthrough(tmp_path, tokenizer_dir, monkeypatch, caplog):
    """The README's commands, in its order, with tiny sizes: three buckets written into one DATA by
    three pretokenize runs (web windowed, the others not), validate exits 0, and the loader's rows
    are pieces of the right bucket's entries, with the windows' repeated tokens masked."""
    work = tmp_path / "work"
    for seed, bucket in enumerate(WORDS):
        _jsonl(work / bucket / "part_0.jsonl", sample_texts(10 + seed, 40, **TEXTS[bucket]))
        _jsonl(work / bucket / "part_1.jsonl", sample_texts(20 + seed, 40, **TEXTS[bucket]))
        _jsonl(work / f"{bucket}_val.jsonl", sample_texts(30 + seed, 10, **TEXTS[bucket]))
    common = ["--tokenizer-dir", tokenizer_dir, "--num-workers", "1"]
    commands = [["--input", "web/", "--val-input", "web_val.jsonl", "--output", "DATA",
                 "--bucket", "web", "--max-length", "33", "--overlap-size", "8"],
                ["--input", "code/", "--val-input", "code_val.jsonl", "--output", "DATA",
                 "--bucket", "code"],
                ["--input", "math/", "--val-input", "math_val.jsonl", "--output", "DATA",
                 "--bucket", "math"]]
    for command in commands:
        done = subprocess.run([sys.executable, "-m", "nanochat.pretokenize", *command, *common],
                              cwd=work, env=worker_env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert "wrote 3/3 shards to DATA (bucket" in done.stdout
    for split, names in (("train", ["part_0", "part_1"]), ("val", ["web_val"])):
        assert list_token_shards(work / "DATA" / split / "web") == [
            str(work / "DATA" / split / "web" / n) for n in names]
    # no settings or lock shared by the buckets
    assert sorted(os.listdir(work / "DATA")) == ["train", "val"]
    B, T, steps = 4, 32, 16
    (work / "curriculum.yaml").write_text(
        "curriculum:\n"
        f"  - tokens: {steps // 2 * B * T}\n    mix: {{web: 0.7, code: 0.2, math: 0.1}}\n"
        f"  - tokens: {steps // 2 * B * T}\n    mix: {{web: 0.4, code: 0.4, math: 0.2}}\n")
    done = subprocess.run([sys.executable, "-m", "nanochat.mixture", "validate", "curriculum.yaml",
                           "--data", "DATA", "--tokens", str(steps * B * T), "--B", str(B),
                           "--T", str(T), "--world-size", "1"],
                          cwd=work, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "blocking problems: none" in done.stdout and done.stdout.count(" ok") == 6

    # the training script's loop, from the README, with world_size 1 on the CPU
    monkeypatch.chdir(work)
    world_size = 1
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    bos, vocab_size = tokenizer.get_bos_token_id(), tokenizer.get_vocab_size()
    entries = {b: _entries(os.path.join("DATA", "train", b)) for b in WORDS}
    assert (not set(entries["web"]) & set(entries["code"])
            and not set(entries["code"]) & set(entries["math"]))
    # web is windowed
    assert max(entries["web"].values()) == 8 and max(len(e) for e in entries["web"]) == 33
    assert max(len(e) for e in entries["code"]) > 33  # code is not
    caplog.set_level(logging.WARNING)
    loader = MIX(B, T, "train", "curriculum.yaml", data_dir="DATA", seed=0, device="cpu",
                 total_tokens=steps * B * T * world_size, resume_state_dict=None)
    seen, masked_seen, whole_seen = set(), 0, 0
    for step in range(steps):
        inputs, targets, state = next(loader)
        assert (inputs.shape == targets.shape == (B, T)
                and inputs.dtype == targets.dtype == torch.int64)
        assert state["phase"] == 1 + (step >= steps // 2)
        for i, bucket in enumerate(loader.stats["row_buckets"]):
            seen.add(bucket)
            row, target = inputs[i].tolist(), targets[i].tolist()
            assert row[0] == bos and max(row) < vocab_size and min(row) >= 0
            expected_mask = set()
            pieces = _segments(row, bos)
            for n, (start, piece) in enumerate(pieces):
                # whole entries of this bucket; only a row's last one may be cropped
                if n < len(pieces) - 1:
                    assert tuple(piece) in entries[bucket], (bucket, piece)
                    overlaps = {entries[bucket][tuple(piece)]}
                    whole_seen += 1
                else:
                    overlaps = {o for e, o in entries[bucket].items()
                                if list(e[:len(piece)]) == piece}
                    assert overlaps, (bucket, piece)  # a prefix of an entry of this bucket
                assert not any(tuple(piece) in entries[other]
                               for other in WORDS if other != bucket)
                # the targets predicting a window's repeated tokens are -100 (the last piece's
                # tokens past the row's end are unknown here: any of its candidates' overlaps will
                # do)
                expected_mask |= {start + k for k in range(min(overlaps)) if start + k < T - 1}
            masked = {j for j, t in enumerate(target) if t == -100}
            assert (expected_mask <= masked
                    and masked - expected_mask <= {j for j in range(pieces[-1][0], T)})
            masked_seen += len(masked)
            assert all(target[j] == row[j + 1] for j in range(T - 1) if j not in masked)
    # guards: every path was taken
    assert seen == set(WORDS) and masked_seen > 0 and whole_seen > 20
    with pytest.raises(CurriculumComplete):
        next(loader)
    # each bucket's pretokenize.json gave the vocabulary: no warning about ids checked by dtype only
    assert "no vocabulary size" not in caplog.text


def _long_texts(seed: int, n: int) -> list[str]:
    """n code documents of 40 to 58 words: 3 to 5 rows each at T=32."""
    rng = random.Random(seed)
    return [f"code {seed}-{i}: " + " ".join(rng.choice(WORDS["code"])
                                            for _ in range(rng.randint(40, 58)))
            for i in range(n)]


@pytest.mark.slow
def test_walkthrough_warns_before_a_long_document_bucket_runs_dry(tmp_path, tokenizer_dir,
                                                                  monkeypatch, caplog):
    """The walkthrough again, with a code bucket of a few long documents, not windowed: enough
    tokens for the curriculum, but cropped to one row each under long_doc_policy="crop" far too few
    are usable. validate warns (exits 1 with --strict), the loader warns at the call, before the
    first batch, with the same estimate; it then runs dry (BucketExhausted: its crop share and the
    fixes), and with long_doc_policy="split" it runs every step."""
    work = tmp_path / "work"
    for seed, bucket in enumerate(WORDS):
        texts = (_long_texts(10, 8) if bucket == "code"
                 else sample_texts(10 + seed, 40, **TEXTS[bucket]))
        _jsonl(work / bucket / "part_0.jsonl", texts)
        _jsonl(work / f"{bucket}_val.jsonl", sample_texts(30 + seed, 10, **TEXTS[bucket]))
    common = ["--output", "DATA", "--tokenizer-dir", tokenizer_dir, "--num-workers", "1"]
    for bucket, window in (("web", ["--max-length", "33", "--overlap-size", "8"]), ("code", []),
                           ("math", [])):
        done = subprocess.run([sys.executable, "-m", "nanochat.pretokenize", "--input",
                               f"{bucket}/", "--val-input", f"{bucket}_val.jsonl", "--bucket",
                               bucket, *window, *common],
                              cwd=work, env=worker_env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
    B, T, steps = 4, 32, 16
    code = [len(e) for e in _entries(work / "DATA" / "train" / "code")]
    # every code document is 3 to 5 rows long: enough tokens, but one row's worth of each usable
    assert len(code) == 8 and 3 * (T + 1) < min(code) and max(code) < 5 * (T + 1)
    usable = 8 * (T + 1)
    assert usable < (0.2 + 0.4) * steps // 2 * B * (T + 1) < sum(code)
    (work / "curriculum.yaml").write_text(
        "curriculum:\n"
        f"  - tokens: {steps // 2 * B * T}\n    mix: {{web: 0.7, code: 0.2, math: 0.1}}\n"
        f"  - tokens: {steps // 2 * B * T}\n    mix: {{web: 0.4, code: 0.4, math: 0.2}}\n")
    # code's 264 usable tokens last phase 1 (211 demanded) and 53 more: 128 of phase 2's trained
    # tokens at 0.4 x 33/32 a token, so job token 1,152 (step 10 of 16, 128 tokens a step)
    expected = (f"phase 2: bucket 'code' runs dry at about step 10 of 16: 634 tokens demanded by "
                f"the end of the phase, {sum(code):,} available; rows can take about 264 of them: "
                f"an estimated crop share of {1 - usable / sum(code):.2f} "
                "(long_doc_policy='crop', T=32); fixes: long_doc_policy=\"split\" (long documents "
                "in pieces, not cropped); or pretokenize the bucket in windows (--max-length 33); "
                "or give the bucket a lower weight or more data")
    validate = [sys.executable, "-m", "nanochat.mixture", "validate", "curriculum.yaml", "--data",
                "DATA", "--tokens", str(steps * B * T), "--B", str(B), "--T", str(T)]
    for strict, code_status in (([], 0), (["--strict"], 1)):
        done = subprocess.run(validate + strict, cwd=work, env=worker_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == code_status, done.stdout + done.stderr
        assert (f"{'error' if strict else 'warning'}: {expected}\n" in done.stdout
                and done.stdout.count("CROP") == 1)

    monkeypatch.chdir(work)
    caplog.set_level(logging.WARNING)
    loader = MIX(B, T, "train", "curriculum.yaml", data_dir="DATA", seed=0, device="cpu",
                 total_tokens=steps * B * T, resume_state_dict=None)
    # logged at the call: before step 1
    assert [r.getMessage() for r in caplog.records
            if r.name == "nanochat.data.mixtures.mixture_plan"] == [
        "mixture: " + expected]
    done_steps = 0
    with pytest.raises(BucketExhausted) as stop:
        for _ in range(steps):
            next(loader)
            done_steps += 1
    # (the estimate is a lower bound on the crop, so it may run dry before the step it names; on
    # this data it is that step: 9 steps done, the 10th cannot be filled)
    assert stop.value.bucket == "code" and done_steps == 9
    assert re.fullmatch(r"bucket 'code' ran dry on this rank \(its crop share so far: 0\.\d\d\); "
                        r".* the fixes: long_doc_policy=\"split\" .*--max-length 33.*lower weight"
                        r" or more data", str(stop.value))
    share = float(re.search(r"so far: (0\.\d\d)", str(stop.value)).group(1))
    assert share >= round(1 - usable / sum(code), 2)
    # the first fix runs the curriculum whole
    loader = MIX(B, T, "train", "curriculum.yaml", data_dir="DATA", seed=0, device="cpu",
                 total_tokens=steps * B * T, long_doc_policy="split")
    for _ in range(steps):
        next(loader)
    with pytest.raises(CurriculumComplete):
        next(loader)


# -----------------------------------------------------------------------------
# Where a bucket's files go, reruns, and what is refused


@pytest.fixture
def inputs(tmp_path):
    return {"train": _jsonl(tmp_path / "in" / "a.jsonl", sample_texts(1, 30, **TEXTS["web"])),
            "val": _jsonl(tmp_path / "in" / "v.jsonl", sample_texts(2, 8, **TEXTS["web"]))}


def _run(inputs, output, tokenizer_dir, *extra) -> int:
    return pretokenize(["--input", inputs["train"], "--val-input", inputs["val"],
                        "--output", str(output), "--tokenizer-dir", tokenizer_dir,
                        "--num-workers", "1", *extra])


def test_a_bucket_is_a_plain_runs_pairs_in_place(inputs, tmp_path, tokenizer_dir, capsys):
    assert _run(inputs, tmp_path / "plain", tokenizer_dir, "--max-length", "24",
                "--overlap-size", "4") == 0
    assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--max-length", "24",
                "--overlap-size", "4", "--bucket", "web") == 0
    plain, bucket = _files(tmp_path / "plain"), _files(tmp_path / "DATA")
    assert sorted(bucket) == ["train/web/.a.lock", "train/web/.pretokenize.lock", "train/web/a.bin",
                              "train/web/a.idx", "train/web/pretokenize.json", "val/web/.v.lock",
                              "val/web/pretokenize.json", "val/web/v.bin", "val/web/v.idx"]
    # the same bytes, in the bucket's directories
    for split, name in (("train", "a"), ("val", "v")):
        for ext in (".bin", ".idx"):
            assert bucket[f"{split}/web/{name}{ext}"] == plain[f"{split}/{name}{ext}"]
        assert bucket[f"{split}/web/pretokenize.json"] == plain["pretokenize.json"]
    assert json.loads(plain["pretokenize.json"])["max_length"] == 24
    # the plain run's layout: settings and lock at the top
    assert sorted(plain) == [".pretokenize.lock", "pretokenize.json", "train/.a.lock",
                             "train/a.bin", "train/a.idx", "val/.v.lock", "val/v.bin",
                             "val/v.idx"]
    capsys.readouterr()

    # a rerun skips what is there; with other windowing it is refused, naming the bucket's settings
    assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--max-length", "24",
                "--overlap-size", "4", "--bucket", "web") == 0
    assert "2 already done" in capsys.readouterr().out
    assert _files(tmp_path / "DATA") == bucket
    settings = tmp_path / "DATA" / "train" / "web" / "pretokenize.json"
    with pytest.raises(ValueError, match=re.escape(str(settings)) + " records other settings "
                                         ".*max_length 24 -> None.*another --bucket name"):
        _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "web")
    # another bucket, windowed otherwise, shares the output
    assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "web_whole") == 0
    assert json.loads((tmp_path / "DATA" / "val" / "web_whole" / "pretokenize.json")
                      .read_text())["max_length"] is None
    # the first bucket untouched
    assert _files(tmp_path / "DATA").items() >= bucket.items()


def test_a_bucket_of_another_tokenizer_is_refused(inputs, tmp_path, tokenizer_dir):
    assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "web") == 0
    other = str(tmp_path / "other_tokenizer")
    RustBPETokenizer.train_from_iterator(iter(sample_texts(0, 60, **TEXTS["math"])),
                                         280).save(other)
    before = _files(tmp_path / "DATA")
    with pytest.raises(ValueError, match=r"DATA/train/web/pretokenize.json records another "
                                         r"tokenizer .*tokenizer_sha256 .*vocab_size"):
        _run(inputs, tmp_path / "DATA", other, "--bucket", "math")
    assert _files(tmp_path / "DATA") == before  # nothing written, no directory made


def test_each_bucket_has_its_own_lock(inputs, tmp_path, tokenizer_dir):
    """Runs of different buckets on one output go on at once; a second run of one bucket is
    refused."""
    os.makedirs(tmp_path / "DATA" / "train" / "web")
    # a run writing web
    with FileLock(str(tmp_path / "DATA" / "train" / "web" / ".pretokenize.lock")):
        assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "code",
                    "--lock-timeout", "0") == 0
        with pytest.raises(TimeoutError, match="writing to "
                           + re.escape(str(tmp_path / "DATA" / "train" / "web"))):
            _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "web", "--lock-timeout", "0")
    assert list_token_shards(tmp_path / "DATA" / "train" / "code") == [
        str(tmp_path / "DATA" / "train" / "code" / "a")]
    assert not list_token_shards(tmp_path / "DATA" / "train" / "web")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_bucket_names_are_directory_names(inputs, tmp_path, tokenizer_dir, capsys, name):
    with pytest.raises(SystemExit) as info:
        _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", name)
    assert info.value.code == 2
    assert f"--bucket must be a directory name (no '/'), got {name!r}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "DATA")


def test_bucket_entries_are_the_documents(inputs, tmp_path, tokenizer_dir):
    """Token for token: each entry is [BOS] + the document's tokens, in input order, in both
    splits."""
    assert _run(inputs, tmp_path / "DATA", tokenizer_dir, "--bucket", "web") == 0
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    for split, name, texts in (("train", "a", sample_texts(1, 30, **TEXTS["web"])),
                               ("val", "v", sample_texts(2, 8, **TEXTS["web"]))):
        shard = TokenShard(tmp_path / "DATA" / split / "web" / name)
        expected = tokenizer.encode_to_arrays(texts, prepend=tokenizer.get_bos_token_id(),
                                              num_threads=1)
        assert ([shard.entry(i).tolist() for i in range(len(shard))]
                == [e.tolist() for e in expected])
        assert not np.asarray(shard.overlaps).any()
