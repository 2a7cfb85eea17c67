"""
`python -m nanochat.pretokenize` end to end (nanochat/pretokenize.py and the run it drives):
parquet and jsonl inputs, windowed and whole, 2 worker processes, --convention, rerun-skips, resume
after a killed run or Ctrl-C (one line, exit status 130), --rank/--world-size, two runs on one
output, a dead worker, and bad arguments. The format and the windows have their own tests in
tests/data/pretokenized/. Hermetic: tiny shards and a 300-token tokenizer trained in-process, all
under tmp_path. Run:
    python -m pytest tests/test_pretokenize.py -q
"""

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (TESTS, assert_interrupted, ctrl_c, gpt_simple_windows, sample_texts,
                      worker_env)
from nanochat.data.processing import pair_workers
from nanochat.data.pretokenized.token_shards import TokenShard
from nanochat.data.base.layout import list_token_shards
from nanochat.data.processing.windows import window_document
from nanochat.pretokenize import INTERRUPTED, main
from nanochat.tokenizer import RustBPETokenizer


# documents of 0 to ~120 words, so that some are longer than the windows used below; an empty
# document is kept: it becomes a lone BOS
TEXTS = dict(words=("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "token",
                    "shard", "é", "42"), lengths=(3, 10, 40, 120), empty_middle=True)
TOKENIZER_TEXTS = [t for seed in range(3) for t in sample_texts(seed, 40, **TEXTS)]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return RustBPETokenizer.from_directory(tokenizer_dir)


def _files(directory) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under directory but the lock files: the
    output's, which every run rewrites (it names the run holding the output), and each pair's
    (.<name>.lock)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name.startswith(".") and name.endswith(".lock"):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


# -----------------------------------------------------------------------------
# The command line


def _expected_entries(tokenizer, texts, max_length, overlap) -> list[tuple[list[int], int]]:
    docs = tokenizer.encode_to_arrays(texts, prepend=tokenizer.get_bos_token_id(), num_threads=1)
    if max_length is None:
        return [(d.tolist(), 0) for d in docs]
    return [(w.tolist(), o) for d in docs for w, o in window_document(d, max_length, overlap)]


def _rebuild_documents(shard: TokenShard) -> list[list[int]]:
    """Documents from entries, when overlap > 0: a window with an overlap prefix continues a
    document."""
    docs = []
    for i in range(len(shard)):
        entry, o = shard.entry(i).tolist(), int(shard.overlaps[i])
        if o:
            docs[-1] += entry[1 + o:]
        else:
            docs.append(entry)
    return docs


def _check_outputs(out_dir, inputs: dict, tokenizer, max_length=None, overlap=0) -> int:
    """Each {split: [(name, texts)]} input is exactly one pair holding its documents' entries in
    order. Returns how many documents were cut into windows."""
    windowed = 0
    for split, items in inputs.items():
        assert list_token_shards(os.path.join(out_dir, split)) == [
            os.path.join(out_dir, split, name) for name, _ in items]
        for name, texts in items:
            shard = TokenShard(os.path.join(out_dir, split, name))
            assert shard.dtype == np.uint16
            got = [(shard.entry(i).tolist(), int(shard.overlaps[i])) for i in range(len(shard))]
            assert got == _expected_entries(tokenizer, texts, max_length, overlap)
            if overlap:
                docs = tokenizer.encode_to_arrays(texts, prepend=tokenizer.get_bos_token_id(),
                                                  num_threads=1)
                assert _rebuild_documents(shard) == [d.tolist() for d in docs]
                windowed += sum(len(d) > max_length for d in docs)
            if max_length is not None:
                assert shard.lengths().max() <= max_length
    return windowed


def _parquet_inputs(parquet_dir) -> dict:
    names = sorted(os.listdir(parquet_dir))
    texts = {n[:-len(".parquet")]: sample_texts(10 + i, 30, **TEXTS)
             for i, n in enumerate(names)}
    items = sorted(texts.items())
    return {"train": items[:-1], "val": items[-1:]}


