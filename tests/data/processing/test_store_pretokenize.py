"""
Tests for `python -m nanochat.pretokenize --input s3://...` against a real S3 API (moto's server on
127.0.0.1, the `s3` fixture): the output equals, file for file and byte for byte, pretokenizing
the same shards from a local directory (in this process and with 2 worker processes), and no
downloaded shard is left behind; a shard gone after the listing fails alone and a rerun finishes;
a wrong bucket or an empty prefix is a one-line error. file:// is the local directory. A store
whose package is missing is the one-line error naming the pip install. Run:
    python -m pytest tests/data/processing/test_store_pretokenize.py -q
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, sample_texts
from nanochat.data.fetch import stores
from nanochat.data.fetch.address import store_of
from nanochat.data.fetch.errors import StoreError
from nanochat.data.processing.inputs import STAGING
from nanochat.pretokenize import main



TEXTS = dict(words=("alpha", "beta", "river", "stone", "cloud", "paper", "token", "é", "42"),
             lengths=(2, 9, 60))
TOKENIZER_TEXTS = [t for seed in range(3) for t in sample_texts(seed, 40, **TEXTS)]


def _files(root: str) -> dict[str, bytes]:
    """relative path -> bytes of every file under root, hidden ones included."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def _run(tokenizer_dir: str, source: str, out: str, *extra: str) -> int:
    return main(["--input", source, "--output", out, "--tokenizer-dir", tokenizer_dir,
                 "--num-workers", "1", *extra])


