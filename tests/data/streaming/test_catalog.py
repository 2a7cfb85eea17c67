"""
The catalog of a streamed split (nanochat/data/streaming/catalog.py): each shard's size and row
groups from its footer, read once (one ranged request per shard, the local ranks' together) and
kept; entries of the wrong shape or size read again or corrected from the file; a shard damaged in
the cache fetched again, not read for the catalog; what a failed reading read is kept. Shards are
served by a real HTTP server on 127.0.0.1, and streamed batches compared with the on-disk loader's.

    python -m pytest tests/data/streaming/test_catalog.py -q
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from itertools import islice

import pytest

from conftest import (FAST, ByteTokenizer, TESTS as HERE, take_batches as _batches, worker_env,
                      write_hosted)
from nanochat.data.fetch import serve as shard_server
from nanochat.data.fetch.small_reads import fetch_tail
from nanochat.data.fetch.errors import DownloadError
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming import catalog
from nanochat.data.streaming.catalog import catalog_entry, footer_docs_per_group, read_catalog
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import index_to_filename
from served_shards import (batches, expected, footers, hosted_once, same, stream_loader, streamed,
                           streaming, VAL, warnings_about)
from stream_worker import LOADER, rows_of


def test_catalog_is_read_once_and_reused(hosted_once, tmp_path):
    hosted_dir, server, _ = hosted_once
    start = len(server.gets)  # (the server is the file's: what this test asks for, from here)
    _batches(stream_loader("bestfit", server, tmp_path / "cache"), 1)
    # the file's end
    footers = [name for name, wanted in server.gets[start:]
               if wanted and wanted.startswith("bytes=-")]
    # val's too: the budget counts it
    assert sorted(footers) == [index_to_filename(i) for i in range(7)] + [VAL]
    catalog = json.loads((tmp_path / "cache" / STREAM_DIR / "catalog.json").read_text())
    for i in range(7):
        path = os.path.join(hosted_dir, index_to_filename(i))
        entry = catalog[index_to_filename(i)]
        assert entry["size"] == os.path.getsize(path)
        assert sum(entry["rows"]) == 300 and entry["rows"][0] == 32
    before = len(server.gets)
    _batches(stream_loader("bestfit", server, tmp_path / "cache"), 1)
    assert not [name for name, wanted in server.gets[before:]
                if wanted and wanted.startswith("bytes=-")]


def test_fetch_tail_and_footer_docs_per_group(hosted_once):
    hosted_dir, server, _ = hosted_once
    path = os.path.join(hosted_dir, index_to_filename(1))
    body = open(path, "rb").read()
    size, tail = fetch_tail(f"{server.url}/{index_to_filename(1)}", 100, FAST)
    assert (size, tail) == (len(body), body[-100:])
    size, tail = fetch_tail(f"{server.url}/{index_to_filename(1)}", 10 * len(body), FAST)
    assert tail == body
    # too short for the footer: ask again for it whole
    assert footer_docs_per_group(body[-100:], "x") is None
    assert footer_docs_per_group(body, "x") == [32] * 9 + [12]
    with pytest.raises(ValueError, match="not a parquet file"):
        footer_docs_per_group(b"x" * 100, "http://h/shard_00000.parquet")
    with pytest.raises(DownloadError, match="HTTP 404"):
        fetch_tail(f"{server.url}/missing.parquet", 100, FAST)


def test_fetch_tail_needs_range_support(tmp_path):
    (tmp_path / "f.parquet").write_bytes(b"PAR1" + b"x" * 100 + b"PAR1")
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(DownloadError, match="must honour Range requests"):
            fetch_tail(f"http://127.0.0.1:{server.server_address[1]}/f.parquet", 10, FAST)
    finally:
        server.shutdown()
        server.server_close()


def names_and_urls(server, num_train: int = 7) -> tuple[list[str], list[str]]:
    """The shards a train loader's catalog holds (with the val shard's), and their URLs."""
    names = [index_to_filename(i) for i in range(num_train)] + [VAL]
    return names, [f"{server.url}/{name}" for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["[1, 2, 3]", "entries"])
def test_a_catalog_of_the_wrong_shape_is_read_again(hosted_once, expected, tmp_path, caplog, bad):
    """A catalog that is a list, or whose entries are not {"url": str, "size": int, "rows":
    [int, ...]} with their checksum: one warning, the bad entries read again from the footers,
    the catalog written whole again, and the batches the on-disk loader's."""
    _, server, _ = hosted_once
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


