"""
Tests for the downloader's drivers (nanochat/data/fetch/download.py: download_file,
download_files, the Report and its summary), through nanochat/dataset.py's API and CLI, against the
fault-injecting local HTTP server of conftest.py (`fault_server`): the CLI and its arguments,
skipping sound files, retries and their backoff (the waits asked for are recorded, never timed),
Retry-After, progress that starts the attempt count again, bad files already under their names, a
404, a run stopped by a host that does not resolve, the summary, two threads and two processes on
one shard, and the disk check. Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_download.py -q
"""

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections import namedtuple

import pytest

from conftest import (FAST_BACKOFF, REPO_ROOT, assert_only_complete_shards, bit_flipped,
                      dataset_cli, download_shard, outcome, serve_shards, sha256_hex)
from nanochat import dataset
from nanochat.data.fetch import download, errors
from nanochat.data.base.datasets import (DATASETS, DatasetSpec, get_data_dir, index_to_filename,
                                         list_parquet_files, split_parquet_files)
from nanochat.dataset import download_shards, download_single_file, main
from nanochat.data.fetch.download import summarize
from nanochat.data.fetch.errors import HostNotFoundError
from nanochat.data.fetch.limits import Limits

NAME = index_to_filename(0)  # the shard most tests fetch


def test_main_downloads_train_and_val_shards(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "2", "-w", "2") == 0
    out = capsys.readouterr().out
    assert "workers=2" in out and f"base_url={fault_server.url}" in out  # echoes what it parsed
    assert f"downloaded 3/3 shards to {data_dir}" in out
    assert_only_complete_shards(data_dir, served)
    assert fault_server.gets == {name: 1 for name in fault_server.files}
    assert list_parquet_files(str(data_dir))[-1].endswith("shard_06542.parquet")
    record = json.loads((data_dir / "shard_00000.parquet.json").read_text())
    # the server stated the sha256, so the bytes are the publisher's: their pages were not read
    assert record == {"size": len(served[0]), "sha256": sha256_hex(served[0]),
                      "sha256_stated_by_server": True, "pages_checked": False,
                      "source": f"{fault_server.url}/shard_00000.parquet",
                      "source_version": f'"{sha256_hex(served[0])}"'}


def test_existing_files_are_checked_then_skipped(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for i in (0, 6542):
        (data_dir / index_to_filename(i)).write_bytes(served[i])  # sound, but with no record
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 0
    assert fault_server.gets == {"shard_00001.parquet": 1}
    # all there: no GET, nor the disk check's HEAD; one HEAD for the shard with a record, whose
    # source is asked whether it is still its file (the two without one are the user's own)
    fault_server.heads.clear()
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 0
    assert fault_server.gets == {"shard_00001.parquet": 1}
    assert fault_server.heads == {"shard_00001.parquet": 1}
    assert sorted(os.listdir(data_dir)) == sorted(
        [".shard_00001.parquet.lock", "shard_00001.parquet.json"]
        + [index_to_filename(i) for i in served])


@pytest.fixture
def tiny_dataset(monkeypatch):
    """A registered dataset with 3 train shards (0..2) and val shard 3."""
    monkeypatch.setitem(DATASETS, "tiny", DatasetSpec("tiny", "example/tiny", 3, "tiny_data"))
    return DATASETS["tiny"]


def test_n_past_the_end_fetches_what_there_is_and_says_so(fault_server, tmp_path, tiny_dataset,
                                                          capsys):
    served = serve_shards(fault_server, tmp_path, range(4))
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "10", "--dataset", "tiny") == 1
    out = capsys.readouterr().out
    assert "-n 10 asks for more train shards than the 3 tiny has: fetching those 3 and val, " \
           "then exiting 1\n" in out
    assert f"downloaded 4 of the 11 shards asked for (10 train and val) to {data_dir}: tiny has " \
           "only 3 train shards\n" in out
    assert_only_complete_shards(data_dir, served)


def test_n_minus_one_fetches_all_and_defaults_come_from_env(
        fault_server, tmp_path, tiny_dataset, monkeypatch):
    served = serve_shards(fault_server, tmp_path, range(4))
    monkeypatch.setenv("NANOCHAT_DATASET", "tiny")
    monkeypatch.setenv("NANOCHAT_DATA_URL", fault_server.url)
    assert main(["-n", "-1"] + FAST_BACKOFF) == 0
    assert_only_complete_shards(get_data_dir(), served)  # <NANOCHAT_BASE_DIR>/tiny_data
    assert get_data_dir().endswith("tiny_data")


def test_n_zero_fetches_only_the_val_shard(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "0") == 0
    assert "downloaded 1/1 shards" in capsys.readouterr().out
    assert_only_complete_shards(data_dir, {6542: served[6542]})
    assert split_parquet_files("val", str(data_dir))[0].endswith("shard_06542.parquet")


