"""
The end-to-end demo (scripts/demo.py) and the speedrun recipe. The demo runs in a subprocess, as a
user runs it, with small sizes (a few seconds): it serves its own shards on 127.0.0.1, so no
network and no ~/.cache are touched.

    python -m pytest tests/test_demo.py -q
"""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "scripts.demo", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    # conftest points NANOCHAT_BASE_DIR at tmp_path; the demo must not write there, only to --out
    base_dir = os.environ["NANOCHAT_BASE_DIR"]
    result = run_demo("--out", str(out), "--num-docs", "600", "--shards", "2", "--row-group-size", "64",
                      "--vocab-size", "512", "--batches", "6", "--B", "4", "--T", "128")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # what was downloaded is exactly what was served, under the real dataset's names
    served = sorted(os.listdir(out / "hosted"))
    assert served == ["shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"]
    downloaded = sorted(f for f in os.listdir(out / "base_data_climbmix") if f.endswith(".parquet"))
    assert downloaded == served
    for name in served:
        assert (out / "base_data_climbmix" / name).read_bytes() == (out / "hosted" / name).read_bytes(), name
    assert not [f for f in os.listdir(out / "base_data_climbmix") if f.endswith(".tmp")]

    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "tokenizer" / "token_bytes.npy").is_file()

    stdout = result.stdout
    assert "train: rows starting with BOS: 100.0%" in stdout
    assert "val: rows starting with BOS: 100.0%" in stdout
    assert "train: 6 batches, 24 rows, 3,072 tokens" in stdout
    assert "state_dict of the last batch: {'pq_idx'" in stdout
    assert "== summary" in stdout
    assert not os.path.exists(base_dir)


def test_demo_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = run_demo("--out", str(tmp_path))
    assert result.returncode != 0
    assert "not empty" in result.stderr
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_speedrun_is_valid_bash():
    result = subprocess.run(["bash", "-n", os.path.join(REPO_ROOT, "speedrun.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
