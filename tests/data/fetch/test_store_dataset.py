"""
`python -m nanochat.dataset` from a store's address (s3://..., a local directory): the download of
the names a store lists (the first -n train names and val, under their own names, byte for byte),
a rerun that fetches nothing, --verify and the command it gives to fix a bad shard, the summary's
words (verified against a hash the store stated, or size and structure checked), a local directory
as the source (copied, never written to; the same directory refused), a missing extra and bad
addresses. The S3 API is moto's server on 127.0.0.1 (the `s3` fixtures of tests/conftest.py).

    python -m pytest tests/data/fetch/test_store_dataset.py -q
"""

import os
import random
import subprocess
import sys

import pytest

from conftest import FAST_CLI, REPO_ROOT, worker_env, write_shard
from nanochat.data.streaming.streamed_split import streamed_split
from nanochat.dataset import download_shards, download_single_file, main

# sorted, the last (omega) is val; zeta is under a folder of the prefix, so it is not listed
NAMES = ["alpha.parquet", "beta.parquet", "delta.parquet", "gamma.parquet", "omega.parquet"]
FLAGS = [*FAST_CLI, "-w", "2"]  # and 2 download workers


pytestmark = pytest.mark.usefixtures("fresh_filesystems")


def _write_source(directory) -> str:
    """Shards under NAMES (several row groups each), a note and a nested shard beside them."""
    rng = random.Random(0)
    os.makedirs(os.path.join(directory, "old"), exist_ok=True)
    for name in NAMES + ["old/zeta.parquet"]:
        texts = [f"<{name}> doc {j}: " + "".join(rng.choice("abcdefgh ")
                                                   for _ in range(rng.randint(1, 60)))
                 for j in range(100)]
        write_shard(os.path.join(directory, name), texts, 16)
    with open(os.path.join(directory, "README.txt"), "w") as f:
        f.write("not a shard\n")
    return str(directory)


def _cli(*args, code: str | None = None) -> subprocess.CompletedProcess:
    """python -m nanochat.dataset ARGS as a user runs it (this environment: the fixture's AWS_*);
    code: run it after this Python instead (python -c)."""
    head = ["-m", "nanochat.dataset"] if code is None else [
        "-c", code + "; import runpy; runpy.run_module('nanochat.dataset', run_name='__main__')"]
    return subprocess.run([sys.executable, *head, *args], cwd=REPO_ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=120)


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _parquet(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".parquet"))


def _snapshot(directory) -> dict:
    """Every file and folder under directory: its size and modification time."""
    found = {}
    for root, folders, files in os.walk(directory):
        for name in folders + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = (os.path.getsize(path),
                                                       os.stat(path).st_mtime_ns)
    return found


# -----------------------------------------------------------------------------
# From S3