@pytest.mark.parametrize("args, name", [
    (["-n", "-2"], "--num-files"),
    (["-w", "-1"], "--num-workers"),
    (["--backoff-base", "-1"], "--backoff-base"),
    (["--max-attempts", "0"], "--max-attempts"),
    (["--timeout", "0"], "--timeout"),
    (["--min-rate", "-1"], "--min-rate"),
    (["--rate-window", "0"], "--rate-window"),
    (["--deadline", "-5"], "--deadline"),
])
def test_bad_cli_arguments_are_named(args, name, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert name in capsys.readouterr().err


def test_help_states_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: -1, every shard; 0: only val)" in out
    for default in ("default: 4;", "default: $NANOCHAT_DATASET", "default: $NANOCHAT_DATA_URL",
                    "default: <base dir>", "(default: 5)", "(default: 2)", "(default: 30)",
                    "(default: 50)", "(default: 3600)"):
        assert default in out, default


def test_unknown_dataset_on_the_cli():
    with pytest.raises(ValueError, match="'nope'"):
        main(["--dataset", "nope", "-n", "0"])


def test_bad_api_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_workers"):
        download_shards([0], str(tmp_path), "http://127.0.0.1:9", num_workers=-1)
    with pytest.raises(ValueError, match="max_attempts"):
        download_single_file(0, str(tmp_path), "http://127.0.0.1:9", max_attempts=0)
    with pytest.raises(ValueError, match="rate_window"):
        download_single_file(0, str(tmp_path), "http://127.0.0.1:9", rate_window=0)
    with pytest.raises(ValueError, match="index"):
        download_single_file(-1, str(tmp_path), "http://127.0.0.1:9")


def test_api_resolves_defaults_at_call_time(fault_server, tmp_path, monkeypatch):
    served = serve_shards(fault_server, tmp_path, [5])
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "later"))
    monkeypatch.setenv("NANOCHAT_DATA_URL", fault_server.url)
    assert download_single_file(5, backoff_base=0.01) is True
    assert_only_complete_shards(tmp_path / "later" / "base_data_climbmix", served)


def test_5xx_is_retried(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["500", "502"]
    assert download_shard(fault_server, tmp_path, 0)
    assert fault_server.gets[NAME] == 3
    assert_only_complete_shards(tmp_path / "data", served)


@pytest.mark.parametrize("fault, reason", [
    ("garbage", "not parquet"), ("short", "connection failed"), ("cut", "not parquet"),
    ("500", "HTTP 500"), ("flip", "sha256 mismatch"),
])
def test_shard_that_never_succeeds_fails_the_run(fault_server, tmp_path, fault, reason, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 1, 6542])
    fault_server.always["shard_00001.parquet"] = fault
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 1
    out = capsys.readouterr().out
    assert "downloaded 2/3 shards" in out
    assert f"failed (1); rerun the same command to retry (partial downloads resume):\n" \
           f"  1 x {reason}: shard_00001.parquet\n" in out
    assert fault_server.gets["shard_00001.parquet"] == dataset.MAX_ATTEMPTS
    del served[1]
    # nothing bad under a final name; a short body keeps its partial download for the next run
    assert_only_complete_shards(data_dir, served, partial_ok=True)
    assert os.path.exists(data_dir / "shard_00001.parquet.tmp") == (fault == "short")


class _RecordedWaits:
    """Stands in for the stop event: records each backoff instead of sleeping."""

    def __init__(self):
        self.waits = []

    def wait(self, seconds):
        self.waits.append(seconds)
        return False

    def is_set(self):
        return False


def test_retry_after_is_honoured(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0, 1])
    fault_server.faults["shard_00000.parquet"] = ["429:1"]
    fault_server.faults["shard_00001.parquet"] = ["503:0", "503:0"]
    data_dir = tmp_path / "data"
    # the backoff would wait 0.01 s, then 0.02 s; each wait is the one the server asked for
    for name, asked in (("shard_00000.parquet", [1.0]), ("shard_00001.parquet", [0.0, 0.0])):
        stop = _RecordedWaits()
        assert download.download_file(f"{fault_server.url}/{name}", str(data_dir / name),
                                      Limits(backoff_base=0.01), stop=stop) == ""
        assert stop.waits == asked
    assert fault_server.gets == {"shard_00000.parquet": 2, "shard_00001.parquet": 3}
    assert_only_complete_shards(data_dir, served)


def test_backoff_doubles(fault_server, tmp_path):
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "500"
    stop = _RecordedWaits()
    with pytest.raises(errors.DownloadError, match="gave up after 5 attempts") as info:
        download.download_file(f"{fault_server.url}/{NAME}", str(tmp_path / "data" / NAME),
                               stop=stop)
    assert info.value.reason == "HTTP 500"
    assert stop.waits == [2.0, 4.0, 8.0, 16.0]  # the defaults: 5 attempts, base 2 s


