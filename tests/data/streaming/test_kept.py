"""
Kept copies of buffered documents (nanochat/data/streaming/kept.py): once a shard may go, the
documents recent states still buffer are copied; each buffered document is on disk or in a copy,
with its shard's text; a resume reads the copies and fetches none of their shards; a damaged,
truncated or edited copy is removed with a warning and its shard fetched again; shards of another
split in the cache do not stop the copies. Shards are served by a real HTTP server on 127.0.0.1.

    python -m pytest tests/data/streaming/test_kept.py -q
"""

import gzip
import json
import logging
import os
import shutil

import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from conftest import assert_same_batches as _same, take_batches as _batches, write_hosted
from nanochat.data.base.state import decode_keys
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming import cache as shard_cache
from nanochat.data.streaming.ledger import Ledger, STREAM_DIR
from nanochat.data.base.datasets import index_to_filename
from served_shards import (batches, disk_loader, expected, hosted, kept_texts, same, split_dir,
                           stream_loader, streamed, streaming, VAL, warnings_about)


@pytest.mark.slow
def test_shards_outside_the_split_in_the_cache_do_not_stop_the_copies(tmp_path, monkeypatch):
    """A cache_limit that holds the split and the val shard, but not the 3 shards already in the
    cache from elsewhere (as after an earlier -n run): the loader must evict, so it copies buffered
    documents, and runs into the next epoch with the on-disk loader's batches (without copies the
    shards of long documents would fill the budget for good: a reader waiting for room, then an
    error)."""
    monkeypatch.setattr(shard_cache, "ROOM_WAIT", 3.0)
    hosted_dir = tmp_path / "hosted"
    write_hosted(hosted_dir, 12)
    server = ShardServer(str(hosted_dir))
    cache = tmp_path / "cache"
    cache.mkdir()
    for i in (9, 10, 11):
        shutil.copy(hosted_dir / index_to_filename(i), cache)
    train = [os.path.getsize(hosted_dir / index_to_filename(i)) for i in range(9)]
    limit = sum(train) + os.path.getsize(hosted_dir / VAL)
    try:
        expected = _batches(disk_loader("bestfit", split_dir(hosted_dir, tmp_path / "split", 9),
                                        buffer_size=20), 420)
        loader = stream_loader("bestfit", server, cache, num_shards=9, cache_limit=limit,
                               prefetch_shards=1, buffer_size=20)
        assert loader.cache_status().copying
        _same(_batches(loader, 420), expected)
    finally:
        server.close()
    assert expected[-1][2]["next"][0] == 2  # into the second epoch
    assert os.listdir(cache / STREAM_DIR / "kept")  # it copied


@pytest.mark.slow
def test_a_buffers_documents_are_on_disk_or_kept_and_a_resume_reads_the_copies(hosted, tmp_path):
    """Documents longer than a row (T=64) wait in the best-fit buffer for many shards. After every
    batch, each document the yielded state buffers is in its shard on disk or in a copy, with the
    shard's text; a resume in the same cache reads the copies and fetches none of the shards they
    came from."""
    hosted_dir, server, sizes = hosted
    cache = tmp_path / "cache"
    source = {}  # name -> {(rg_idx, row): text} of the hosted shards
    for name in sorted(os.listdir(hosted_dir)):
        pf = pq.ParquetFile(os.path.join(hosted_dir, name))
        source[name] = {(g, r): text for g in range(pf.num_row_groups)
                        for r, text in enumerate(pf.read_row_group(g).column("text").to_pylist())}
    expected = _batches(disk_loader("bestfit", hosted_dir, buffer_size=20), 260)
    # about the least: (packing 2 + prefetch_shards=1 + 1) x the largest, val, copies
    limit = int(5.2 * sizes[-1])
    loader = stream_loader("bestfit", server, cache, cache_limit=limit, prefetch_shards=1,
                           buffer_size=20)
    copied = set()  # shards of buffered documents seen evicted, their documents kept
    streamed = []
    for inputs, targets, state in loader:
        streamed.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
        wanted = {}
        for key in decode_keys(state["buffer"]):
            wanted.setdefault(index_to_filename(key[1]), set()).add((key[2], key[3]))
        with FileLock(os.path.join(cache, STREAM_DIR, "lock")):  # (what evicts and copies holds it)
            for name, rows in wanted.items():
                if not (cache / name).exists():
                    kept = kept_texts(cache, name)
                    assert ({row: kept.get(row) for row in rows}
                            == {row: source[name][row] for row in rows}), name
                    copied.add(name)
        if len(streamed) == 200:
            break
    loader.close()
    _same(streamed, expected[:200])
    assert copied  # not vacuous: shards went while documents of theirs were buffered
    state = streamed[-1][2]
    gone = ({index_to_filename(key[1]) for key in decode_keys(state["buffer"])}
            - set(os.listdir(cache)))
    assert gone  # the resume needs documents of shards no longer on disk
    before = len(server.fetched())
    # (prefetch=0, prefetch_shards=0: nothing read or fetched ahead into the next epoch, which
    # reads them again)
    resumed = _batches(stream_loader("bestfit", server, cache, cache_limit=limit, prefetch_shards=0,
                                     buffer_size=20, resume_state_dict=state, prefetch=0), 60)
    _same(resumed, expected[200:])
    assert not gone & set(server.fetched()[before:])  # read from the copies


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
