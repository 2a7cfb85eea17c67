"""
The machine's ledger of a streaming cache (nanochat/data/streaming/ledger.py): a garbage or
damaged file warned about once and rebuilt from the disk (and a resume at the least cache_limit
after it), a table of the wrong shape read without its bad rows, a row whose pid names another
process pinning nothing, and a row of unknown liveness pinning shards for one bounded wait. Shards
are served by a real HTTP server on 127.0.0.1, and streamed batches compared with the on-disk
loader's.

    python -m pytest tests/data/streaming/test_ledger.py -q
"""

import json
import logging
import os
import shutil
import socket
import subprocess

import pytest

from conftest import least_accepted, outcome, write_shard
from nanochat.data.streaming import cache as shard_cache, ledger as ledger_module
from nanochat.data.streaming.ledger import FETCHED, Ledger, Loader, ShardEntry, STREAM_DIR, Table
from nanochat.data.base.datasets import index_to_filename
from served_shards import (all_train_shards_fetched, batches, batches_of, expected, hosted_once,
                           same, streamed, streaming, warnings_about)


HOST = socket.gethostname()
S = [index_to_filename(i) for i in range(2)]  # shard_00000.parquet, shard_00001.parquet


def test_a_garbage_ledger_is_warned_about_once_and_replaced(hosted_once, expected, tmp_path,
                                                             caplog):
    """A loader reads the ledger at every state: a garbage file is one warning, until a write
    replaces it (a garbage file written again is another)."""
    _, server, _ = hosted_once
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
def test_a_row_whose_pid_now_names_another_process_pins_nothing(hosted_once, expected, tmp_path,
                                                                 monkeypatch):
    """A loader's row records its pid and its process's start time. A row whose pid is alive but
    names a process started at another time (the pid was reused) is a gone loader's: the shards it
    said it needed are evicted at once, where the pid alone would pin them (a reader waiting for
    room, then a ValueError)."""
    _, server, sizes = hosted_once
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 5.0)  # (a stall is an error within seconds)
    cache = tmp_path / "cache"
    # every train shard on disk, fetched by a streaming loader: evicted only when no one needs it
    names = all_train_shards_fetched(cache, server)
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
        hosted_once, expected, streamed, tmp_path, caplog):
    """A streaming run left its shards and copies; then its ledger became garbage. The shards it
    fetched stay evictable (their download records say so), so a resume at the least cache_limit of
    the intact cache is accepted, evicts what it fetched before, and gives the on-disk batches.
    Else they would count as the user's own, never evicted, and the resume be refused."""
    _, server, _ = hosted_once
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
        hosted_once, expected, tmp_path, monkeypatch, caplog, unknown):
    """A row whose liveness cannot be told holds every train shard: it has no start time and names
    a live pid (this process's, as an older writer's row would), or its start time cannot be read
    (no /proc), or it is another host's. A reader waits for room for STALE_WAIT, then the row counts
    as stale: one warning names it and the ledger, and the loader goes on, its batches exact.
    Pinned, the reader would wait ROOM_WAIT, then raise."""
    _, server, sizes = hosted_once
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 5.0)  # (a stall is an error within seconds)
    monkeypatch.setattr(shard_cache, "STALE_WAIT", 0.2, raising=False)
    cache = tmp_path / "cache"
    names = all_train_shards_fetched(cache, server)
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


def test_a_ledger_of_the_wrong_shape_is_read_as_empty_or_without_its_bad_rows(tmp_path, caplog):
    (tmp_path / STREAM_DIR).mkdir()
    path = tmp_path / STREAM_DIR / "ledger.json"
    ledger = Ledger(str(tmp_path))
    for text in ("[1, 2, 3]", "{not json"):
        path.write_text(text)
        assert ledger.read() == Table()
    live = Loader(HOST, os.getpid(), None, {})
    path.write_text(json.dumps({
        "loaders": {"a": {"host": HOST}, "b": vars(live)},
        "shards": {S[0]: {"state": "lost"}, S[1]: {"state": "fetched", "evictions": 0}},
        "kept": {"a": [1]}, "evicting": "yes"}))
    assert ledger.read() == Table(loaders={"b": live}, shards={S[1]: ShardEntry(FETCHED)})
    # (a shard's and a copy's rows are on disk: rebuilt from there; here there are none)
    assert (f"{path}: dropped parts or entries of the wrong shape: ['evicting', 'a', "
            "'shard_00000.parquet', 'a']; rebuilt from what is on disk: ") in caplog.text
