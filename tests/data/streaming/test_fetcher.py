"""
The shard cache's fetching thread (nanochat/data/streaming/fetcher.py), in one process against a
real HTTP server on 127.0.0.1: a shard fetched is checked against the catalog the walk was planned
on, and one that changed at its source since is an error naming the file, both sizes and the fix,
raised in the reader. Faults of the server itself (gone, silent, an outage) and torchrun:
test_streaming_processes.py.

    python -m pytest tests/data/streaming/test_fetcher.py -q
"""

import pytest

from conftest import write_hosted, write_shard
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.catalog import catalog_path
from nanochat.data.base.datasets import index_to_filename
from served_shards import batches_of, streaming


def test_a_shard_changed_at_its_source_mid_run_is_an_error_naming_both_sizes(tmp_path):
    hosted = tmp_path / "hosted"
    write_hosted(hosted)
    name = index_to_filename(5)
    planned = (hosted / name).stat().st_size
    server = ShardServer(str(hosted))
    loader = streaming(tmp_path / "cache", server, prefetch_shards=0, prefetch=0, workers=0)
    try:
        batches_of(loader, 1)  # the walk is planned on the catalog: shard 5 is not fetched yet
        write_shard(str(hosted / name), [f"changed {j}" for j in range(100)], 10)
        with pytest.raises(ValueError) as raised:
            batches_of(loader, 400)
    finally:
        loader.close()
        server.close()
    path = tmp_path / "cache" / name
    assert str(raised.value) == (
        f"{path} ({server.url}/{name}) is not the shard the walk was planned on: "
        f"{path.stat().st_size} bytes and 10 row groups, the catalog "
        f"{catalog_path(str(tmp_path / 'cache'))} says {planned} and 10; the file changed at its "
        "source. Remove the catalog to start over (states taken on the old files will be refused)")
    assert path.stat().st_size != planned  # (the changed file, on disk)
