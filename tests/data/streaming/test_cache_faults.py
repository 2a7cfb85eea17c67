"""
The streaming cache's own files under faults, against a ShardServer on 127.0.0.1: kept copies that
are damaged, truncated or edited; a disk that another program fills (a real tmpfs of a few MB,
mounted here: root only, else skipped); a catalog or ledger of the wrong shape; a damaged or missing
ledger rebuilt from the disk, and a resume at the least cache_limit after it; a catalog entry with
a wrong size; a ledger row whose pid now names an unrelated process; a row of unknown liveness,
stale after one bounded wait; cache_limit nan or inf; and the local ranks of a machine reading each
footer once. Every streamed batch is compared with the same loader over the hosted shards on disk.
Run: python -m pytest tests/data/streaming/test_cache_faults.py -q   (~1 min)
"""

import errno
import gzip
import json
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from itertools import islice

import pyarrow.parquet as pq
import pytest
import torch

from conftest import (FAST, TESTS, ByteTokenizer, hosting, least_accepted, outcome, worker_env,
                      write_hosted, write_shard)
from nanochat.data.streaming import catalog
from nanochat.data.fetch import download
from nanochat.data.streaming import cache as shard_cache
from nanochat.data.streaming import ledger as ledger_module
from nanochat.data.streaming.catalog import catalog_entry, read_catalog
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.dataset import index_to_filename
from nanochat.data.fetch.download import download_file
from nanochat.data.base.files import write_atomic
from nanochat.data.streaming.kept import Keeper, encode
from nanochat.data.streaming.ledger import STREAM_DIR, Ledger, Table
from nanochat.data.loader.options import parse_bytes
from nanochat.data.base.state import decode_keys
from nanochat.data.fetch import serve as shard_server
from nanochat.data.fetch.serve import ShardServer
from stream_worker import LOADER, rows_of

VAL = index_to_filename(6542)  # the default dataset's val shard
FIX = "free some space, pass a smaller cache_limit, or use a data_dir on a bigger disk"
# the part of a full disk's message that the cache's small files and the downloader share
DISK_FULL = re.compile(r"needs \d+ bytes but \d+ are free")


# -----------------------------------------------------------------------------
# Hosted shards, loaders, the on-disk oracle


def streaming(cache, server, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, num_shards=7,
                  base_url=server.url, download_limits=FAST, tokenizer_batch_size=8,
                  buffer_size=20) | kwargs
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(cache), **kwargs)


def on_disk(hosted, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8,
                  buffer_size=20) | kwargs
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(hosted), **kwargs)


def batches(loader, n: int) -> list:
    """The next n batches (inputs, targets, state), copied; the loader is closed after."""
    out = []
    try:
        for inputs, targets, state in loader:
            out.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
            if len(out) == n:
                break
    finally:
        loader.close()
    return out


def same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, ((a, b, s), (x, y, t)) in enumerate(zip(got, expected)):
        assert torch.equal(a, x) and torch.equal(b, y) and s == t, f"batch {i}"


def footers(server) -> Counter:
    """How many footer requests (a Range of the file's end) the server answered, per shard."""
    return Counter(name for name, wanted in server.gets if wanted and wanted.startswith("bytes=-"))


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]



@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """conftest's hosted, shared by the tests of this file (none changes them)."""
    with hosting(tmp_path_factory.mktemp("hosted")) as shards:
        yield shards


@pytest.fixture(scope="module")
def expected(hosted):
    """The on-disk loader's first 260 batches: the oracle."""
    return batches(on_disk(hosted[0]), 260)


@pytest.fixture(scope="module")
def streamed(hosted, expected, tmp_path_factory):
    """A cache left by a streaming loader that took 200 batches within a tight cache_limit (so it
    evicted shards and kept copies of buffered documents), and its last state."""
    _, server, sizes = hosted
    cache = tmp_path_factory.mktemp("streamed") / "cache"
    # about the least it accepts: (packing 2 + prefetch_shards=1 + 1) x the largest, val, copies
    limit = int(5.2 * sizes[-1])
    first = batches(streaming(cache, server, cache_limit=limit, prefetch_shards=1), 200)
    same(first, expected[:200])
    return cache, first[-1][2], limit