@pytest.mark.slow
def test_cli_parquet_windowed_two_workers_then_rerun_skips(
        parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "24", "--overlap-size", "6", "--num-workers", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "max_length=24 overlap_size=6 num_workers=2" in printed  # the echo of the arguments
    assert "wrote 4/4 shards" in printed and "0 skipped" in printed
    windowed = _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer, 24, 6)
    assert windowed >= 10  # guard: the windowing path did run
    with open(os.path.join(out, "pretokenize.json")) as f:
        meta = json.load(f)
    assert (meta["max_length"], meta["overlap_size"], meta["dtype"]) == (24, 6, "uint16")
    assert meta["bos_token_id"] == tokenizer.get_bos_token_id()

    before = _files(out)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 already done" in printed and "wrote 0/0 shards" in printed and "4 skipped" in printed
    assert _files(out) == before  # byte-identical, same mtimes

    # the same output with other windowing would mix two kinds of shards: refused
    with pytest.raises(ValueError,
                       match="pretokenize.json records other settings .*max_length 24 -> 32"):
        main(argv[:-6] + ["--max-length", "32", "--overlap-size", "6"])


def test_cli_parquet_unwindowed(parquet_dir, tokenizer_dir, tokenizer, tmp_path):
    out = str(tmp_path / "tokens")
    assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 0
    _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer)
    shard = TokenShard(os.path.join(out, "train", "shard_00000"))
    assert not shard.overlaps.any() and shard.lengths().max() > 24  # nothing was cut


@pytest.mark.slow
def test_cli_gpt_simple_convention(parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    """--convention gpt-simple, in 2 worker processes: each document's tokens + EOD (the tokenizer's
    BOS id), no BOS, windowed as the reference says, every entry within --max-length; recorded in
    pretokenize.json, and a rerun with the other convention is refused."""
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "16", "--overlap-size", "4", "--num-workers", "2",
            "--convention", "gpt-simple"]
    assert main(argv) == 0
    assert "world_size=1 convention=gpt-simple" in capsys.readouterr().out
    eod = tokenizer.get_bos_token_id()
    windowed = 0
    for split, items in _parquet_inputs(parquet_dir).items():
        for name, texts in items:
            shard = TokenShard(os.path.join(out, split, name))
            expected = [window for ids in tokenizer.encode(texts, num_threads=1)
                        for window in gpt_simple_windows(ids + [eod], 16, 4)]
            assert [(shard.entry(i).tolist(), int(shard.overlaps[i]))
                    for i in range(len(shard))] == expected
            assert shard.lengths().max() == 16 and shard.dtype == np.uint16
            windowed += sum(o > 0 for _, o in expected)
    assert windowed > 10  # guard: long documents were cut
    with open(os.path.join(out, "pretokenize.json")) as f:
        meta = json.load(f)
    assert (meta["convention"], meta["eod_token_id"], meta["bos_token_id"]) == (
        "gpt-simple", eod, eod)
    with pytest.raises(ValueError,
                       match=f"records other settings .*convention 'gpt-simple' -> 'nanochat', "
                             f"eod_token_id {eod} -> None"):
        main(argv[:-2])


def test_cli_settings_written_before_conventions(parquet_dir, tokenizer_dir, tmp_path, capsys):
    """A pretokenize.json without the convention fields is the nanochat convention's: a rerun with
    the same arguments goes on; one with --convention gpt-simple is refused."""
    out = tmp_path / "tokens"
    argv = ["--input", parquet_dir, "--output", str(out), "--tokenizer-dir", tokenizer_dir,
            "--num-workers", "1"]
    assert main(argv) == 0
    meta = json.loads((out / "pretokenize.json").read_text())
    assert (meta["convention"], meta["eod_token_id"]) == ("nanochat", None)
    del meta["convention"], meta["eod_token_id"]
    (out / "pretokenize.json").write_text(json.dumps(meta))
    os.remove(out / "train" / "shard_00001.idx")
    capsys.readouterr()
    assert main(argv) == 0
    assert "3 already done" in capsys.readouterr().out
    with pytest.raises(ValueError, match="convention 'nanochat' -> 'gpt-simple'"):
        main(argv + ["--convention", "gpt-simple"])