def test_a_wrong_size_in_the_catalog_is_corrected_and_the_resume_is_exact(
        hosted_once, expected, streamed, tmp_path, caplog):
    """The catalog gives the sizes the state's fingerprint of the files is taken on. One entry
    disagrees with its shard on disk (its checksum right: as after the file changed on the
    server), another's size was changed on disk (its checksum wrong): the first is corrected from
    the file, with a warning that names the shard, the catalog and both values, and the second is
    read again from the server's footer. The resume is exact."""
    _, server, _ = hosted_once
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
        hosted_once, expected, tmp_path, damage, catalog_kept):
    """A shard the cache holds is cut in half, or its last bytes zeroed (its record as it was;
    the catalog too, or gone): the next loader neither plans on it nor fails on it; it fetches it
    again, and the batches are exact."""
    hosted_dir, server, _ = hosted_once
    cache = tmp_path / "cache"
    same(batches(streaming(cache, server), 1), expected[:1])
    path = cache / index_to_filename(0)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "cut" else data[:-100] + b"\0" * 100)
    if not catalog_kept:  # (read again, the shard on disk)
        (cache / STREAM_DIR / "catalog.json").unlink()
    same(batches(streaming(cache, server), 20), expected[:20])
    assert path.read_bytes() == data


@pytest.mark.slow
def test_the_local_ranks_read_each_footer_once(tmp_path, monkeypatch):
    """3 ranks under torchrun stream into one cache; each footer takes the server a second, so
    every rank starts while the first is still reading them. One request per shard: the others
    wait for the catalog's lock and find the entries there. Their batches are the on-disk
    loader's."""
    hosted_once, out = tmp_path / "hosted", tmp_path / "out"
    write_hosted(hosted_once, num_train=4)
    out.mkdir()
    serve = shard_server._Handler.do_GET

    def slow_footers(handler):
        if (handler.headers.get("Range") or "").startswith("bytes=-"):
            time.sleep(1.0)
        serve(handler)

    monkeypatch.setattr(shard_server._Handler, "do_GET", slow_footers)
    server = ShardServer(str(hosted_once))
    env = dict(worker_env(), NANOCHAT_STREAM="1", NANOCHAT_BASE_DIR=str(tmp_path / "base"),
               NANOCHAT_DATA_URL=server.url, NANOCHAT_STREAM_SHARDS="4")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
             os.path.join(HERE, "stream_worker.py"), str(out), "4"],
            capture_output=True, text=True, timeout=180, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        server.close()
    assert footers(server) == Counter([index_to_filename(i) for i in range(4)] + [VAL])
    for rank in range(3):
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), data_dir=str(hosted_once), rank=rank, world_size=3, **LOADER)
        expected = [json.loads(json.dumps({"rows": rows_of(inputs, targets), "state": state}))
                    for inputs, targets, state in islice(loader, 4)]
        loader.close()
        with open(out / f"rank{rank}.jsonl") as f:
            assert [json.loads(line) for line in f] == expected


def test_the_catalog_keeps_what_a_failed_reading_read(hosted_once, tmp_path, monkeypatch):
    """Footers are written to the catalog a chunk at a time: a reading that fails (here a shard
    missing on the server) keeps the entries it read, and the next reads only the rest."""
    _, server, _ = hosted_once
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