@pytest.mark.slow
def test_download_from_s3_fetches_the_first_n_listed_names_and_a_rerun_fetches_nothing(
        s3_faulty, tmp_path):
    source = _write_source(tmp_path / "source")
    s3_faulty.upload_dir(source, "corpus")
    data = tmp_path / "data"
    result = _cli("-n", "2", "--base-url", s3_faulty.url("corpus"), "--data-dir", str(data), *FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _parquet(data) == ["alpha.parquet", "beta.parquet", "omega.parquet"]
    for name in _parquet(data):
        assert _bytes(data / name) == _bytes(os.path.join(source, name)), name
    assert "downloaded 3/3 shards to" in result.stdout
    # S3 states the md5 of a single-part upload (its ETag): all three verified against it
    assert f"3 verified against the hash {s3_faulty.url('corpus')} stated" in result.stdout
    assert "size and structure checked" not in result.stdout
    stamps = {name: os.stat(data / name).st_mtime_ns for name in _parquet(data)}
    s3_faulty.proxy.clear()
    again = _cli("-n", "2", "--base-url", s3_faulty.url("corpus"), "--data-dir", str(data), *FLAGS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert {name: os.stat(data / name).st_mtime_ns for name in _parquet(data)} == stamps
    reads = [seen for seen in s3_faulty.proxy.seen() if seen.method == "GET"
             and ".parquet" in seen.path]
    assert s3_faulty.proxy.count() > 0 and reads == []  # it listed, and read no shard


@pytest.mark.slow
def test_minus_one_fetches_every_listed_name_and_too_many_is_a_shortfall(s3, tmp_path):
    source = _write_source(tmp_path / "source")
    s3.upload_dir(source, "corpus")
    result = _cli("-n", "-1", "--base-url", s3.url("corpus/"), "--data-dir",
                  str(tmp_path / "all"), *FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _parquet(tmp_path / "all") == NAMES
    result = _cli("-n", "9", "--base-url", s3.url("corpus"), "--data-dir",
                  str(tmp_path / "nine"), *FLAGS)
    # a shortfall: what there is is fetched, and the run says so and exits 1
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"-n 9 asks for more train shards than the 4 {s3.url('corpus')} lists: fetching " \
           "those 4 and val, then exiting 1" in result.stdout
    assert "downloaded 5 of the 10 shards asked for (9 train and val)" in result.stdout
    assert "/5 shards" not in result.stdout
    assert _parquet(tmp_path / "nine") == NAMES
    result = _cli("-n", "0", "--base-url", s3.url("corpus"), "--data-dir",
                  str(tmp_path / "val"), *FLAGS)
    assert result.returncode == 0 and _parquet(tmp_path / "val") == ["omega.parquet"]


@pytest.mark.slow
def test_verify_finds_a_corrupted_shard_and_its_fix_fetches_it_again(s3, tmp_path):
    source = _write_source(tmp_path / "source")
    s3.upload_dir(source, "corpus")
    data = tmp_path / "data"
    url = s3.url("corpus")
    assert _cli("-n", "2", "--base-url", url, "--data-dir", str(data), *FLAGS).returncode == 0
    result = _cli("--verify", "--base-url", url, "--data-dir", str(data))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checked 3 shards in {data}: 3 good, 0 bad" in result.stdout
    body = bytearray(_bytes(data / "beta.parquet"))
    body[len(body) // 2] ^= 0xFF  # the same size: only the sha256 tells
    with open(data / "beta.parquet", "wb") as f:
        f.write(body)
    result = _cli("--verify", "--base-url", url, "--data-dir", str(data))
    assert result.returncode == 1
    assert "1 bad" in result.stdout and "beta.parquet" in result.stdout
    fix = f"python -m nanochat.dataset --base-url {url} --data-dir {data} -n 2"
    assert f"to fix: {fix};" in result.stdout
    result = _cli(*fix.split()[3:], *FLAGS)  # the command as printed
    assert result.returncode == 0, result.stdout + result.stderr
    assert _bytes(data / "beta.parquet") == _bytes(os.path.join(source, "beta.parquet"))
    assert "replaced 1 bad shards that were there" in result.stdout
    assert _cli("--verify", "--base-url", url, "--data-dir", str(data)).returncode == 0


@pytest.mark.slow
def test_a_wrong_bucket_is_one_line_naming_it(s3, tmp_path):
    result = _cli("-n", "1", "--base-url", "s3://no-such-bucket-here/corpus", "--data-dir",
                  str(tmp_path / "data"), *FLAGS)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: s3://no-such-bucket-here/corpus: not found in S3; check the bucket "
                      "and the prefix (--base-url, NANOCHAT_DATA_URL)"]
    assert "Traceback" not in result.stderr and "testing" not in result.stderr  # (the secret)
    assert not os.path.exists(tmp_path / "data")


# -----------------------------------------------------------------------------
# From a local directory: copied, never written to


@pytest.mark.slow
@pytest.mark.parametrize("form", ["path", "file://"])
def test_a_local_directory_is_copied_and_left_as_it_was(tmp_path, form):
    source = _write_source(tmp_path / "source")
    before = _snapshot(source)
    base = source if form == "path" else f"file://{source}"
    data = tmp_path / "data"
    result = _cli("-n", "-1", "--base-url", base, "--data-dir", str(data), *FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _parquet(data) == NAMES
    for name in NAMES:
        assert _bytes(data / name) == _bytes(os.path.join(source, name)), name
    # a directory states no hash: never called verified
    assert "5 size and structure checked" in result.stdout
    assert "verified" not in result.stdout
    assert _snapshot(source) == before
    assert _cli("--verify", "--base-url", base, "--data-dir", str(data)).returncode == 0
    assert _snapshot(source) == before


@pytest.mark.slow
def test_the_source_directory_or_one_inside_it_is_refused_as_data_dir(tmp_path):
    source = _write_source(tmp_path / "source")
    before = _snapshot(source)
    for data_dir, words in ((source, "is the source directory"),
                            (os.path.join(source, "cache"), "is inside the source directory")):
        result = _cli("-n", "1", "--base-url", source, "--data-dir", data_dir, *FLAGS)
        assert result.returncode == 2
        assert words in result.stderr and "pass a data_dir outside it" in result.stderr
        for call in (lambda: download_shards([0], data_dir, source),
                     lambda: download_single_file(0, data_dir, source),
                     lambda: streamed_split("train", data_dir, base_url=f"file://{source}",
                                            listing=NAMES)):
            with pytest.raises(ValueError, match=f"{words} {source}"):
                call()
    assert _snapshot(source) == before


# -----------------------------------------------------------------------------
# Bad addresses, missing extras, credentials


@pytest.mark.slow
def test_a_missing_extra_is_one_line_with_the_pip_install(tmp_path):
    block = "import sys; sys.modules['gcsfs'] = None"  # as if gcsfs were not installed
    result = _cli("-n", "1", "--base-url", "gs://b/p", "--data-dir", str(tmp_path / "data"),
                  code=block)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: GCS addresses need the package gcsfs: pip install 'nanochat-data[gcs]'"]
    assert not os.path.exists(tmp_path / "data")


@pytest.mark.parametrize("address, words", [
    ("s3://", "names no bucket or repository of S3"),
    ("gs:///", "names no bucket or repository of GCS"),
    ("ftp://x", "must start with http:// or https:// or be a store's address"),
    ("http://", "must start with http:// or https://")])
def test_a_bad_address_is_a_value_error_up_front(tmp_path, address, words):
    data_dir = str(tmp_path / "data")
    for call in (lambda: download_shards([0], data_dir, address),
                 lambda: download_single_file(0, data_dir, address),
                 lambda: main(["-n", "1", "--base-url", address, "--data-dir", data_dir]),
                 lambda: main(["--verify", "--base-url", address, "--data-dir", data_dir]),
                 lambda: streamed_split("train", data_dir, base_url=address)):
        with pytest.raises(ValueError, match=words):
            call()
    assert not os.path.exists(data_dir)


@pytest.mark.parametrize("address", ["127.0.0.1:8000/resolve/main", "/no/such/shards"])
def test_a_path_that_is_no_directory_is_refused_as_a_url_without_its_scheme(tmp_path, address):
    data_dir = str(tmp_path / "data")
    for call in (lambda: download_shards([0], data_dir, address),
                 lambda: main(["-n", "1", "--base-url", address, "--data-dir", data_dir])):
        with pytest.raises(ValueError, match="is not a directory here; a URL must start with "
                                             "http:// or https://"):
            call()
    assert not os.path.exists(data_dir)
