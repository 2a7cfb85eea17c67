"""
Tests for downloads from an object store (nanochat/data/fetch/store_transport.py, driven by
download.py, over stores.py) against a real S3 API on 127.0.0.1: moto's server, straight (`s3`) or
behind a fault-injecting proxy (`s3_faulty`), with parquet shards written by pyarrow. Covers the
installed bytes and records (the hashes S3 states: the ETag's md5, the CRC32 checksum), a stated
hash that does not match, resuming after a cut body, the server stopped and started again, an object
replaced between attempts and during one, a wrong key or bucket, missing credentials, a 503 SlowDown
storm, two downloads of one shard at once, fetch_tail and the disk probe from a store, and a local
directory as the source (never written to). No credential value appears in any log line or error.
Reads are cut in chunks of 64 KiB here (STORE_CHUNK_BYTES), so a ~200 KB shard takes 3-4 GETs. Run:
python -m pytest tests/data/fetch/test_store_transport.py -q
"""

import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import sys
import threading
import zlib

import pytest

from conftest import FAST, write_shard
from nanochat.data.fetch import (download, errors, records, small_reads, store_transport, stores,
                                 verify)
from nanochat.data.fetch.address import join
from nanochat.data.fetch.errors import DownloadError, MissingExtra, StoreError
from nanochat.data.fetch.limits import Limits

CHUNK = 64 * 1024
# a credential value: it must never appear in a log line, an error or the output
SECRET = "nanochat-test-secret-9f3e1c"
FOUR_TRIES = dataclasses.replace(FAST, max_attempts=4, deadline=60.0)  # FAST, with time for faults
KEY = "data/shard_00000.parquet"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(store_transport, "STORE_CHUNK_BYTES", CHUNK)
    stores.forget_filesystems()  # the filesystems made for another test's endpoint
    yield
    stores.forget_filesystems()


def _no_secret_shown(caplog, capsys):
    out, err = capsys.readouterr()
    assert SECRET not in caplog.text + out + err


