"""
Tests for the shard server (nanochat/data/fetch/serve.py): which names it serves, and a real
ShardServer on 127.0.0.1 over a tmp dir answering a whole GET, a Range GET (206 and the slice),
index.json (the shards and their sizes) and a 404 for any other name. Run:
    python -m pytest tests/data/fetch/test_serve.py -q
"""

import json
import urllib.error
import urllib.request

import pytest

from nanochat.data.fetch.serve import ShardServer, servable

SHARD = bytes(range(256)) * 4  # 1024 bytes, each offset's value known


@pytest.fixture
def served(tmp_path):
    """A ShardServer over a dir with two shards and a note: (server, dir)."""
    (tmp_path / "a.parquet").write_bytes(SHARD)
    (tmp_path / "b.parquet").write_bytes(b"xyz")
    (tmp_path / "notes.txt").write_bytes(b"secret")
    server = ShardServer(str(tmp_path))
    try:
        yield server, tmp_path
    finally:
        server.close()


def get(url: str, headers: dict | None = None):
    """(status, body, headers) of a GET, with a timeout."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read(), response.headers


def test_servable_names_only_shards_and_the_listing():
    assert servable("shard_00000.parquet") and servable("index.json")
    for name in ("notes.txt", "index.json.bak", "sub/a.parquet", "..\\a.parquet", "../x.parquet"):
        assert not servable(name), name


def test_a_get_returns_the_whole_shard(served):
    server, _ = served
    status, body, headers = get(f"{server.url}/a.parquet")
    assert (status, body, headers["Content-Length"]) == (200, SHARD, "1024")
    assert server.fetched() == ["a.parquet"]


def test_a_range_request_returns_206_and_the_slice(served):
    server, _ = served
    status, body, headers = get(f"{server.url}/a.parquet", {"Range": "bytes=10-19"})
    assert (status, body) == (206, SHARD[10:20])
    assert headers["Content-Range"] == "bytes 10-19/1024"
    status, body, headers = get(f"{server.url}/a.parquet", {"Range": "bytes=-5"})
    assert (status, body, headers["Content-Range"]) == (206, SHARD[-5:], "bytes 1019-1023/1024")
    assert server.gets == [("a.parquet", "bytes=10-19"), ("a.parquet", "bytes=-5")]
    assert server.fetched() == []  # ranges are not whole-file GETs


def test_index_json_lists_the_shards_sorted_with_their_sizes(served):
    server, _ = served
    status, body, _ = get(f"{server.url}/index.json")
    assert status == 200
    assert json.loads(body) == {"files": [{"name": "a.parquet", "size": 1024},
                                          {"name": "b.parquet", "size": 3}]}


@pytest.mark.parametrize("name", ["notes.txt", "missing.parquet"])
def test_another_name_is_a_404(served, name):
    server, _ = served
    with pytest.raises(urllib.error.HTTPError, match="HTTP Error 404"):
        get(f"{server.url}/{name}")