def _truncated(body):
    return body[:len(body) // 2]


@pytest.mark.parametrize("bad, record, reason", [
    (lambda body: b"", False, "not parquet"),
    (_truncated, False, "not parquet"),
    (lambda body: b"<!DOCTYPE html><html>429 Too Many Requests</html>", False, "not parquet"),
    (_truncated, True, "wrong size"),
    (bit_flipped, True, "sha256 mismatch"),
])
def test_bad_existing_shard_is_fetched_again_and_reported(
        fault_server, tmp_path, bad, record, reason, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 0
    (data_dir / NAME).write_bytes(bad(served[0]))
    if not record:
        os.remove(data_dir / f"{NAME}.json")
    capsys.readouterr()
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 0
    out = capsys.readouterr().out
    assert f"downloaded 3/3 shards to {data_dir}\n3 verified against the hash {fault_server.url} " \
           f"stated\nreplaced 1 bad shards that were there:\n" \
           f"  1 x {reason}: shard_00000.parquet\n" in out
    assert fault_server.gets == {name: 1 + (name == NAME) for name in fault_server.files}
    assert_only_complete_shards(data_dir, served)


def test_bad_existing_shard_stays_when_the_new_one_fails(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / NAME).write_bytes(_truncated(served[0]))
    fault_server.always[NAME] = "500"
    assert dataset_cli(fault_server, data_dir, "-n", "1") == 1
    assert "  1 x HTTP 500: shard_00000.parquet" in capsys.readouterr().out
    # nothing is lost until a good one is there
    assert (data_dir / NAME).read_bytes() == _truncated(served[0])


def test_a_link_that_drops_every_70kb_completes(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0], big=True)
    size = len(served[0])
    assert size > 3 * 70_000  # so 4+ connections are needed
    fault_server.drop_every = 70_000
    # 2 attempts are enough: each one stores 70 KB (over PROGRESS_BYTES), so the count starts
    # again every time
    assert download_shard(fault_server, tmp_path, 0, max_attempts=2)
    resumes = [f"bytes={k}-" for k in range(70_000, size, 70_000)]
    assert fault_server.ranges[NAME] == [None] + resumes
    assert fault_server.sent[NAME] == size  # no byte fetched twice
    assert_only_complete_shards(tmp_path / "data", served)


def test_a_link_that_makes_no_real_progress_gives_up_and_keeps_its_bytes(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.drop_every = 1000  # below PROGRESS_BYTES: not progress, so the attempts run out
    assert not download_shard(fault_server, tmp_path, 0, max_attempts=3)
    assert fault_server.ranges[NAME] == [None, "bytes=1000-", "bytes=2000-"]
    assert (tmp_path / "data" / f"{NAME}.tmp").read_bytes() == served[0][:3000]
    fault_server.drop_every = None
    assert download_shard(fault_server, tmp_path, 0)  # the next run resumes where this one stopped
    assert fault_server.ranges[NAME][-1] == "bytes=3000-"
    assert_only_complete_shards(tmp_path / "data", served)


def test_404_fails_fast(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 6542])  # shard 1 does not exist on the server
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 1
    assert "  1 x HTTP 404: shard_00001.parquet" in capsys.readouterr().out
    assert fault_server.gets["shard_00001.parquet"] == 1
    assert_only_complete_shards(data_dir, served)


def test_unresolvable_host_stops_downloads_in_flight(fault_server, tmp_path):
    # one thread is mid-way through a trickling download (fast enough: min_rate 0) when another
    # finds the host of its file does not resolve: the run stops at once, the partial file is kept
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "trickle"  # ~14 KB at 50 bytes/s would take minutes
    data_dir = tmp_path / "data"
    files = [(f"{fault_server.url}/{NAME}", str(data_dir / NAME)),
             ("http://shards.invalid/x/shard_00001.parquet", str(data_dir / "shard_00001.parquet"))]
    error = outcome(lambda: download.download_files(files, num_workers=2,
                                                    limits=Limits(min_rate=0), check_disk=False))
    assert isinstance(error, HostNotFoundError), error
    assert os.path.getsize(data_dir / f"{NAME}.tmp") > 0 and not os.path.exists(data_dir / NAME)



def test_a_stopped_run_starts_no_more_files_and_raises_the_error_that_stopped_it(tmp_path,
                                                                                 monkeypatch):
    # a stops at the run's stop and comes back first; b's error stopped the run and comes after
    # it; c, queued behind them, must never start
    started = []

    def fake(url, path, limits, *, progress, stop):
        name = os.path.basename(path)
        started.append(name)
        if name == "a.parquet":
            stop.wait(10)
            raise errors.Stopped()
        if name == "b.parquet":
            stop.set()  # (as a run-stopping error does)
            time.sleep(0.5)  # a's file ends first
            raise HostNotFoundError("shards.invalid does not resolve")
        return ""

    monkeypatch.setattr(download, "download_file", fake)
    files = [(f"http://127.0.0.1:9/{name}", str(tmp_path / name))
             for name in ("a.parquet", "b.parquet", "c.parquet")]
    error = outcome(lambda: download.download_files(files, num_workers=2, check_disk=False))
    assert isinstance(error, HostNotFoundError), error
    assert sorted(started) == ["a.parquet", "b.parquet"]

@pytest.mark.slow
def test_summary_stays_short_for_many_failures(fault_server, tmp_path, monkeypatch, capsys):
    # 1,000 shards that are not on the server and one that always fails with a 500
    monkeypatch.setitem(DATASETS, "many", DatasetSpec("many", "example/many", 1000, "many_data"))
    served = serve_shards(fault_server, tmp_path, [1000])
    fault_server.always[index_to_filename(1000)] = "500"
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(10**15, 0, 10**15))
    assert dataset_cli(fault_server, tmp_path / "data", "--dataset", "many", "-w", "8",
                "--max-attempts", "1") == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-4:] == [
        "downloaded 0/1001 shards to " + str(tmp_path / "data"),
        # a 404 will be one on a rerun too: the advice is for the one that may succeed
        "failed (1001); rerun the same command to retry the 1 that may succeed (partial "
        "downloads resume):",
        "  1000 x HTTP 404: shard_00000.parquet, shard_00001.parquet, shard_00002.parquet"
        " and 997 more",
        "  1 x HTTP 500: shard_01000.parquet",
    ]
    assert served


