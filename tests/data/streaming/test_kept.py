"""
Kept copies of buffered documents (nanochat/data/streaming/kept.py): once a shard may go, the
documents recent states still buffer are copied; each buffered document is on disk or in a copy,
with its shard's text; a resume reads the copies and fetches none of their shards; a damaged,
truncated or edited copy is removed with a warning and its shard fetched again; shards of another
split in the cache do not stop the copies. Shards are served by a real HTTP server on 127.0.0.1.

    python -m pytest tests/data/streaming/test_kept.py -q
"""

import gzip
import hashlib
import json
import logging
import os
import shutil

import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from conftest import (assert_same_batches as _same, take_batches as _batches, write_hosted,
                      write_shard)
from nanochat.data.base.state import DocKey, decode_keys
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming import cache as shard_cache
from nanochat.data.streaming.kept import (Copy, CopyPlan, Keeper, drop_oldest, encode, file_mtime,
                                         kept_bytes, kept_root, read_copy, remove_gone)
from nanochat.data.streaming.ledger import KEPT_SUFFIX, Ledger, STREAM_DIR, Table
from nanochat.data.base.datasets import index_to_filename
from served_shards import (batches, disk_loader, expected, hosted_once, kept_texts, same, split_dir,
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
def test_a_buffers_documents_are_on_disk_or_kept_and_a_resume_reads_the_copies(hosted_once,
                                                                                tmp_path):
    """Documents longer than a row (T=64) wait in the best-fit buffer for many shards. After every
    batch, each document the yielded state buffers is in its shard on disk or in a copy, with the
    shard's text; a resume in the same cache reads the copies and fetches none of the shards they
    came from."""
    hosted_dir, server, sizes = hosted_once
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
def test_a_damaged_kept_copy_is_removed_and_its_shard_fetched_again(hosted_once, expected, streamed,
                                                                     tmp_path, caplog, damage):
    """The shard files are gone but the copies are there; one copy of the resumed buffer's
    documents is damaged. The resume names it in one warning, removes it (and its row in the
    ledger), fetches its shard again, and its batches are the on-disk loader's."""
    hosted_dir, server, _ = hosted_once
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
# The module's functions on tmp files (fast)

def put_copy(root, owner: str, name: str, body: bytes, mtime: float) -> str:
    """A copy's file at root/owner/name + KEPT_SUFFIX, with the given bytes and mtime."""
    os.makedirs(os.path.join(root, owner), exist_ok=True)
    path = os.path.join(root, owner, name + KEPT_SUFFIX)
    with open(path, "wb") as f:
        f.write(body)
    os.utime(path, (mtime, mtime))
    return path


def test_encode_writes_the_same_bytes_for_the_same_documents_and_read_copy_reads_them(tmp_path):
    texts = {(1, 0): "b", (0, 2): "a"}
    data = encode(texts)
    assert data == encode(dict(reversed(list(texts.items()))))  # sorted, mtime 0
    docs = [[0, 2, "a"], [1, 0, "b"]]
    assert json.loads(gzip.decompress(data)) == {
        "sha256": hashlib.sha256(json.dumps(docs).encode()).hexdigest(), "docs": docs}
    path = tmp_path / "copy.json.gz"
    path.write_bytes(data)
    assert read_copy(str(path)) == texts
    edited = {"sha256": json.loads(gzip.decompress(data))["sha256"], "docs": [[0, 2, "A"]]}
    path.write_bytes(gzip.compress(json.dumps(edited).encode()))
    with pytest.raises(ValueError, match="its documents do not match its sha256"):
        read_copy(str(path))


def test_file_mtime_and_kept_bytes_count_what_is_on_disk(tmp_path):
    root = kept_root(str(tmp_path))
    assert root == os.path.join(str(tmp_path), STREAM_DIR, "kept")
    assert kept_bytes(root) == 0  # no directory yet
    path = put_copy(root, "host-1-0", "a.parquet", b"x" * 10, 1000.0)
    put_copy(root, "host-2-0", "b.parquet", b"y" * 7, 2000.0)
    assert file_mtime(path) == 1000.0
    assert file_mtime(str(tmp_path / "gone")) == 0.0
    assert kept_bytes(root) == 17


def test_remove_gone_and_drop_oldest_remove_files_and_their_rows(tmp_path):
    root = kept_root(str(tmp_path))
    old = put_copy(root, "live", "a.parquet", b"x" * 10, 1000.0)
    new = put_copy(root, "live", "b.parquet", b"y" * 20, 3000.0)
    put_copy(root, "dead", "c.parquet", b"z" * 5, 2000.0)
    table = Table(kept={"live": {"a.parquet": 10, "b.parquet": 20}, "dead": {"c.parquet": 5},
                        "ghost": {"d.parquet": 1}})
    remove_gone(root, table, {"live"})
    assert sorted(os.listdir(root)) == ["live"]
    assert table.kept == {"live": {"a.parquet": 10, "b.parquet": 20}}
    # oldest first, until 5 bytes are dropped: the first (10 bytes) is enough
    assert drop_oldest(root, table, lambda dropped: dropped >= 5) == 10
    assert not os.path.exists(old) and os.path.exists(new)
    assert table.kept == {"live": {"b.parquet": 20}}


def test_a_keeper_plans_writes_and_removes_its_copies(tmp_path):
    names = ["shard_00000.parquet", "shard_00001.parquet"]
    write_shard(tmp_path / names[0], ["zero", "one", "two", "three"], 2)
    keeper = Keeper(str(tmp_path), names, "host-1-0", 1, Ledger(str(tmp_path)))
    keeper.hold([DocKey(0, 0, 1, 1), DocKey(0, 0, 0, 0), DocKey(0, 1, 0, 0)])
    assert keeper.unkept == {0, 1} and keeper.pending
    assert keeper.plan({1}) == CopyPlan([Copy(0, frozenset({(0, 0), (1, 1)}))], [])
    # shard 0 is on disk: its documents are read from it (row group 1, row 1 is "three")
    texts = keeper.texts(0, frozenset({(0, 0), (1, 1)}))
    assert texts == {(0, 0): "zero", (1, 1): "three"}
    table = Table()
    keeper.write(0, encode(texts), table)
    assert keeper.path(0) == os.path.join(kept_root(str(tmp_path)), "host-1-0",
                                          "shard_00000.parquet.json.gz")
    assert read_copy(keeper.path(0)) == texts
    assert table.kept == {"host-1-0": {"shard_00000.parquet": len(encode(texts))}}
    keeper.remove(0, table)
    assert not os.path.exists(keeper.path(0)) and table.kept == {"host-1-0": {}}