# -----------------------------------------------------------------------------
# A: kept copies are used only when intact


def flip_a_byte(path, at: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0xFF
    open(path, "wb").write(bytes(data))


def truncate(path) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def edit_texts(path, texts: list[str]) -> None:
    """Cut each of `texts` to half its length in the copy, and gzip it again: a valid gzip file.
    (Shorter, they are packed differently at once: a document longer than a row may wait in the
    buffer past the batches compared.)"""
    data = gzip.decompress(open(path, "rb").read())
    for text in texts:
        old, new = json.dumps(text).encode(), json.dumps(text[:len(text) // 2]).encode()
        assert data.count(old) == 1
        data = data.replace(old, new)
    open(path, "wb").write(gzip.compress(data))


def _all_train_shards_fetched(cache, server) -> list[str]:
    """The 7 train shards' names, once a streaming loader (closed since) has fetched them all."""
    names = [index_to_filename(i) for i in range(7)]
    loader = streaming(cache, server, prefetch_shards=6, workers=0)
    batches_of(loader, 1)
    for _ in range(1000):
        if all((cache / name).exists() for name in names):
            break
        time.sleep(0.01)
    loader.close()
    return names


# a flipped byte: the first of the deflate stream (past the 10-byte gzip header: an invalid block
# type, zlib.error), or one in its middle (the gzip CRC does not match, or a bad code)
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped block byte", "flipped middle byte", "truncated",
                                    "edited text"])
def test_a_damaged_kept_copy_is_removed_and_its_shard_fetched_again(hosted, expected, streamed,
                                                                     tmp_path, caplog, damage):
    """The shard files are gone but the copies are there; one copy of the resumed buffer's
    documents is damaged. The resume names it in one warning, removes it (and its row in the
    ledger), fetches its shard again, and its batches are the on-disk loader's."""
    hosted_dir, server, _ = hosted
    template, state, limit = streamed
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    for name in os.listdir(cache):
        if name.endswith(".parquet"):
            os.remove(cache / name)
    buffered = {}  # shard name -> the (rg_idx, row) of its documents the state buffers
    for key in decode_keys(state["buffer"]):
        buffered.setdefault(index_to_filename(key[1]), set()).add((key[2], key[3]))
    kept = cache / STREAM_DIR / "kept"
    copies = sorted(kept.glob("*/*.json.gz"))
    name, path = next((p.name.removesuffix(".json.gz"), p) for p in copies
                      if p.name.removesuffix(".json.gz") in buffered)
    owner = path.parent.name
    if damage == "flipped block byte":
        flip_a_byte(path, 10)
    elif damage == "flipped middle byte":
        flip_a_byte(path, path.stat().st_size // 2)
    elif damage == "truncated":
        truncate(path)
    else:
        edit_texts(path, [on_disk_text(hosted_dir, name, *key) for key in buffered[name]])
    mark = len(server.gets)
    with caplog.at_level(logging.WARNING):
        loader = streaming(cache, server, cache_limit=limit, prefetch_shards=0, prefetch=0,
                           resume_state_dict=state)
        # (at once: the copies of a gone loader otherwise stay while a resume restores from them)
        assert not path.exists()
        assert name not in Ledger(str(cache)).read().kept.get(owner, {})
        resumed = batches(loader, 60)
    same(resumed, expected[200:])
    assert len(warnings_about(caplog, str(path))) == 1, caplog.text
    # its documents came from the shard again
    assert name in [n for n, wanted in server.gets[mark:] if wanted is None]


def on_disk_text(hosted_dir, name: str, rg_idx: int, row: int) -> str:
    table = pq.ParquetFile(os.path.join(hosted_dir, name)).read_row_group(rg_idx)
    return table.column("text")[row].as_py()


# -----------------------------------------------------------------------------
# B: a full disk is an error naming the directory, the bytes needed and free, and the fix

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
    """A file system of 4 MB of its own (a tmpfs) at tmp_path/disk, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: a full disk is tested on a tmpfs of its own")
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({result.stderr.strip()}): a full "
                    "disk is tested on a file system of its own, which needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True, timeout=30)


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
    hosted = tmp_path / "hosted"
    write_hosted(hosted, num_train=1)
    name = index_to_filename(0)
    server = ShardServer(str(hosted))
    fill(small_disk / "filler")
    try:
        with pytest.raises(OSError) as raised:
            download_file(f"{server.url}/{name}", str(small_disk / name), FAST)
    finally:
        server.close()
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert message.startswith(f"[Errno {errno.ENOSPC}] {small_disk}: fetching {name} (nothing "
                              f"kept) needs {os.path.getsize(hosted / name)} bytes but "), message
    assert sorted(os.listdir(small_disk)) == [f".{name}.lock", "filler"]


def test_a_download_that_fills_the_disk_names_it_and_keeps_what_it_fetched(small_disk, tmp_path):
    """A shard of ~2 MB into a disk with ~0.5 MB free: the download fails at once (no retry can
    help) with the directory, the bytes it still needs and those free, and the fix; what arrived
    stays in the partial file for a rerun to resume, and nothing has the shard's name."""
    hosted = tmp_path / "hosted"
    hosted.mkdir()
    name = index_to_filename(0)
    rng = random.Random(0)
    # (random hex: it does not compress below half)
    write_shard(str(hosted / name), ["%0512x" % rng.getrandbits(2048) for _ in range(8000)], 1000)
    server = ShardServer(str(hosted))
    fill(small_disk / "filler")
    with open(small_disk / "filler", "r+b") as f:  # (about 0.5 MB free again)
        f.truncate(os.path.getsize(small_disk / "filler") - 500_000)
    try:
        with pytest.raises(OSError) as raised:
            download_file(f"{server.url}/{name}", str(small_disk / name), FAST)
    finally:
        server.close()
    message, size = str(raised.value), os.path.getsize(hosted / name)
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
    record = {"size": os.path.getsize(cache / name), "sha256": download.sha256_of(cache / name)}
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
    hosted = tmp_path / "hosted"
    write_hosted(hosted, num_train=3)
    server = ShardServer(str(hosted))
    cache = small_disk / "cache"
    expected = batches(on_disk(hosted), 200)
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


def batches_of(loader, n: int) -> list:
    """The next n batches, copied, the loader left open."""
    out = []
    for inputs, targets, state in loader:
        out.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
        if len(out) == n:
            break
    return out


# -----------------------------------------------------------------------------
# C: every file of .stream is read defensively


def names_and_urls(server, num_train: int = 7) -> tuple[list[str], list[str]]:
    """The shards a train loader's catalog holds (with the val shard's), and their URLs."""
    names = [index_to_filename(i) for i in range(num_train)] + [VAL]
    return names, [f"{server.url}/{name}" for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["[1, 2, 3]", "entries"])
def test_a_catalog_of_the_wrong_shape_is_read_again(hosted, expected, tmp_path, caplog, bad):
    """A catalog that is a list, or whose entries are not {"url": str, "size": int, "rows":
    [int, ...]} with their checksum: one warning, the bad entries read again from the footers,
    the catalog written whole again, and the batches the on-disk loader's."""
    _, server, _ = hosted
    cache = tmp_path / "cache"
    names, urls = names_and_urls(server)
    good = {name: entry for name, entry in zip(names, read_catalog(str(cache), names, urls, FAST))}
    path = cache / STREAM_DIR / "catalog.json"
    if bad == "entries":
        wrong = dict(good)
        wrong[names[0]] = [1, 2]
        wrong[names[1]] = dict(good[names[1]], size="big")
        wrong[names[2]] = dict(good[names[2]], rows=[1, "x"])
        wrong[names[3]] = {k: v for k, v in good[names[3]].items() if k != "url"}
        path.write_text(json.dumps(wrong))
        again = names[:4]
    else:
        path.write_text(bad)
        again = names
    before = footers(server)
    with caplog.at_level(logging.WARNING):
        same(batches(streaming(cache, server), 20), expected[:20])
        same(batches(streaming(cache, server), 20), expected[:20])  # (the catalog is good now)
    assert footers(server) - before == Counter(again)
    assert len(warnings_about(caplog, str(path))) == 1, caplog.text
    assert json.loads(path.read_text()) == good


def test_a_garbage_ledger_is_warned_about_once_and_replaced(hosted, expected, tmp_path, caplog):
    """A loader reads the ledger at every state: a garbage file is one warning, until a write
    replaces it (a garbage file written again is another)."""
    _, server, _ = hosted
    cache = tmp_path / "cache"
    (cache / STREAM_DIR).mkdir(parents=True)
    path = cache / STREAM_DIR / "ledger.json"
    path.write_bytes(b"\x00garbage{")
    ledger = Ledger(str(cache))
    with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.ledger"):
        for _ in range(100):
            assert ledger.read() == Table() and not ledger.evicting()
        assert len(warnings_about(caplog, str(path))) == 1
        path.write_text('{"loaders": [1]}')  # another bad version: one more warning
        for _ in range(100):
            ledger.read()
        assert len(warnings_about(caplog, str(path))) == 2
        # a streaming loader writes it whole at its start: a table again
        same(batches(streaming(cache, server, cache_limit=int(1e9)), 20), expected[:20])
    assert len(warnings_about(caplog, str(path))) == 2
    assert set(json.loads(path.read_text())) == {"loaders", "shards", "kept", "evicting"}


def proc_start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat, read here as the kernel documents it (proc(5))."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start times come from /proc")
def test_a_row_whose_pid_now_names_another_process_pins_nothing(hosted, expected, tmp_path,
                                                                 monkeypatch):
    """A loader's row records its pid and its process's start time. A row whose pid is alive but
    names a process started at another time (the pid was reused) is a gone loader's: the shards it
    said it needed are evicted at once, where the pid alone would pin them (a reader waiting for
    room, then a ValueError)."""
    _, server, sizes = hosted
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 5.0)  # (a stall is an error within seconds)
    cache = tmp_path / "cache"
    # every train shard on disk, fetched by a streaming loader: evicted only when no one needs it
    names = _all_train_shards_fetched(cache, server)
    sleeper = subprocess.Popen(["sleep", "60"])  # an unrelated live process
    try:
        started = proc_start_time(sleeper.pid)
        host_name = socket.gethostname()

        def row(**more) -> dict:
            return dict(host=host_name, pid=sleeper.pid, cache_limit=None, fetching=None,
                        restoring=False, needs={name: "ahead" for name in names}, **more)

        ledger = Ledger(str(cache))
        with ledger.lock:
            table = json.loads((cache / STREAM_DIR / "ledger.json").read_text())
            table["loaders"] = {"live": row(started=started), "reused": row(started=started + 1),
                                "unknown": row()}
            (cache / STREAM_DIR / "ledger.json").write_text(json.dumps(table))
        # the same pid: its own process is alive; a process started at another time is not it;
        # without a start time it may be alive: it stays (for one bounded wait of a reader)
        assert sorted(ledger.read().loaders) == ["live", "unknown"]
        with ledger.lock:
            table["loaders"] = {"reused": row(started=started + 1)}
            (cache / STREAM_DIR / "ledger.json").write_text(json.dumps(table))
        # (pinned, the reader would find no room: a ValueError after the deadline, 30 s)
        got = outcome(lambda: batches(streaming(cache, server, cache_limit=int(5.2 * sizes[-1]),
                                                prefetch_shards=1), 150), 60)
        assert not isinstance(got, Exception), got
    finally:
        sleeper.kill()
        sleeper.wait()
    same(got, expected[:150])
    assert len([n for n in os.listdir(cache) if n.endswith(".parquet")]) < 7  # it evicted


