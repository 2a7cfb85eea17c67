"""
The end-to-end demo (scripts/demo.py) and the speedrun recipes. The demo runs in a subprocess, as a
user runs it, with small sizes (a few seconds): it serves its own shards on 127.0.0.1, so no
network and no ~/.cache are touched; it downloads them, and streams them (stream=True) within a
cache_limit smaller than the shards. The lines it ends on, to reuse its base dir, are run as
printed.

    python -m pytest tests/test_demo.py -q
"""

import ast
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


def run_demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "scripts.demo", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    # conftest points NANOCHAT_BASE_DIR at tmp_path; the demo must not write there, only to --out
    base_dir = os.environ["NANOCHAT_BASE_DIR"]
    result = run_demo("--out", str(out), "--num-docs", "600", "--shards", "4",
                      "--row-group-size", "64", "--vocab-size", "512", "--batches", "6",
                      "--B", "4", "--T", "128")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # what was downloaded is exactly what was served, under the real dataset's names
    served = sorted(os.listdir(out / "hosted"))
    assert served == [f"shard_{i:05d}.parquet" for i in range(4)] + ["shard_06542.parquet"]
    downloaded = sorted(f for f in os.listdir(out / "base_data_climbmix") if f.endswith(".parquet"))
    assert downloaded == served
    for name in served:
        assert ((out / "base_data_climbmix" / name).read_bytes()
                == (out / "hosted" / name).read_bytes()), name
    assert not [f for f in os.listdir(out / "base_data_climbmix") if f.endswith(".tmp")]

    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "tokenizer" / "token_bytes.npy").is_file()

    stdout = result.stdout
    assert "train: rows starting with BOS: 100.0%" in stdout
    assert "val: rows starting with BOS: 100.0%" in stdout
    assert "train: 6 batches, 24 rows, 3,072 tokens" in stdout
    assert "state_dict of the last batch: {'pq_idx'" in stdout
    # the tokenizer's Unicode sample: its text, then each token, as bytes where it holds part of
    # a UTF-8 character (no U+FFFD), which together give the text back
    text = "Ünïcödé: 你好世界, привет мир, 🙂"
    lines = stdout.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(f"{text!r}: 52 bytes -> ")]
    assert len(at) == 1, stdout[-3000:]
    pieces = [ast.literal_eval(p) for p in re.findall(r"b?'(?:[^'\\]|\\.)*'", lines[at[0] + 1])]
    assert b"".join(p if isinstance(p, bytes) else p.encode() for p in pieces) == text.encode()
    assert any(isinstance(p, bytes) for p in pieces) and "\ufffd" not in stdout
    # the loader's figures, rounded: one line per loader, the streaming one with its cache
    figures = (r"loader: wait \d+\.\d% \| [\d.]+[kMG]? tok/s in, [\d.]+[kMG]? out \| "
               r"crop \d+\.\d% masked 0\.0% \| \d+\.\d docs/row")
    for name in ("train", "val"):
        assert re.search(rf"^{name} {figures}$", stdout, re.M), stdout[-3000:]
    assert re.search(rf"^streamed train {figures} \| cache [\d.]+/[\d.]+ [KM]B, "
                     r"[\d.]+ [KM]B down, \d+ evicted$", stdout, re.M), stdout[-3000:]
    assert "loader stats: {" not in stdout  # (no raw dict of floats)

    # step 6: the same batches streamed from the server (the demo exits 1 if they differ), within
    # a cache_limit just above the least of prefetch_shards=0 (3 train shards, val, copies), below
    # the 5
    # shards; only the shards read were fetched (prefetch_shards=0), the first train shard and the
    # val shard among them
    line = re.search(r"stream=True: 6 train batches and 1 val batch equal to step 5's "
                     r"\(batches and states\); first train batch after [\d.]+s "
                     r"\(on disk: [\d.]+s\); peak cache ([\d,]+) bytes <= cache_limit "
                     r"([\d,]+) bytes \(the 5 shards: ([\d,]+) bytes\); shards downloaded, "
                     r"in order: (.*)", stdout)
    assert line, stdout[-3000:]
    peak, limit, total = (int(g.replace(",", "")) for g in line.groups()[:3])
    sizes = [(out / "hosted" / name).stat().st_size for name in served]
    assert total == sum(sizes)
    assert 3 * max(sizes[:4]) + sizes[4] < limit  # (the room set aside for the copies)
    assert 0 < peak <= limit < total
    fetched = line.group(4).split(", ")
    assert ({"shard_00000", "shard_06542"} <= set(fetched)
            <= {name.removesuffix(".parquet") for name in served})
    cache = out / "stream_cache" / "base_data_climbmix"
    cached = sorted(f for f in os.listdir(cache) if f.endswith(".parquet"))
    assert ("shard_06542.parquet" in cached
            and sum((cache / f).stat().st_size for f in cached) <= limit)
    for name in cached:
        assert (cache / name).read_bytes() == (out / "hosted" / name).read_bytes(), name
    for name in [f.removesuffix(".tmp") for f in os.listdir(cache) if f.endswith(".parquet.tmp")]:
        # a download the loader's close() stopped (its reading thread had moved on): a prefix, which
        # the next loader resumes, under its final name only once complete and verified
        assert (out / "hosted" / name).read_bytes().startswith(
            (cache / f"{name}.tmp").read_bytes()), name
    assert "== summary" in stdout
    assert not os.path.exists(base_dir)

    # the base dir it used, and the lines that reuse it: run as printed, they load its tokenizer
    # and a batch of its shards, here B=4 and T=128 as the demo ran
    tail = stdout.splitlines()[-3:]
    assert tail[0] == (f"base dir: {out}. Your scripts find its tokenizer/ and base_data_climbmix/ "
                       "(get_tokenizer(), the loaders given no data_dir) once NANOCHAT_BASE_DIR "
                       "names it:")
    assert tail[1] == f"  export NANOCHAT_BASE_DIR={out}"
    command = shlex.split(tail[2])
    assert command[:2] == ["python", "-c"] and len(command) == 3, tail[2]
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    reused = subprocess.run([sys.executable, "-c", command[2]], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert (reused.returncode, reused.stdout) == (0, "torch.Size([4, 128])\n"), reused.stderr


@pytest.mark.slow
def test_demo_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = run_demo("--out", str(tmp_path))
    assert result.returncode != 0
    assert "not empty" in result.stderr
    assert os.listdir(tmp_path) == ["keep.txt"]


@pytest.mark.parametrize("script", ["speedrun.sh", "scripts/speedrun.sh"])
def test_speedrun_is_valid_bash(script):
    result = subprocess.run(["bash", "-n", os.path.join(REPO_ROOT, script)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
