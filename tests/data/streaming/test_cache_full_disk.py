"""
A full disk under a streaming cache (nanochat/data/streaming/, nanochat/data/base/files.py,
nanochat/data/fetch/download.py), on a real tmpfs of 4 MB mounted for each test: a small file's
write, a download before it starts and one that fills the disk, each file of the cache (ledger,
catalog, kept copy), and a disk another program fills mid-run. Each is an error naming the
directory, the bytes needed and free, and the fix, and leaves no temporary file. Mounting needs
root or sudo without a password; elsewhere these skip, except where CI is set: there they fail.

    python -m pytest tests/data/streaming/test_cache_full_disk.py -q
"""

import errno
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import FAST, outcome, write_hosted, write_shard
from nanochat.data.base.files import write_atomic
from nanochat.data.fetch import download, verify
from nanochat.data.fetch.download import download_file
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.catalog import read_catalog
from nanochat.data.streaming.kept import encode, Keeper
from nanochat.data.streaming.ledger import Ledger, STREAM_DIR, Table
from nanochat.data.base.datasets import index_to_filename
from served_shards import batches, batches_of, expected, hosted_once, on_disk, same, streaming


FIX = "free some space, pass a smaller cache_limit, or use a data_dir on a bigger disk"
# the part of a full disk's message that the cache's small files and the downloader share
DISK_FULL = re.compile(r"needs \d+ bytes but \d+ are free")


# -----------------------------------------------------------------------------
# A full disk is an error naming the directory, the bytes needed and free, and the fix

# another program that fills a disk: it writes a file until there is no room left
FILL = """
import sys
with open(sys.argv[1], "wb", buffering=0) as f:
    try:
        while True:
            f.write(bytes(4096))
    except OSError:
        pass
"""


def fill(path) -> None:
    subprocess.run([sys.executable, "-c", FILL, str(path)], check=True, timeout=60)
    assert shutil.disk_usage(os.path.dirname(path)).free < 4096


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 4 MB of its own (a tmpfs) at tmp_path/disk, unmounted after the test.
    Mounting needs root, or sudo without a password (as on CI runners); where neither works the
    tests skip, but fail when CI is set: CI must never skip them silently."""
    mount = tmp_path / "disk"
    mount.mkdir()
    sudo = mount_tmpfs(mount)
    yield mount
    subprocess.run(sudo + ["umount", "-l", str(mount)], check=True, timeout=30)


def mount_tmpfs(mount) -> list[str]:
    """Mount a 4 MB tmpfs at `mount`, writable by this user: as root, else with `sudo -n`. The
    prefix that worked ([] or ["sudo", "-n"]); no_small_disk when neither did."""
    options = f"size=4m,uid={os.getuid()},gid={os.getgid()}"
    tries = [[]] if os.getuid() == 0 else [[], ["sudo", "-n"]]
    errors = []
    for sudo in tries:
        command = sudo + ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except FileNotFoundError as e:
            errors.append(f"{command[0]}: not found ({e.strerror})")
            continue
        if result.returncode == 0:
            return sudo
        errors.append(f"{' '.join(command[:3])}: {result.stderr.strip()}")
    no_small_disk("; ".join(errors))


def no_small_disk(why: str) -> None:
    """Skip a full-disk test that has no tmpfs of its own, or fail it when CI is set."""
    reason = (f"a full disk is tested on a tmpfs of its own, and mounting one failed ({why}): "
              "run as root, or where sudo needs no password")
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {reason}")
    pytest.skip(reason)


def test_without_a_tmpfs_the_full_disk_tests_fail_when_ci_is_set(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set and a full disk is tested"):
        no_small_disk("mount: permission denied")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="mounting one failed"):
        no_small_disk("mount: permission denied")


def temporary_files(directory) -> list[str]:
    """The temporary files (name.tmp, name.tmp<pid>) left anywhere under a directory."""
    return [os.path.join(root, name) for root, _, names in os.walk(directory)
            for name in names if re.search(r"\.tmp\d*$", name)]


def test_a_write_on_a_full_disk_names_the_directory_and_leaves_no_temporary_file(small_disk):
    path = small_disk / "table.json"
    write_atomic(str(path), b"{}")
    fill(small_disk / "filler")
    with pytest.raises(OSError) as raised:
        write_atomic(str(path), b"x" * 10_000)
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert message.startswith(f"[Errno {errno.ENOSPC}] {small_disk}: writing table.json needs "
                              "10000 bytes but "), message
    assert DISK_FULL.search(message) and message.endswith(FIX)
    assert path.read_bytes() == b"{}"  # the file as it was
    assert sorted(os.listdir(small_disk)) == ["filler", "table.json"]  # no temporary file


def test_a_download_on_a_full_disk_leaves_no_empty_file(small_disk, tmp_path):
    """The disk is full before the download starts: the error names the directory, the shard's
    size (the server stated it) and 0 bytes free; no empty partial file or record is left."""
    source = tmp_path / "hosted"
    write_hosted(source, num_train=1)
    name = index_to_filename(0)
    server = ShardServer(str(source))
    fill(small_disk / "filler")
    try:
        with pytest.raises(OSError) as raised:
            download_file(f"{server.url}/{name}", str(small_disk / name), FAST)
    finally:
        server.close()
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert message.startswith(f"[Errno {errno.ENOSPC}] {small_disk}: fetching {name} (nothing "
                              f"kept) needs {os.path.getsize(source / name)} bytes but "), message
    assert sorted(os.listdir(small_disk)) == [f".{name}.lock", "filler"]


def test_a_download_that_fills_the_disk_names_it_and_keeps_what_it_fetched(small_disk, tmp_path):
    """A shard of ~2 MB into a disk with ~0.5 MB free: the download fails at once (no retry can
    help) with the directory, the bytes it still needs and those free, and the fix; what arrived
    stays in the partial file for a rerun to resume, and nothing has the shard's name."""
    source = tmp_path / "hosted"
    source.mkdir()
    name = index_to_filename(0)
    rng = random.Random(0)
    # (random hex: it does not compress below half)
    write_shard(str(source / name), ["%0512x" % rng.getrandbits(2048) for _ in range(8000)], 1000)
    server = ShardServer(str(source))
    fill(small_disk / "filler")
    with open(small_disk / "filler", "r+b") as f:  # (about 0.5 MB free again)
        f.truncate(os.path.getsize(small_disk / "filler") - 500_000)
    try:
        with pytest.raises(OSError) as raised:
            download_file(f"{server.url}/{name}", str(small_disk / name), FAST)
    finally:
        server.close()
    message, size = str(raised.value), os.path.getsize(source / name)
    assert raised.value.errno == errno.ENOSPC and size > 1_500_000
    kept = os.path.getsize(small_disk / (name + ".tmp"))
    assert 0 < kept < size
    assert message.startswith(f"[Errno {errno.ENOSPC}] {small_disk}: fetching {name} ({kept} "
                              f"bytes kept in {small_disk / name}.tmp: a rerun resumes) needs "
                              f"{size - kept} bytes but "), message
    assert DISK_FULL.search(message) and message.endswith(download.DOWNLOAD_DISK_FIX)
    assert not (small_disk / name).exists()