def fresh_copy(template, directory):
    """A copy of a cache, at a new path each call (a loader changes the cache it starts on)."""
    path = directory / f"copy{len(os.listdir(directory)) if directory.exists() else 0}"
    shutil.copytree(template, path)
    return path


def fetched_on_disk(cache) -> list[str]:
    """The shards in the cache that the ledger lists as fetched by a streaming loader."""
    shards = json.loads((cache / STREAM_DIR / "ledger.json").read_text())["shards"]
    return sorted(n for n, row in shards.items()
                  if row["state"] == "fetched" and (cache / n).exists())


@pytest.mark.parametrize("garbage", [b"\x00garbage{", b'{"shards": {"x": 1}}', None])
def test_a_damaged_ledger_is_rebuilt_from_the_disk_once(streamed, tmp_path, caplog, monkeypatch,
                                                        garbage):
    """The ledger is garbage, its shard rows have the wrong shape, or it is gone (None). It is
    rebuilt from what is on disk, once for that version of the file, with one warning naming it:
    the shards whose download records say a streaming loader fetched them (a shard of the user's
    stays the user's), the kept copies and their owners, and evicting, set as copies are kept."""
    template, _, _ = streamed
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    path = cache / STREAM_DIR / "ledger.json"
    good = json.loads(path.read_text())
    assert good["evicting"] and good["kept"]  # (the test is about both)
    streamed_shards = fetched_on_disk(cache)
    assert streamed_shards
    write_shard(cache / "mine.parquet", ["a document of the user's"] * 4, 2)  # no record
    if garbage is None:
        path.unlink()
    else:
        path.write_bytes(garbage)
    ledger = Ledger(str(cache))
    with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.ledger"):
        for _ in range(100):
            table = ledger.read()
            assert table.fetched() == streamed_shards
            assert table.kept == good["kept"] and table.evicting
    said = warnings_about(caplog, str(path))
    assert len(said) == 1 and "rebuilt from what is on disk" in said[0], caplog.text
    assert f"{len(streamed_shards)} shard(s) whose download records say a streaming loader " \
           "fetched them" in said[0]
    # a loader reads the ledger every few ms: the disk is listed once for a version of the file
    rebuilds, real = [], ledger_module.rebuild
    monkeypatch.setattr(ledger_module, "rebuild", lambda d: rebuilds.append(d) or real(d))
    ledger = Ledger(str(cache))
    for _ in range(100):
        assert ledger.read().fetched() == streamed_shards
    # (no file: listed at each read, until the first write, a loader's at its start)
    assert len(rebuilds) == (1 if garbage else 100)
    with ledger.lock:  # the next write replaces the file with the rebuilt table
        ledger.write(ledger.read())
    assert Ledger(str(cache)).read().fetched() == streamed_shards
    assert json.loads(path.read_text())["kept"] == good["kept"]