def test_cli_resumes_a_killed_run(parquet_dir, tokenizer_dir, tokenizer, tmp_path, capsys):
    out = str(tmp_path / "tokens")
    argv = ["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
            "--max-length", "24", "--overlap-size", "6", "--num-workers", "1"]
    assert main(argv) == 0
    reference = {k: data for k, (data, _) in _files(out).items()}
    train = os.path.join(out, "train")
    # killed between the two renames: a .bin without its .idx
    os.remove(os.path.join(train, "shard_00001.idx"))
    # killed while writing: partial temporary files, no final ones
    for ext in (".bin", ".idx"):
        os.remove(os.path.join(train, "shard_00002" + ext))
        with open(os.path.join(train, "shard_00002" + ext + ".tmp"), "wb") as f:
            f.write(b"\x01partial")
    assert list_token_shards(train) == [os.path.join(train, "shard_00000")]
    untouched = _files(out)["train/shard_00000.bin"]
    capsys.readouterr()

    assert main(argv) == 0
    assert "2 already done" in capsys.readouterr().out
    # no .tmp left, same bytes
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert _files(out)["train/shard_00000.bin"] == untouched  # the complete pair was not rewritten
    _check_outputs(out, _parquet_inputs(parquet_dir), tokenizer, 24, 6)


def test_cli_ranks_split_inputs_disjointly(parquet_dir, tokenizer_dir, tmp_path, monkeypatch):
    written = []
    for rank in range(3):
        out = str(tmp_path / f"rank{rank}")
        assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                     "--num-workers", "1", "--rank", str(rank), "--world-size", "3"]) == 0
        written.append({os.path.relpath(p, out) for split in ("train", "val")
                        if os.path.isdir(os.path.join(out, split))
                        for p in list_token_shards(os.path.join(out, split))})
    assert written == [{"train/shard_00000", "val/shard_00003"}, {"train/shard_00001"},
                       {"train/shard_00002"}]
    # torchrun's variables do the same
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    out = str(tmp_path / "torchrun")
    assert main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 0
    assert list_token_shards(os.path.join(out, "train")) == [
        os.path.join(out, "train", "shard_00001")]
    assert list_token_shards(os.path.join(out, "val")) == [os.path.join(out, "val", "shard_00003")]


def test_cli_jsonl_and_jsonl_gz(tokenizer_dir, tokenizer, tmp_path):
    raw = tmp_path / "raw"
    os.makedirs(raw)
    docs = {name: sample_texts(seed, n, **TEXTS) for name, seed, n in (("a", 20, 12), ("b", 21, 12),
                                                                         ("c", 22, 5))}

    def lines(texts):
        # blank lines are skipped; other fields are ignored
        return "".join(json.dumps({"id": i, "content": t}) + "\n\n" for i, t in enumerate(texts))

    (raw / "a.jsonl").write_text(lines(docs["a"]), encoding="utf-8")
    with gzip.open(raw / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines(docs["b"]))
    (raw / "ignored.txt").write_text("not an input")
    val = tmp_path / "c.jsonl"
    val.write_text(lines(docs["c"]), encoding="utf-8")
    out = str(tmp_path / "tokens")
    assert main(["--input", str(raw), "--val-input", str(val), "--output", out,
                 "--tokenizer-dir", tokenizer_dir, "--text-field", "content",
                 "--max-length", "16", "--overlap-size", "8", "--num-workers", "1"]) == 0
    windowed = _check_outputs(
        out, {"train": [("a", docs["a"]), ("b", docs["b"])], "val": [("c", docs["c"])]},
        tokenizer, 16, 8)
    assert windowed > 0


def test_cli_bad_input_fails_alone(tokenizer_dir, tmp_path, capsys):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = str(tmp_path / "tokens")
    assert main(["--input", str(good), str(bad), "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1"]) == 1
    printed = capsys.readouterr().out
    assert "bad.jsonl line 2: invalid JSON" in printed and "failed (1): bad.jsonl" in printed
    assert sorted(os.listdir(os.path.join(out, "train"))) == [
        ".bad.lock", ".good.lock", "good.bin", "good.idx"]


# -----------------------------------------------------------------------------
# kill -9 and concurrent runs: real processes (tests/slow_pretokenize.py sleeps 0.1 s per encode
# call, one call per input here, so a run of 24 inputs on 2 workers lasts over a second)

SLOW_SCRIPT = os.path.join(TESTS, "slow_pretokenize.py")