def _cli(*args: str, hide: str | None = None) -> subprocess.CompletedProcess:
    """`python -m nanochat.pretokenize ARGS` in a subprocess, with the package `hide` made
    unimportable there (as when its extra is not installed)."""
    code = ("import runpy, sys\n"
            f"if {hide!r}: sys.modules[{hide!r}] = None\n"
            "sys.argv = ['pretokenize'] + sys.argv[1:]\n"
            "runpy.run_module('nanochat.pretokenize', run_name='__main__', alter_sys=True)\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)


@pytest.mark.slow
def test_from_s3_equals_from_disk(s3, parquet_dir, tokenizer_dir, tmp_path, capsys):
    keys = s3.upload_dir(parquet_dir, "datasets/climb")
    assert len(keys) == 4
    local, one, two = (str(tmp_path / name) for name in ("local", "s3-one", "s3-two"))
    assert _run(tokenizer_dir, parquet_dir, local) == 0
    assert _run(tokenizer_dir, s3.url("datasets/climb"), one) == 0
    # 2 worker processes: each downloads its shards, with the environment it inherited
    assert _run(tokenizer_dir, s3.url("datasets/climb/"), two, "--num-workers", "2") == 0

    expected = _files(local)
    assert sorted(name for name in expected if name.endswith(".idx")) == [
        "train/shard_00000.idx", "train/shard_00001.idx", "train/shard_00002.idx",
        "val/shard_00003.idx"]
    for out in (one, two):
        assert _files(out) == expected  # every file, byte for byte: no downloaded shard is left
        assert os.path.isdir(os.path.join(out, STAGING, "train"))  # where they were downloaded

    # a rerun skips every pair, before any download
    capsys.readouterr()
    assert _run(tokenizer_dir, s3.url("datasets/climb"), one) == 0
    assert "4 already done (their .idx exists), skipped; 0 to write" in capsys.readouterr().out
    assert _files(one) == expected


def test_file_address_reads_the_directory_in_place(parquet_dir, tokenizer_dir, tmp_path):
    local, via = str(tmp_path / "local"), str(tmp_path / "file")
    assert _run(tokenizer_dir, parquet_dir, local) == 0
    assert _run(tokenizer_dir, "file://" + parquet_dir, via) == 0
    assert _files(via) == _files(local)
    assert not os.path.exists(os.path.join(via, STAGING))  # nothing was copied


@pytest.mark.slow
def test_a_shard_gone_after_the_listing_fails_alone(s3, parquet_dir, tokenizer_dir, tmp_path,
                                                    monkeypatch, capsys):
    s3.upload_dir(parquet_dir, "data")
    real = stores.list_names

    def list_then_delete(base, timeout):  # the store's own listing; then the object goes
        names = real(base, timeout)
        s3.delete("data/shard_00001.parquet")
        return names

    monkeypatch.setattr(stores, "list_names", list_then_delete)
    out, local = str(tmp_path / "out"), str(tmp_path / "local")
    assert _run(tokenizer_dir, s3.url("data"), out) == 1
    printed = capsys.readouterr().out
    assert "failed (1): shard_00001.parquet" in printed
    assert "s3://" in printed and "shard_00001.parquet" in printed and "not found" in printed
    assert not os.path.exists(os.path.join(out, "train", "shard_00001.idx"))
    assert os.path.exists(os.path.join(out, "train", "shard_00002.idx"))
    # nothing of the missing shard was kept under its name
    staged = _files(os.path.join(out, STAGING))
    assert not any(name.endswith(".parquet") for name in staged), staged

    # it comes back: the rerun writes that pair alone, and the whole equals the local run
    monkeypatch.setattr(stores, "list_names", real)
    s3.upload(os.path.join(parquet_dir, "shard_00001.parquet"), "data/shard_00001.parquet")
    assert _run(tokenizer_dir, s3.url("data"), out) == 0
    assert "wrote 1/1 shards" in capsys.readouterr().out
    assert _run(tokenizer_dir, parquet_dir, local) == 0
    assert _files(out) == _files(local)


@pytest.mark.slow
def test_a_wrong_bucket_or_an_empty_prefix_is_a_clear_error(s3, parquet_dir, tokenizer_dir,
                                                            tmp_path):
    s3.upload_dir(parquet_dir, "data")
    out = str(tmp_path / "out")
    with pytest.raises(StoreError) as e:
        _run(tokenizer_dir, f"s3://{s3.bucket}-missing/data", out)
    assert e.value.reason == "not found" and f"s3://{s3.bucket}-missing/data" in str(e.value)
    with pytest.raises(StoreError, match="elsewhere: not found") as e:
        _run(tokenizer_dir, s3.url("elsewhere"), out)
    s3.put("notes/readme.txt", b"no shards here")
    with pytest.raises(StoreError, match="notes holds no .parquet files"):
        _run(tokenizer_dir, s3.url("notes"), out)
    assert not os.path.exists(os.path.join(out, "train"))  # nothing was written

    # the command line says it in one line, without a traceback or a credential
    done = _cli("--input", f"s3://{s3.bucket}-missing/data", "--output", out,
                "--tokenizer-dir", tokenizer_dir)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: s3://") and "not found" in lines[-1], done.stderr
    assert "Traceback" not in done.stderr and os.environ["AWS_SECRET_ACCESS_KEY"] not in lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("address, package, extra", [("gs://bucket/data", "gcsfs", "gcs"),
                                                     ("s3://bucket/data", "s3fs", "s3")])
def test_a_missing_extra_is_one_line(address, package, extra, tokenizer_dir, tmp_path):
    done = _cli("--input", address, "--output", str(tmp_path / "out"),
                "--tokenizer-dir", tokenizer_dir, hide=package)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {store_of(address).name} addresses need the package {package}: "
        f"pip install 'nanochat-data[{extra}]'")
    assert "Traceback" not in done.stderr


def test_other_inputs_beside_a_store_are_refused(tokenizer_dir, parquet_dir, tmp_path):
    with pytest.raises(ValueError, match="pass it alone"):
        _run(tokenizer_dir, "s3://bucket/data", str(tmp_path / "out"), "--val-input", parquet_dir)
    with pytest.raises(ValueError, match="download over HTTP first"):
        _run(tokenizer_dir, "https://example.invalid/data", str(tmp_path / "out"))