@pytest.mark.slow
def test_a_resume_at_the_least_after_the_ledger_is_damaged_is_accepted_and_evicts(
        hosted, expected, streamed, tmp_path, caplog):
    """A streaming run left its shards and copies; then its ledger became garbage. The shards it
    fetched stay evictable (their download records say so), so a resume at the least cache_limit of
    the intact cache is accepted, evicts what it fetched before, and gives the on-disk batches.
    Else they would count as the user's own, never evicted, and the resume be refused."""
    _, server, _ = hosted
    template, state, _ = streamed
    resume = dict(prefetch_shards=0, prefetch=0, resume_state_dict=state, workers=0)
    least = least_accepted(lambda limit: streaming(fresh_copy(template, tmp_path / "probes"),
                                                   server, cache_limit=limit, **resume))
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    before = fetched_on_disk(cache)
    path = cache / STREAM_DIR / "ledger.json"
    path.write_bytes(b"\x00garbage{")
    with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.ledger"):
        loader = streaming(cache, server, cache_limit=least, **resume)
        resumed = batches_of(loader, 60)
        status = loader.cache_status()
        loader.close()
    same(resumed, expected[200:])
    assert status.own_evictions > 0 and status.peak_bytes <= least
    assert [n for n in before if not (cache / n).exists()]  # shards fetched before the damage went
    said = warnings_about(caplog, str(path))
    assert len(said) == 1 and "rebuilt from what is on disk" in said[0], caplog.text


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start times come from /proc")
@pytest.mark.parametrize("unknown", ["no start time", "no /proc", "another host"])
def test_a_row_of_unknown_liveness_pins_shards_for_one_bounded_wait(
        hosted, expected, tmp_path, monkeypatch, caplog, unknown):
    """A row whose liveness cannot be told holds every train shard: it has no start time and names
    a live pid (this process's, as an older writer's row would), or its start time cannot be read
    (no /proc), or it is another host's. A reader waits for room for STALE_WAIT, then the row counts
    as stale: one warning names it and the ledger, and the loader goes on, its batches exact.
    Pinned, the reader would wait ROOM_WAIT, then raise."""
    _, server, sizes = hosted
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 5.0)  # (a stall is an error within seconds)
    monkeypatch.setattr(shard_cache, "STALE_WAIT", 0.2, raising=False)
    cache = tmp_path / "cache"
    names = _all_train_shards_fetched(cache, server)
    row = dict(host=socket.gethostname(), pid=os.getpid(), cache_limit=None, fetching=None,
               restoring=False, needs={name: "ahead" for name in names})
    if unknown == "no /proc":  # (a start time recorded, none to read)
        row["started"] = proc_start_time(os.getpid())
        monkeypatch.setattr(ledger_module, "start_time", lambda pid: None)
    elif unknown == "another host":
        row["host"] = "another-host"
    ledger = Ledger(str(cache))
    with ledger.lock:
        table = json.loads((cache / STREAM_DIR / "ledger.json").read_text())
        table["loaders"] = {"old-writer-0": row}
        (cache / STREAM_DIR / "ledger.json").write_text(json.dumps(table))
    assert list(ledger.read().loaders) == ["old-writer-0"]  # (not dropped at a read: it may live)
    with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.cache"):
        got = outcome(lambda: batches(streaming(cache, server, cache_limit=int(5.2 * sizes[-1]),
                                                prefetch_shards=1, workers=0), 150), 60)
    assert not isinstance(got, Exception), got
    same(got, expected[:150])
    assert len([n for n in os.listdir(cache) if n.endswith(".parquet")]) < 7  # it evicted
    said = warnings_about(caplog, "old-writer-0")
    assert len(said) == 1, caplog.text
    assert str(cache / STREAM_DIR / "ledger.json") in said[0]
    assert f"(host {row['host']}, pid {os.getpid()})" in said[0] and "stale" in said[0]