def _with_secret(bucket, monkeypatch, caplog, capsys):
    """bucket, with SECRET as the secret key; afterwards nothing showed it."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    stores.forget_filesystems()
    caplog.set_level(logging.DEBUG, logger="nanochat")
    yield bucket
    _no_secret_shown(caplog, capsys)


@pytest.fixture
def bucket(s3, monkeypatch, caplog, capsys):
    """The `s3` bucket, with SECRET as the secret key."""
    yield from _with_secret(s3, monkeypatch, caplog, capsys)


@pytest.fixture
def faulty(s3_faulty, monkeypatch, caplog, capsys):
    """The `s3_faulty` bucket (its proxy: .proxy), with SECRET as the secret key."""
    yield from _with_secret(s3_faulty, monkeypatch, caplog, capsys)


def _shard(path, seed: int, n: int = 1000) -> bytes:
    """A ~180 KB shard of random numbers (they compress poorly), 4 row groups; returns its bytes."""
    rng = random.Random(seed)
    write_shard(path, [" ".join(str(rng.random()) for _ in range(20)) for _ in range(n)], 250)
    with open(path, "rb") as f:
        return f.read()


def _put_shard(bucket, tmp_path, seed: int = 0, key: str = KEY) -> bytes:
    body = _shard(tmp_path / f"src_{seed}.parquet", seed)
    assert len(body) > 2 * CHUNK  # several chunks, or resuming would go untested
    bucket.upload(tmp_path / f"src_{seed}.parquet", key)
    return body


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _gets(proxy) -> list[str]:
    """The Range header of every GET the proxy saw, in order."""
    return [seen.range for seen in proxy.seen() if seen.method == "GET"]


def _reads_calling(monkeypatch, n: int, action):
    """Make stores.read_range run action() just before its n-th call (1-based)."""
    real, calls = stores.read_range, []

    def read_range(*args, **kwargs):
        calls.append(args[1:3])
        if len(calls) == n:
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(stores, "read_range", read_range)
    return calls


def _stopped_after_two_chunks(url: str, dest, monkeypatch):
    """Run a download that is stopped (as Ctrl-C or another file's error stops a run) after its
    2nd chunk: the temp file keeps those bytes for the next run. Returns dest."""
    stop, real = threading.Event(), stores.read_range
    _reads_calling(monkeypatch, 2, stop.set)  # checked once the chunk is written
    with pytest.raises(errors.Stopped):
        download.download_file(url, str(dest), FAST, stop=stop)
    assert os.path.getsize(records.tmp_path(str(dest))) == 2 * CHUNK
    monkeypatch.setattr(stores, "read_range", real)
    return dest


def _no_temp(path) -> bool:
    tmp = records.tmp_path(str(path))
    return not os.path.exists(tmp) and not os.path.exists(records.record_path(tmp))


# -----------------------------------------------------------------------------
# A shard from S3: the bytes, the record, the stated hashes


def test_a_shard_is_installed_byte_identical_with_the_hashes_s3_stated(bucket, tmp_path):
    body = _put_shard(bucket, tmp_path)
    dest = tmp_path / "out" / "shard_00000.parquet"
    assert download.download_file(bucket.url(KEY), str(dest), FOUR_TRIES) == ""  # there was none
    assert _read(dest) == body
    with open(records.record_path(str(dest))) as f:
        record = json.load(f)
    # S3's ETag of a single-part upload is its md5; boto3 uploads with a CRC32 checksum
    assert record == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                      "sha256_stated_by_server": False, "pages_checked": False,
                      "stated_hashes": ["crc32", "md5"], "source": bucket.url(KEY),
                      "source_version": record["source_version"]}
    info = stores.stat(bucket.url(KEY), 5.0)
    assert record["source_version"] == info.version  # the version the store stated
    assert info.hashes == {"md5": hashlib.md5(body).hexdigest(), "crc32": zlib.crc32(body)}
    assert records.stated_check(str(dest)) == "crc32, md5"
    assert _no_temp(dest)
    verify.check_file(str(dest))
    # a second call finds it sound and fetches nothing
    assert download.download_file(bucket.url(KEY), str(dest), FOUR_TRIES) is None


@pytest.mark.slow
def test_a_stated_hash_that_does_not_match_installs_nothing_and_keeps_the_old_file(
        bucket, tmp_path, monkeypatch):
    body = _put_shard(bucket, tmp_path)
    real = stores.stat

    def stat(address, timeout, **kwargs):  # the store states an md5 these bytes do not have
        info = real(address, timeout, **kwargs)
        return stores.ObjectInfo(info.size, info.version, info.hashes | {"md5": "0" * 32})

    monkeypatch.setattr(stores, "stat", stat)
    dest = tmp_path / "out" / "shard_00000.parquet"
    dest.parent.mkdir()
    dest.write_bytes(b"a bad file the user has")
    with pytest.raises(DownloadError) as caught:
        download.download_file(bucket.url(KEY), str(dest), FOUR_TRIES)
    assert caught.value.reason == "md5 mismatch"
    message = str(caught.value)
    assert f"md5 {hashlib.md5(body).hexdigest()}" in message and "0" * 32 in message
    assert "shard_00000.parquet.tmp" in message and bucket.url(KEY) in message
    assert dest.read_bytes() == b"a bad file the user has"  # stays until a verified one comes
    assert _no_temp(dest)


def test_a_stated_crc32c_without_its_package_is_skipped_not_counted(bucket, tmp_path,
                                                                      monkeypatch):
    body = _put_shard(bucket, tmp_path)
    real = stores.stat
    monkeypatch.setattr(stores, "stat", lambda address, timeout, **kwargs: stores.ObjectInfo(
        len(body), real(address, timeout, **kwargs).version, {"crc32c": 12345}))
    monkeypatch.setattr(verify, "_optional_crc", lambda name: None)  # no package installed
    dest = tmp_path / "out" / "shard_00000.parquet"
    download.download_file(bucket.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == body
    with open(records.record_path(str(dest))) as f:
        record = json.load(f)
    # nothing stated was checked: every page was read, and no hash is claimed
    assert record["stated_hashes"] == [] and record["pages_checked"] is True
    assert records.stated_check(str(dest)) is None


def _crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78), one bit at a time: slow and plainly right."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


class _FakeGoogleCrc32c:
    """google_crc32c's one call we use, extend(value, data), computed bit by bit."""

    @staticmethod
    def extend(value: int, data: bytes) -> int:
        return _crc32c_bitwise(data, value)


@pytest.mark.slow
@pytest.mark.parametrize("right", [True, False])
def test_a_stated_crc32c_is_checked_when_its_package_is_there(bucket, tmp_path, monkeypatch,
                                                              right):
    body = _put_shard(bucket, tmp_path)
    assert _crc32c_bitwise(b"123456789") == 0xE3069283  # the standard check value
    stated = _crc32c_bitwise(body) if right else _crc32c_bitwise(body) ^ 1
    real = stores.stat
    monkeypatch.setattr(stores, "stat", lambda address, timeout, **kwargs: stores.ObjectInfo(
        len(body), real(address, timeout, **kwargs).version, {"crc32c": stated}))
    monkeypatch.setitem(sys.modules, "google_crc32c", _FakeGoogleCrc32c)
    dest = tmp_path / "out" / "shard_00000.parquet"
    if right:
        download.download_file(bucket.url(KEY), str(dest), FAST)
        assert _read(dest) == body and records.stated_check(str(dest)) == "crc32c"
    else:
        with pytest.raises(errors.DownloadError) as caught:
            download.download_file(bucket.url(KEY), str(dest), FAST)
        assert caught.value.reason == "crc32c mismatch"
        assert f"crc32c {_crc32c_bitwise(body):08x}" in str(caught.value)
        assert not dest.exists() and _no_temp(dest)


# -----------------------------------------------------------------------------
# Faults: a cut body, the server gone and back, an object replaced


def test_a_cut_body_resumes_from_the_end_of_the_temp_file(faulty, tmp_path, monkeypatch,
                                                          caplog):
    body = _put_shard(faulty, tmp_path)
    _reads_calling(monkeypatch, 3, lambda: faulty.proxy.cut_after(1000))  # the 3rd GET is cut
    dest = tmp_path / "out" / "shard_00000.parquet"
    download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == body
    ranges = [f"bytes={start}-{min(start + CHUNK, len(body)) - 1}"
              for start in range(0, len(body), CHUNK)]
    # the retry asked only for what the temp file did not hold: the cut chunk again, then the rest
    assert _gets(faulty.proxy) == ranges[:3] + ranges[2:]
    assert "attempt 1/4" in caplog.text and "it made progress" in caplog.text  # one retry, logged


def test_a_partial_temp_is_resumed_by_the_next_run(faulty, tmp_path, monkeypatch):
    body = _put_shard(faulty, tmp_path)
    dest = _stopped_after_two_chunks(faulty.url(KEY), dest=tmp_path / "out" / "a.parquet",
                                     monkeypatch=monkeypatch)
    faulty.proxy.clear()
    download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == body
    assert _gets(faulty.proxy) == [f"bytes={2 * CHUNK}-{len(body) - 1}"]  # only the rest


@pytest.mark.slow
def test_the_server_stopped_mid_download_then_started_again(faulty, tmp_path, monkeypatch):
    body = _put_shard(faulty, tmp_path)

    def stop_for_a_while():
        faulty.proxy.stop()
        threading.Timer(0.3, faulty.proxy.start).start()

    _reads_calling(monkeypatch, 3, stop_for_a_while)
    dest = tmp_path / "out" / "shard_00000.parquet"
    # waits of 0.05, 0.1, 0.2, 0.4, ... s: the server is back within the attempts
    download.download_file(faulty.url(KEY), str(dest),
                           Limits(max_attempts=8, backoff_base=0.05, timeout=5.0, deadline=60.0))
    assert _read(dest) == body
    assert not any(r.startswith("bytes=0-") for r in _gets(faulty.proxy)[1:])  # resumed


def test_an_object_replaced_during_a_download_is_fetched_whole_never_spliced(
        faulty, tmp_path, monkeypatch, caplog):
    _put_shard(faulty, tmp_path)
    new = _shard(tmp_path / "new.parquet", seed=1)
    # the 2nd read already sees the new object: the bytes of two versions are in the temp file
    _reads_calling(monkeypatch, 2, lambda: faulty.put(KEY, new))
    dest = tmp_path / "out" / "shard_00000.parquet"
    download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == new
    assert "changed on the store" in caplog.text
    with open(records.record_path(str(dest))) as f:
        assert json.load(f)["sha256"] == hashlib.sha256(new).hexdigest()


@pytest.mark.slow
def test_an_object_replaced_between_runs_starts_over(faulty, tmp_path, monkeypatch, caplog):
    _put_shard(faulty, tmp_path)
    dest = _stopped_after_two_chunks(faulty.url(KEY), dest=tmp_path / "out" / "a.parquet",
                                     monkeypatch=monkeypatch)  # a prefix of the old object
    new = _shard(tmp_path / "new.parquet", seed=1)
    faulty.put(KEY, new)
    faulty.proxy.clear()
    download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == new
    assert _gets(faulty.proxy)[0] == f"bytes=0-{CHUNK - 1}"  # from the start, not spliced
    assert "changed on the store since" in caplog.text


def test_a_server_that_stays_down_fails_at_the_deadline(faulty, tmp_path):
    _put_shard(faulty, tmp_path)
    faulty.proxy.stop()
    dest = tmp_path / "out" / "shard_00000.parquet"
    with pytest.raises(DownloadError) as caught:
        download.download_file(faulty.url(KEY), str(dest),
                               Limits(max_attempts=1000, backoff_base=0.05, timeout=2.0,
                                      deadline=0.5))
    assert caught.value.reason == "past the deadline"
    assert not dest.exists() and _no_temp(dest)


def test_a_rate_below_min_rate_ends_the_attempt_between_chunks(bucket, tmp_path, caplog):
    body = _put_shard(bucket, tmp_path)
    dest = tmp_path / "out" / "shard_00000.parquet"
    # no link reaches 1 TB/s: every attempt ends after one chunk, which is kept (progress)
    download.download_file(bucket.url(KEY), str(dest),
                           Limits(backoff_base=0.01, timeout=5.0, min_rate=1e12,
                                  rate_window=1e-6))
    assert _read(dest) == body
    assert caplog.text.count("below the minimum of 1e+09 KB/s") == -(-len(body) // CHUNK) - 1


# -----------------------------------------------------------------------------
# Errors no retry can help, and a storm that retries do


@pytest.mark.slow
@pytest.mark.parametrize("where", ["key", "bucket"])
def test_a_wrong_key_or_bucket_is_one_clear_error_without_retries(faulty, tmp_path, where):
    url = faulty.url("data/nope.parquet") if where == "key" else "s3://no-such-bucket-x/a.parquet"
    dest = tmp_path / "out" / "a.parquet"
    with pytest.raises(DownloadError) as caught:
        download.download_file(url, str(dest), FOUR_TRIES)
    assert caught.value.reason == "not found"
    assert f"{url}: not found in S3" in str(caught.value) and "not retrying" in str(caught.value)
    assert faulty.proxy.count() == 1  # one HEAD, no retry
    assert not dest.exists() and _no_temp(dest)


def test_a_secret_in_an_address_is_masked_in_errors_and_logs(faulty, tmp_path, caplog):
    # (a credential can end up in an address, as a SAS token does in a URL)
    with pytest.raises(DownloadError) as caught:
        small_reads.fetch_tail(f"s3://{SECRET}/a.parquet", 100, FAST)
    assert SECRET not in str(caught.value) and "s3://***/a.parquet" in str(caught.value)


@pytest.mark.slow
def test_missing_credentials_stop_the_run_with_one_line_and_fetch_nothing(
        faulty, tmp_path, monkeypatch):
    _put_shard(faulty, tmp_path)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none" / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none" / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    stores.forget_filesystems()
    files = [(faulty.url(f"data/shard_0000{i}.parquet"), str(tmp_path / "out" / f"s{i}.parquet"))
             for i in range(3)]
    with pytest.raises(StoreError) as caught:
        download.download_files(files, num_workers=2, limits=FOUR_TRIES)
    message = str(caught.value)
    assert caught.value.reason == "no credentials" and "\n" not in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
    with pytest.raises(StoreError, match="no S3 credentials"):
        download.download_file(files[0][0], files[0][1], FOUR_TRIES)
    assert faulty.proxy.count() == 0
    assert not any(name.endswith(".parquet") for name in os.listdir(tmp_path / "out"))


def test_a_slow_down_storm_is_retried_until_it_passes(faulty, tmp_path, caplog):
    body = _put_shard(faulty, tmp_path)
    faulty.proxy.slow_down(3)
    dest = tmp_path / "out" / "shard_00000.parquet"
    download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert _read(dest) == body
    assert caplog.text.count("S3 asks to slow down") == 3


def test_a_storm_longer_than_the_attempts_is_a_clear_error(faulty, tmp_path):
    _put_shard(faulty, tmp_path)
    faulty.proxy.slow_down(100)
    dest = tmp_path / "out" / "shard_00000.parquet"
    with pytest.raises(DownloadError) as caught:
        download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES)
    assert caught.value.reason == "slow down"
    assert "gave up after 4 attempts in a row without progress" in str(caught.value)
    assert faulty.proxy.count() == FOUR_TRIES.max_attempts
    assert not dest.exists()


def test_a_missing_extra_is_raised_unchanged(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs fails
    with pytest.raises(MissingExtra, match=r"pip install 'nanochat-data\[gcs\]'"):
        download.download_files([("gs://bucket/a.parquet", str(tmp_path / "a.parquet"))],
                                limits=FOUR_TRIES)


# -----------------------------------------------------------------------------
# One download per shard; the footer and the disk probe from a store


@pytest.mark.slow
def test_two_downloads_of_one_shard_at_once_fetch_it_once(faulty, tmp_path):
    body = _put_shard(faulty, tmp_path)
    dest = tmp_path / "out" / "shard_00000.parquet"
    start, results = threading.Barrier(2), []

    def fetch():
        start.wait()
        # (recheck=False: a thread that comes late would also ask the store about the file it
        # finds, one HEAD more)
        results.append(download.download_file(faulty.url(KEY), str(dest), FOUR_TRIES,
                                              recheck=False))

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results, key=str) == ["", None]  # one fetched it, the other found it there
    assert _read(dest) == body
    assert faulty.proxy.count("GET") == -(-len(body) // CHUNK)  # each chunk once
    assert faulty.proxy.count("HEAD") == 2  # the stat before and after the reads
    verify.check_file(str(dest))


def test_fetch_tail_reads_the_end_of_an_object(bucket, tmp_path):
    body = _put_shard(bucket, tmp_path)
    assert small_reads.fetch_tail(bucket.url(KEY), 100, FAST) == (len(body), body[-100:])
    assert small_reads.fetch_tail(bucket.url(KEY), 10**9, FAST) == (len(body), body)
    with pytest.raises(DownloadError, match="not found in S3"):
        small_reads.fetch_tail(bucket.url("data/nope.parquet"), 100, FAST)
    with pytest.raises(ValueError, match="http"):
        small_reads.fetch_small(bucket.url("index.json"), 1000, FAST)


def test_the_disk_check_asks_the_store_for_the_size(bucket, tmp_path):
    body = _put_shard(bucket, tmp_path)
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError) as caught:
        download.check_disk_space(str(tmp_path), free // len(body) + 1, bucket.url(KEY),
                                  timeout=5.0)
    assert caught.value.errno == errno.ENOSPC
    assert f"{len(body) / 1e6:.1f} MB each, from the store" in str(caught.value)


@pytest.mark.slow
def test_download_files_fetches_a_prefix_of_shards(bucket, tmp_path):
    bodies = {f"shard_0000{i}.parquet": _put_shard(bucket, tmp_path, i, f"p/shard_0000{i}.parquet")
              for i in range(3)}
    out = tmp_path / "out"
    report = download.download_files([(bucket.url(f"p/{name}"), str(out / name))
                                      for name in bodies], num_workers=2, limits=FOUR_TRIES)
    assert report.failed == {} and report.total == 3
    assert {name: _read(out / name) for name in bodies} == bodies


# -----------------------------------------------------------------------------
# A local directory as the source: copied, verified, never written to


def _listing(directory) -> dict:
    """Every entry under directory (hidden ones too): its size and modification time."""
    found = {}
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            st = os.lstat(os.path.join(root, name))
            found[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size,
                                                                           st.st_mtime_ns)
    return found


@pytest.mark.parametrize("form", ["path", "file://"])
def test_a_local_directory_is_copied_and_never_written_to(tmp_path, form, caplog):
    src = tmp_path / "src"
    src.mkdir()
    bodies = {f"shard_0000{i}.parquet": _shard(src / f"shard_0000{i}.parquet", i)
              for i in range(3)}
    before = _listing(src)
    base = str(src) if form == "path" else f"file://{src}"
    out = tmp_path / "out"
    files = [(join(base, name), str(out / name)) for name in bodies]
    report = download.download_files(files, num_workers=2, limits=FOUR_TRIES)
    assert report.failed == {}
    assert {name: _read(out / name) for name in bodies} == bodies
    for name in bodies:  # a local file states no hash: size and structure, every page read
        assert records.stated_check(str(out / name)) is None
        with open(records.record_path(str(out / name))) as f:
            record = json.load(f)
        assert record["stated_hashes"] == [] and record["pages_checked"] is True
    # a bad copy is fetched again from the directory
    (out / "shard_00001.parquet").write_bytes(b"PAR1 broken")
    report = download.download_files(files, num_workers=1, limits=FOUR_TRIES)
    assert list(report.replaced) == ["shard_00001.parquet"]
    assert _read(out / "shard_00001.parquet") == bodies["shard_00001.parquet"]
    # the destination inside the source directory is refused
    with pytest.raises(ValueError, match="never written to"):
        download.download_file(files[0][0], str(src / "copy.parquet"), FOUR_TRIES)
    assert _listing(src) == before