def test_summarize():
    reasons = {f"f{i:04d}": "HTTP 404" for i in range(1000)} | {"a": "too slow", "b": "too slow"}
    assert summarize(reasons) == ["  1000 x HTTP 404: f0000, f0001, f0002 and 997 more",
                                  "  2 x too slow: a, b"]
    assert summarize({}) == []


def test_two_threads_download_one_shard_once(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "slow"  # the second caller arrives mid-download
    results = []
    threads = [threading.Thread(
        target=lambda: results.append(download_shard(fault_server, tmp_path, 0)))
        for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]
    assert fault_server.gets[NAME] == 1  # the one waiting on the lock found the file and skipped
    assert_only_complete_shards(tmp_path / "data", served)


@pytest.mark.slow
def test_two_processes_download_into_one_dir(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0, 1, 2, 6542])
    for name in fault_server.files:
        fault_server.always[name] = "slow"
    data_dir = tmp_path / "data"
    cmd = [sys.executable, "-m", "nanochat.dataset", "-n", "3", "-w", "2",
           "--base-url", fault_server.url, "--data-dir", str(data_dir)] + FAST_BACKOFF
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("downloaded 4/4 shards" in out for out in outputs)
    assert sum(fault_server.gets.values()) == 4  # every shard was fetched by exactly one process
    assert_only_complete_shards(data_dir, served)


_DiskUsage = namedtuple("_DiskUsage", "total used free")  # what shutil.disk_usage returns


def test_not_enough_disk_space_stops_before_downloading(fault_server, tmp_path, monkeypatch):
    serve_shards(fault_server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    monkeypatch.setattr(download.shutil, "disk_usage",
                        lambda path: _DiskUsage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError, match="--data-dir") as info:
        dataset_cli(fault_server, data_dir, "-n", "1")
    assert info.value.errno == errno.ENOSPC
    assert fault_server.heads["shard_00000.parquet"] == 1 and not fault_server.gets


@pytest.mark.slow
def test_the_disk_checks_head_request_ends_within_the_timeout(fault_server, tmp_path, monkeypatch):
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "slow_headers"  # every read gets a byte well within the timeout
    # the headers alone would take over 8 minutes
    url = f"{fault_server.url}/{NAME}"
    result = outcome(lambda: download.check_disk_space(str(tmp_path), 1, url, timeout=1), 10)
    assert result is None
    # cut off, the server said no size: the estimate stands in
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(10**9, 0, 10**9))
    with pytest.raises(OSError, match="estimated"):
        download.check_disk_space(str(tmp_path), 10, f"{fault_server.url}/{NAME}", timeout=1)


def test_disk_check_falls_back_to_the_estimate(tmp_path, monkeypatch):
    free = 3 * download.SHARD_BYTES_ESTIMATE
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _DiskUsage(free, 0, free))
    download.check_disk_space(str(tmp_path), 2)  # 2 * 100MB * 1.1 fits in 300MB
    with pytest.raises(OSError, match="estimated"):
        download.check_disk_space(str(tmp_path), 3)


@pytest.mark.slow
def test_download_imports_nothing_of_dataset():
    code = "import sys, nanochat.data.fetch.download; assert 'nanochat.dataset' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
