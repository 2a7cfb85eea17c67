"""
Eviction in a streaming cache (nanochat/data/streaming/eviction.py): a shard goes only when no live
loader of the machine needs it, those no loader reads soon first, oldest first; and copies of
buffered documents beyond the room the budget check set aside give way, with a warning, to a reader
waiting for room, its batches still the on-disk loader's, the disk within the limit.

    python -m pytest tests/data/streaming/test_eviction.py -q
"""

import logging
import os
import random
import socket

import pytest

from conftest import (FAST, assert_same_batches as _same, least_accepted, peak_while,
                      take_batches as _batches, write_shard)
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming import cache as shard_cache
from nanochat.data.streaming.cache import ShardCache
from nanochat.data.streaming.ledger import FETCHED, Ledger, Loader, ShardEntry, STREAM_DIR, Table
from nanochat.data.base.datasets import index_to_filename
from served_shards import disk_loader, split_dir, stream_loader


def test_eviction_spares_what_any_loader_of_the_machine_needs(tmp_path):
    """With another live loader's needs on record (it reads shard 0, fetched shard 1 ahead, and
    buffers documents of shard 2 that it has not copied yet), making room evicts only the shards no
    one needs, oldest first, and says there is no room rather than evict one of those."""
    cache = tmp_path / "cache"
    names = [index_to_filename(i) for i in range(6)]
    (cache / STREAM_DIR).mkdir(parents=True)
    # 1,000 bytes each, fetched by a streaming loader, oldest first
    for i, name in enumerate(names[:5]):
        (cache / name).write_bytes(b"x" * 1000)
        os.utime(cache / name, (1e9 + i, 1e9 + i))
    ledger = Ledger(str(cache))
    needs = {names[0]: "reading", names[1]: "ahead", names[2]: "buffered"}
    with ledger.lock:
        another = Loader(socket.gethostname(), os.getpid(), 4000, needs)
        ledger.write(Table(loaders={"another": another},
                           shards={name: ShardEntry(FETCHED) for name in names[:5]}))
    shards = ShardCache(str(cache), names, [f"http://127.0.0.1:9/{name}" for name in names],
                        [1000] * 6, prefetch_shards=0, cache_limit=4000, limits=FAST)

    def on_disk():
        return sorted(name for name in os.listdir(cache) if name.endswith(".parquet"))

    def make_room() -> bool:
        with ledger.lock:
            table = ledger.read()
            room = shards.room.make(table, names[5])
            ledger.write(table)
        return room

    assert make_room()  # 5 shards and the one to fetch: 6,000 bytes; 3 and 4 go
    assert on_disk() == names[:3]
    shards.room.budget = shards.room.budget._replace(limit=2000)  # (a smaller limit from here)
    assert not make_room()  # only what the other loader needs is left
    assert on_disk() == names[:3]
    with ledger.lock:  # that loader is gone: its shards may go, oldest first
        table = ledger.read()
        del table.loaders["another"]
        ledger.write(table)
    assert make_room()
    assert on_disk() == names[2:3]
    table = ledger.read()
    assert table.fetched() == names[2:3] and table.evicting
    evicted = {name: row.evictions for name, row in table.shards.items() if row.state == "evicted"}
    assert evicted == {names[0]: 1, names[1]: 1, names[3]: 1, names[4]: 1}


@pytest.mark.slow
def test_copies_beyond_their_room_give_way_to_a_waiting_reader(tmp_path, monkeypatch, caplog):
    """One document in 20 is 8,000 characters, far longer than a row: best-fit keeps them waiting,
    and their copies outgrow the room the budget check sets aside (copies_estimate, from the average
    document: ~55 KB here, against ~250 KB). At the least cache_limit it accepts, the reader that
    finds no room has the oldest copies dropped, with a warning, rather than wait: the batches are
    the on-disk loader's, and the disk stays within the limit."""
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 3.0)
    hosted_dir = tmp_path / "hosted"
    hosted_dir.mkdir()
    rng = random.Random(1)
    for i in list(range(30)) + [6542]:
        texts = [f"s{i} d{j}: " + "".join(rng.choice("abcdefgh ") for _ in range(
                 8000 if rng.random() < 0.05
            else rng.choice([rng.randint(1, 40), rng.randint(1, 300)])))
            for j in range(80)]
        write_shard(os.path.join(hosted_dir, index_to_filename(i)), texts, 16)
    server = ShardServer(str(hosted_dir))
    settings = dict(num_shards=30, prefetch_shards=1, buffer_size=60)
    try:
        limit = least_accepted(lambda limit: stream_loader("bestfit", server, tmp_path / "cache",
                                                           cache_limit=limit, **settings))
        expected = _batches(disk_loader("bestfit", split_dir(hosted_dir, tmp_path / "split", 30),
                                        buffer_size=60), 1500)
        with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.cache"):
            streamed, peak = peak_while(tmp_path / "cache", lambda: _batches(stream_loader(
                "bestfit", server, tmp_path / "cache", cache_limit=limit, **settings), 1500))
    finally:
        server.close()
    _same(streamed, expected)
    assert peak <= limit
    assert any("the copies of buffered documents" in record.getMessage()
               for record in caplog.records)