def test_a_wrong_size_in_the_catalog_is_corrected_and_the_resume_is_exact(
        hosted, expected, streamed, tmp_path, caplog):
    """The catalog gives the sizes the state's fingerprint of the files is taken on. One entry
    disagrees with its shard on disk (its checksum right: as after the file changed on the
    server), another's size was changed on disk (its checksum wrong): the first is corrected from
    the file, with a warning that names the shard, the catalog and both values, and the second is
    read again from the server's footer. The resume is exact."""
    _, server, _ = hosted
    template, state, limit = streamed
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    names = [index_to_filename(i) for i in range(7)]
    present = [n for n in names if (cache / n).exists()]
    absent = [n for n in names if not (cache / n).exists()]
    assert present and absent  # the test is about both
    path = cache / STREAM_DIR / "catalog.json"
    good = json.loads(path.read_text())
    wrong = dict(good)
    entry = good[present[0]]
    wrong[present[0]] = catalog_entry(entry["url"], entry["size"] + 100, entry["rows"])
    wrong[absent[0]] = dict(good[absent[0]], size=good[absent[0]]["size"] - 100)
    path.write_text(json.dumps(wrong))
    before = footers(server)
    with caplog.at_level(logging.WARNING):
        resumed = batches(streaming(cache, server, cache_limit=limit, prefetch_shards=0,
                                    prefetch=0, resume_state_dict=state), 60)
    same(resumed, expected[200:])
    size = entry["size"]
    said = warnings_about(caplog, f"says shard {present[0]} has {size + 100} bytes")
    assert len(said) == 1 and str(path) in said[0] and f"has {size} bytes" in said[0], caplog.text
    assert len(warnings_about(caplog, f"{path}: 1 entries of the wrong shape or checksum "
                                      f"({absent[0]})")) == 1, caplog.text
    assert footers(server) - before == Counter([absent[0]])
    assert json.loads(path.read_text()) == good


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["cut", "tail"])
@pytest.mark.parametrize("catalog_kept", [True, False])
def test_a_shard_damaged_in_the_cache_is_fetched_again_not_read_for_the_catalog(
        hosted, expected, tmp_path, damage, catalog_kept):
    """A shard the cache holds is cut in half, or its last bytes zeroed (its record as it was;
    the catalog too, or gone): the next loader neither plans on it nor fails on it; it fetches it
    again, and the batches are exact."""
    hosted_dir, server, _ = hosted
    cache = tmp_path / "cache"
    same(batches(streaming(cache, server), 1), expected[:1])
    path = cache / index_to_filename(0)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "cut" else data[:-100] + b"\0" * 100)
    if not catalog_kept:  # (read again, the shard on disk)
        (cache / STREAM_DIR / "catalog.json").unlink()
    same(batches(streaming(cache, server), 20), expected[:20])
    assert path.read_bytes() == data


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "9" * 400 + "GB"])
def test_cache_limit_nan_or_inf_is_a_clear_error(hosted, tmp_path, monkeypatch, value):
    _, server, _ = hosted
    with pytest.raises(ValueError, match=r"cache_limit must be a finite number of bytes, got "
                                         r".*: pass a size like '20GB', or leave it unset"):
        streaming(tmp_path / "cache", server, cache_limit=value)
    if isinstance(value, str):
        monkeypatch.setenv("NANOCHAT_CACHE_LIMIT", value)
        with pytest.raises(ValueError, match="NANOCHAT_CACHE_LIMIT must be a finite number"):
            streaming(tmp_path / "cache", server, cache_limit=None)
    with pytest.raises(ValueError, match="cache_limit must be a finite number"):
        parse_bytes(value)