@pytest.fixture(scope="module")
def many_inputs(tmp_path_factory, tokenizer_dir):
    """24 small jsonl inputs, and their output from an uninterrupted run (the reference)."""
    root = tmp_path_factory.mktemp("many")
    os.makedirs(root / "raw")
    for i in range(24):
        (root / "raw" / f"part_{i:02d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in sample_texts(100 + i, 12, **TEXTS)),
            encoding="utf-8")
    argv = ["--input", str(root / "raw"), "--tokenizer-dir", tokenizer_dir, "--max-length", "16",
            "--overlap-size", "4", "--num-workers", "2"]
    assert main(argv + ["--output", str(root / "reference")]) == 0
    return argv, {k: data for k, (data, _) in _files(root / "reference").items()}


def _start_slow_run(argv, log_path):
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, SLOW_SCRIPT] + argv, env=worker_env(), stdout=log,
                                stderr=subprocess.STDOUT)


def _children(pid: int) -> dict:
    """{pid: (start time, command line)} of the live child processes of pid (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(name)] = (fields[19], cmdline)
    return out


def _alive(pid: int, start_time: str) -> bool:
    """Whether that process (not a later one with its pid) still runs; a zombie has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == start_time


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cli_kill_9_leaves_no_process_and_a_rerun_matches(many_inputs, tmp_path, capsys):
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    run = _start_slow_run(argv + ["--output", str(out)], tmp_path / "log.txt")
    try:
        train = out / "train"
        _wait_for(lambda: train.is_dir() and any(n.endswith(".idx") for n in os.listdir(train)),
                  60, "first pair")
        children = _children(run.pid)
        kinds = sorted("resource_tracker" if "resource_tracker" in c
                       else "spawn" if "spawn_main" in c else c
                       for _, c in children.values())
        # 2 workers and multiprocessing's tracker
        assert kinds == ["resource_tracker", "spawn", "spawn"]
        run.kill()  # SIGKILL: no handler, no cleanup
    finally:
        run.kill()
        run.wait()
    done = [n for n in os.listdir(train) if n.endswith(".idx")]
    assert 1 <= len(done) < 24  # killed in the middle

    capsys.readouterr()
    assert main(argv + ["--output", str(out)]) == 0  # at once
    assert f"{len(done)} already done" in capsys.readouterr().out
    # byte for byte, no .tmp left
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    # the killed run's workers and resource tracker are gone, not left running
    _wait_for(lambda: not any(_alive(pid, start) for pid, (start, _) in children.items()), 5,
              "exit of all")


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", ["2", "1"])
def test_cli_ctrl_c_says_so_in_one_line_and_a_rerun_matches(many_inputs, tmp_path, capsys,
                                                           num_workers):
    """Ctrl-C to the whole process group, as a terminal sends it, with its workers inside a job or
    between two: one line, exit status 130, no partial pair; the rerun writes the rest."""
    argv, reference = many_inputs
    argv = argv[:-1] + [num_workers]  # (--num-workers)
    out = tmp_path / "tokens"
    train = out / "train"
    code, _, err = ctrl_c(
        [sys.executable, SLOW_SCRIPT] + argv + ["--output", str(out)],
        lambda: train.is_dir() and any(n.endswith(".idx") for n in os.listdir(train)),
        env=worker_env())
    assert_interrupted(code, err, "interrupted: " + INTERRUPTED)
    done = [n for n in os.listdir(train) if n.endswith(".idx")]
    assert 1 <= len(done) < 24  # stopped in the middle
    assert not [n for n in os.listdir(train) if n.endswith(".tmp")]  # nothing half written
    capsys.readouterr()
    assert main(argv + ["--output", str(out)]) == 0
    assert f"{len(done)} already done" in capsys.readouterr().out
    assert {k: data for k, (data, _) in _files(out).items()} == reference  # byte for byte


