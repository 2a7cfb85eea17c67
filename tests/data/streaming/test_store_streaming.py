"""
Streaming (stream=True) from a store: shards written with pyarrow, kept on disk and uploaded to
moto's S3 server on 127.0.0.1 (the `s3` fixtures of tests/conftest.py). Every streamed batch and
state is checked token for token against the same loader over the copy on disk, with a cache_limit
below the data's size (the peak measured); states move between S3 and disk both ways, and into an
empty cache; the cache evicts only what it fetched; the store's listing is kept for a restart
while the store cannot be reached; two ranks of one machine under torchrun fetch each object once.

    python -m pytest tests/data/streaming/test_store_streaming.py -q
"""

import json
import logging
import os
import random
import re
import subprocess
from collections import Counter

import pytest

from conftest import (FAST, TESTS, ByteTokenizer, assert_same_batches as _same, least_accepted,
                      peak_while, take_batches as _batches, write_shard)
from nanochat.dataloader import (tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.fetch.small_reads import TAIL_BYTES
from nanochat.data.streaming.ledger import STREAM_DIR
from test_streaming_processes import (TORCHRUN, cache_dir, equal_docs, host_shards, on_disk,
                                      read_lines, shards_in, stream_env)

LOADERS = {"bestfit": tokenizing_distributed_data_loader_with_state_bos_bestfit,
           "concat": tokenizing_distributed_data_loader_with_state}
NAMES = [f"part-{i:03d}.parquet" for i in range(13)]  # sorted; the last, part-012, is val
EPOCH = 280  # batches past the end of the first epoch, for both loaders


pytestmark = pytest.mark.usefixtures("fresh_filesystems")


def _upload(bucket, tmp_path) -> tuple[str, str, list[int]]:
    """The shards written to tmp_path/disk (several row groups each) and uploaded under
    "corpus": (the directory, the store's address, the sizes, sorted)."""
    rng = random.Random(0)
    disk = tmp_path / "disk"
    os.makedirs(disk)
    for name in NAMES:
        texts = [f"{name} doc {j}: " + "".join(rng.choice("abcdefgh ")
                                               for _ in range(rng.randint(1, 60)))
                 for j in range(100)]
        write_shard(disk / name, texts, 16)
    bucket.upload_dir(disk, "corpus")
    return str(disk), bucket.url("corpus"), sorted(os.path.getsize(disk / n) for n in NAMES)


def _streaming(kind, base_url, cache, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, base_url=base_url,
                  download_limits=FAST, tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=str(cache), **kwargs)


def _on_disk(kind, directory, **kwargs):
    kwargs = dict(B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8) | kwargs
    return LOADERS[kind](ByteTokenizer(), data_dir=directory, **kwargs)


# -----------------------------------------------------------------------------
# Streamed from S3 is the loader on disk, within the budget


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_streamed_from_s3_equals_on_disk_below_the_datas_size(s3, tmp_path, kind):
    disk, url, sizes = _upload(s3, tmp_path)
    extra = {"buffer_size": 20} if kind == "bestfit" else {}
    expected = _batches(_on_disk(kind, disk, **extra), EPOCH)
    limit = least_accepted(lambda limit: _streaming(kind, url, tmp_path / "least",
                                                    cache_limit=limit, **extra))
    assert limit < 0.8 * sum(sizes)
    cache = tmp_path / "cache"
    streamed, peak = peak_while(cache, lambda: _batches(
        _streaming(kind, url, cache, prefetch_shards=2, cache_limit=limit, **extra), EPOCH))
    _same(streamed, expected)
    assert streamed[-1][2]["next"][0] == 2  # the second epoch began
    assert 0 < peak <= limit
    assert len([f for f in os.listdir(cache) if f.endswith(".parquet")]) < len(NAMES) - 1


@pytest.mark.slow
def test_states_move_between_s3_and_disk_both_ways_and_into_an_empty_cache(s3, tmp_path):
    disk, url, sizes = _upload(s3, tmp_path)
    limit = least_accepted(lambda limit: _streaming("bestfit", url, tmp_path / "least",
                                                    cache_limit=limit, buffer_size=40))
    expected = _batches(_on_disk("bestfit", disk, buffer_size=40), 130)
    first = _batches(_streaming("bestfit", url, tmp_path / "a", cache_limit=limit,
                                buffer_size=40), 100)
    _same(first, expected[:100])
    from_s3 = first[-1][2]
    assert from_s3["buffer"]  # a buffer's documents to restore: the test is about them
    # a state taken while streaming from S3 goes on on disk, and in an empty cache from S3
    _same(_batches(_on_disk("bestfit", disk, buffer_size=40, resume_state_dict=from_s3), 30),
          expected[100:])
    _same(_batches(_streaming("bestfit", url, tmp_path / "b", buffer_size=40,
                              resume_state_dict=from_s3), 30), expected[100:])
    assert not os.path.exists(tmp_path / "b" / NAMES[-1])  # (a train loader never fetches val)
    # and a state taken on disk goes on streaming from S3, into an empty cache
    from_disk = expected[59][2]
    _same(_batches(_streaming("bestfit", url, tmp_path / "c", buffer_size=40,
                              resume_state_dict=from_disk), 40), expected[60:100])


# -----------------------------------------------------------------------------
# What the cache may evict, and the kept listing


@pytest.mark.slow
def test_evicts_only_what_it_fetched_and_restarts_on_the_kept_listing(s3_faulty, tmp_path,
                                                                       caplog):
    disk, url, sizes = _upload(s3_faulty, tmp_path)
    cache = tmp_path / "cache"
    val_expected = _batches(_on_disk("bestfit", disk, split="val", buffer_size=20), 5)
    _same(_batches(_streaming("bestfit", url, cache, split="val", buffer_size=20), 5),
          val_expected)
    mine = cache / NAMES[3]  # the user's own copy of a train shard, placed in the cache
    with open(os.path.join(disk, NAMES[3]), "rb") as src, open(mine, "wb") as dst:
        dst.write(src.read())
    stamp = os.stat(mine).st_mtime_ns
    limit = least_accepted(lambda limit: _streaming("bestfit", url, tmp_path / "cache",
                                                    cache_limit=limit, buffer_size=20))
    expected = _batches(_on_disk("bestfit", disk, buffer_size=20), EPOCH)
    streamed, peak = peak_while(cache, lambda: _batches(
        _streaming("bestfit", url, cache, cache_limit=limit, buffer_size=20), EPOCH))
    _same(streamed, expected)
    assert peak <= limit
    ledger = json.loads((cache / STREAM_DIR / "ledger.json").read_text())["shards"]
    assert any(row["evictions"] for row in ledger.values())  # it did evict
    assert NAMES[3] not in ledger and os.stat(mine).st_mtime_ns == stamp  # never fetched it
    assert (cache / NAMES[-1]).exists()  # nor evicted val, which the val loader fetched
    kept = json.loads((cache / STREAM_DIR / "listing.json").read_text())
    assert kept == {"base_url": url, "names": NAMES}
    # the store out of reach: the val loader starts again on the kept listing and catalog
    s3_faulty.proxy.stop()
    with caplog.at_level(logging.WARNING, logger="nanochat.data.streaming.catalog"):
        again = _batches(_streaming("bestfit", url, cache, split="val", buffer_size=20), 5)
    _same(again, val_expected)
    assert f"could not list the shards in {url}" in caplog.text
    assert "going on with the listing kept in" in caplog.text


def _get_kind(range_header: str | None) -> str:
    """What a GET of a shard was: a download's chunk from byte 0, the first read of a footer (the
    last TAIL_BYTES of a larger file), or another ranged read."""
    start, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", range_header or "bytes=0-0").groups())
    if start == 0:
        return "download"
    return "footer" if end - start + 1 == TAIL_BYTES else "other"


@pytest.mark.slow
def test_ranks_of_one_machine_under_torchrun_fetch_each_object_once(s3_faulty, tmp_path):
    # real processes: two ranks of one machine stream the hub's names from S3 into one cache
    hosted, out = tmp_path / "hosted", tmp_path / "out"
    # documents long enough that a shard is larger than TAIL_BYTES: a footer read's range then
    # starts past byte 0, a download's at it
    names = host_shards(hosted, 6, equal_docs(48, 3000), row_group_size=2)
    assert all(os.path.getsize(hosted / name) > TAIL_BYTES for name in names)
    out.mkdir()
    s3_faulty.upload_dir(hosted, "hub")
    s3_faulty.proxy.clear()
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2",
           os.path.join(TESTS, "stream_worker.py"), str(out), "20"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                            env=stream_env(tmp_path / "base", s3_faulty.url("hub"), len(names)))
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert read_lines(out / f"rank{rank}.jsonl") == on_disk(hosted, 20, rank, 2)
    # A footer read is a stat (HEAD) and a GET of the file's last TAIL_BYTES (then one of the
    # whole footer, when it is longer); a download, a stat, GETs of its chunks (one for shards this
    # small, from byte 0) and a stat at the end. A loader's start also stats the shards on disk
    # (has the source changed them?), so HEADs are not counted
    seen = Counter((s.path, _get_kind(s.range)) for s in s3_faulty.proxy.seen()
                   if s.method == "GET")
    # no cache_limit: nothing is evicted, so the cache holds every shard fetched; how far the
    # loaders fetched ahead of the shard they read last depends on timing
    fetched = set(shards_in(cache_dir(tmp_path / "base")))
    last_read = max(read_lines(out / f"rank{rank}.jsonl")[-1]["state"]["pq_idx"]
                    for rank in range(2))
    assert set(names[:last_read + 1]) <= fetched <= set(names)
    for name in sorted(fetched):  # (a shard not fetched may have had a download stopped at close)
        path = f"/{s3_faulty.bucket}/hub/{name}"
        downloads, footer_reads = seen[(path, "download")], seen[(path, "footer")]
        assert downloads == 1 and footer_reads <= 1, (name, downloads, footer_reads)