# -----------------------------------------------------------------------------
# D: one footer request per shard per machine


@pytest.mark.slow
def test_the_local_ranks_read_each_footer_once(tmp_path, monkeypatch):
    """3 ranks under torchrun stream into one cache; each footer takes the server a second, so
    every rank starts while the first is still reading them. One request per shard: the others
    wait for the catalog's lock and find the entries there. Their batches are the on-disk
    loader's."""
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    write_hosted(hosted, num_train=4)
    out.mkdir()
    serve = shard_server._Handler.do_GET

    def slow_footers(handler):
        if (handler.headers.get("Range") or "").startswith("bytes=-"):
            time.sleep(1.0)
        serve(handler)

    monkeypatch.setattr(shard_server._Handler, "do_GET", slow_footers)
    server = ShardServer(str(hosted))
    env = dict(worker_env(), NANOCHAT_STREAM="1", NANOCHAT_BASE_DIR=str(tmp_path / "base"),
               NANOCHAT_DATA_URL=server.url, NANOCHAT_STREAM_SHARDS="4")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
             os.path.join(TESTS, "stream_worker.py"), str(out), "4"],
            capture_output=True, text=True, timeout=180, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        server.close()
    assert footers(server) == Counter([index_to_filename(i) for i in range(4)] + [VAL])
    for rank in range(3):
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), data_dir=str(hosted), rank=rank, world_size=3, **LOADER)
        expected = [json.loads(json.dumps({"rows": rows_of(inputs, targets), "state": state}))
                    for inputs, targets, state in islice(loader, 4)]
        loader.close()
        with open(out / f"rank{rank}.jsonl") as f:
            assert [json.loads(line) for line in f] == expected


def test_the_catalog_keeps_what_a_failed_reading_read(hosted, tmp_path, monkeypatch):
    """Footers are written to the catalog a chunk at a time: a reading that fails (here a shard
    missing on the server) keeps the entries it read, and the next reads only the rest."""
    _, server, _ = hosted
    monkeypatch.setattr(catalog, "CHUNK", 2)
    names, urls = names_and_urls(server, 4)
    names, urls = names[:4] + ["missing.parquet"], urls[:4] + [f"{server.url}/missing.parquet"]
    with pytest.raises(ConnectionError, match="missing.parquet"):
        read_catalog(str(tmp_path / "cache"), names, urls, FAST, workers=1)
    kept = json.loads((tmp_path / "cache" / STREAM_DIR / "catalog.json").read_text())
    assert sorted(kept) == names[:4]
    before = footers(server)
    read_catalog(str(tmp_path / "cache"), names[:4], urls[:4], FAST)
    assert footers(server) == before