@pytest.mark.slow
def test_cli_two_runs_on_one_output(many_inputs, tmp_path, capsys):
    """A second run on an output a run is writing is refused, naming the output and the other run's
    pid; the first run is undisturbed, and once it is done the output is free again."""
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    first = _start_slow_run(argv + ["--output", str(out)], tmp_path / "log.txt")
    try:
        lock = out / ".pretokenize.lock"
        _wait_for(lambda: lock.is_file() and lock.read_text().startswith(f"pid {first.pid} on"),
                  60, "lock")
        capsys.readouterr()
        with pytest.raises(TimeoutError) as info:
            main(argv + ["--output", str(out), "--lock-timeout", "0.2"])
        message = str(info.value)
        assert message.startswith(
            f"another pretokenize run (pid {first.pid} on {socket.gethostname()}, since ")
        assert (f") is writing to {out}: {lock} stayed locked for 0.2s; "
                "let that run finish (or stop it)") in message
        # how to run several at once
        assert message.endswith("To run several at once, give each its own share of the inputs: "
                                "--rank R --world-size N, with R from 0 to N-1, on one machine "
                                "or several")
        # the wait was said, once, as it started
        printed = capsys.readouterr().out.splitlines()
        waiting = [line for line in printed if line.startswith("waiting ")]
        assert len(waiting) == 1, printed
        assert waiting[0].startswith("waiting up to 0.2s (--lock-timeout) for another pretokenize "
                                     f"run (pid {first.pid} on {socket.gethostname()}, since ")
        assert waiting[0].endswith(f") that is writing to {out}")
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert lock.read_text() == ""  # released: it names nobody
    capsys.readouterr()
    # free again: all 24 skipped
    assert main(argv + ["--output", str(out), "--lock-timeout", "0"]) == 0
    printed = capsys.readouterr().out
    assert "24 already done" in printed and "waiting" not in printed  # (a free lock: no wait)


@pytest.mark.slow
def test_cli_plain_run_and_a_rank_on_one_output_at_once(many_inputs, tmp_path):
    """A plain run and rank 0 of 2 on one output at once hold different output locks and share the
    even inputs: each pair is written once, by whichever run takes its pair lock first, and the
    other skips it."""
    argv, reference = many_inputs
    out = tmp_path / "tokens"
    runs = [_start_slow_run(argv + ["--output", str(out)] + extra, tmp_path / f"log{i}.txt")
            for i, extra in enumerate([[], ["--world-size", "2", "--rank", "0"]])]
    try:
        assert [run.wait(timeout=120) for run in runs] == [0, 0]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(2)]
    written = [re.search(r"^wrote (\d+)/\d+ shards", log, re.M) for log in logs]
    assert all(written), logs
    assert sum(int(m[1]) for m in written) == 24, logs  # no pair written twice, none missed
    # byte for byte, no .tmp left
    assert {k: data for k, (data, _) in _files(out).items()} == reference
    assert list_token_shards(str(out / "train")) == [str(out / "train" / f"part_{i:02d}")
                                                     for i in range(24)]


def _die(pair):
    os._exit(3)  # a worker killed mid-shard (the OOM killer, kill -9)


@pytest.mark.slow
def test_cli_dead_worker_fails_the_run(parquet_dir, tokenizer_dir, tmp_path, monkeypatch):
    # the pool pickles the task function by name, so spawned workers run this module's _die
    monkeypatch.setattr(pair_workers, "write_in_worker", _die)
    out = str(tmp_path / "tokens")
    with pytest.raises(ChildProcessError, match="a pretokenize worker process died .* rerun the "
                                                "same command to write the rest"):
        main(["--input", parquet_dir, "--output", out, "--tokenizer-dir", tokenizer_dir,
              "--num-workers", "2"])
    assert not os.path.exists(os.path.join(out, "train"))  # nothing half-written


def test_cli_rejects_bad_arguments(parquet_dir, tokenizer_dir, tmp_path, capsys):
    base = ["--input", parquet_dir, "--output", str(tmp_path / "out"),
            "--tokenizer-dir", tokenizer_dir]
    with pytest.raises(SystemExit) as info:
        main(base + ["--max-length", "8", "--overlap-size", "5"])
    assert info.value.code == 2
    assert "--max-length 8 / --overlap-size 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--overlap-size", "5"])
    assert "needs --max-length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--rank", "2", "--world-size", "2"])
    with pytest.raises(SystemExit):
        main(base + ["--lock-timeout", "-1"])
    assert "--lock-timeout must be >= 0 seconds, got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--unit-mb", "inf"])
    assert "--unit-mb must be a number of MB > 0, got inf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--ray-address", "auto"])
    assert "--ray-address auto needs --executor ray" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pass their directory"):
        main(["--input", os.path.join(parquet_dir, "shard_00000.parquet"),
              "--output", str(tmp_path / "out"), "--tokenizer-dir", tokenizer_dir])
    with pytest.raises(ValueError, match="drop --val-input"):
        main(base + ["--val-input", parquet_dir])
    assert not os.path.exists(tmp_path / "out" / "train")  # nothing was written