@pytest.mark.parametrize("what", ["ledger", "catalog", "kept copy"])
def test_each_file_of_the_cache_on_a_full_disk(small_disk, tmp_path, what):
    """The ledger, the catalog and a kept copy, each written on a disk another program filled."""
    cache = small_disk / "cache"
    name = index_to_filename(0)
    os.makedirs(cache / STREAM_DIR / "kept")
    write_shard(str(cache / name), ["some text"] * 10, 5)
    # (as the downloader installs it: the catalog reads the entry of a shard so installed from it)
    record = {"size": os.path.getsize(cache / name), "sha256": verify.sha256_of(cache / name)}
    (cache / (name + ".json")).write_text(json.dumps(record))
    ledger = Ledger(str(cache))
    with ledger.lock:  # (the lock file exists before the disk is full, as in a run)
        ledger.write(Table(evicting=True))
    fill(small_disk / "filler")
    with pytest.raises(OSError) as raised:
        if what == "ledger":
            with ledger.lock:
                ledger.write(Table(shards={}, kept={"a-1-0": {name: 10_000}}))
        elif what == "catalog":  # (its entry comes from the shard on disk: no request)
            read_catalog(str(cache), [name], [f"http://127.0.0.1:9/{name}"], FAST)
        else:
            keeper = Keeper(str(cache), [name], "a-1-0", 1, ledger)
            keeper.write(0, encode({(0, i): "x" * 1000 for i in range(100)}), Table())
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert f"] {cache / STREAM_DIR}" in message and DISK_FULL.search(message), message
    assert message.endswith(FIX)
    assert temporary_files(cache) == []


def test_a_disk_filled_by_another_program_mid_run(small_disk, tmp_path):
    """Streaming into a small disk; once every shard is on disk (no download pending), another
    program fills it. The next write of the cache's ledger fails: next() raises an OSError(ENOSPC)
    naming the directory, the bytes needed and free, and the fix, and no temporary file is left."""
    source = tmp_path / "hosted"
    write_hosted(source, num_train=3)
    server = ShardServer(str(source))
    cache = small_disk / "cache"
    expected = batches(on_disk(source), 200)
    got = []
    try:
        # no cache_limit: nothing is evicted or copied; all 3 shards are fetched ahead at once
        loader = streaming(cache, server, num_shards=3, prefetch_shards=2, prefetch=0)
        try:
            got += batches_of(loader, 1)
            names = [index_to_filename(i) for i in range(3)]
            for _ in range(1000):  # 10 s
                if all((cache / n).exists() for n in names) and not temporary_files(cache):
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the shards did not all arrive")
            fill(small_disk / "filler")
            error = outcome(lambda: got.extend(batches_of(loader, 199)), 60)
            os.remove(small_disk / "filler")  # (room again, for close() to take its row out)
        finally:
            loader.close()
    finally:
        server.close()
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, error
    message = str(error)
    assert message.startswith(f"[Errno {errno.ENOSPC}] {cache / STREAM_DIR}: "), message
    assert DISK_FULL.search(message) and message.endswith(FIX), message
    assert temporary_files(cache) == []
    same(got, expected[:len(got)])
    assert server.fetched() == names  # each shard once, all before the disk was full


# -----------------------------------------------------------------------------
# C: every file of .stream is read defensively


# -----------------------------------------------------------------------------
# D: one footer request per shard per machine
