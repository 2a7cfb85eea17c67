"""
Tests for the small reads of a source (nanochat/data/fetch/small_reads.py): a footer read from a
slow server (a trickle, a stall, headers a byte at a time) fails with a DownloadError naming the
URL, and a streaming loader's first call fails with it, within the deadline. Against the
fault-injecting local HTTP server of conftest.py (`fault_server`). Run:
    python -m pytest tests/data/fetch/test_small_reads.py -q
"""

import pytest

from conftest import FAST, ByteTokenizer, outcome, serve_shards
from nanochat.data.fetch import errors, small_reads
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.serve import ShardServer
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import index_to_filename

NAME = index_to_filename(0)  # the shard most tests fetch


# the limits of the footer tests: a trickle is judged after 1 s, the whole read ends by 5 s
TAIL_LIMITS = Limits(deadline=5, timeout=3, min_rate=2000, rate_window=1)


@pytest.mark.slow
@pytest.mark.parametrize("fault, limits, reason", [
    # a valid 206, then ~50 B/s: the 14 KB would take 5 minutes
    ("trickle", TAIL_LIMITS, "too slow"),
    # no rate floor: the deadline alone ends it
    ("trickle", Limits(deadline=2, timeout=3, min_rate=0), "past the deadline"),
    # every read gets a byte well within the timeout: the deadline cuts the wait for headers
    ("slow_headers", Limits(deadline=2, timeout=3), "past the deadline"),
])
def test_reading_a_footer_from_a_slow_server_fails_in_bounded_time(fault_server, tmp_path, fault,
                                                                    limits, reason):
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = fault
    url = f"{fault_server.url}/{NAME}"
    # the deadline (5 s) and some slack: a bound on a hang, not a benchmark
    error = outcome(lambda: small_reads.fetch_tail(url, small_reads.TAIL_BYTES, limits), 15)
    assert isinstance(error, errors.DownloadError), error
    assert error.reason == reason and url in str(error)
    assert fault_server.ranges[NAME][0] == f"bytes=-{small_reads.TAIL_BYTES}"


@pytest.mark.slow
def test_a_trickling_footer_fails_a_streaming_loaders_first_call_in_bounded_time(fault_server,
                                                                                   tmp_path):
    serve_shards(fault_server, tmp_path, [0, 6542])  # one train shard and the val shard
    for name in fault_server.files:
        fault_server.always[name] = "trickle"

    def first_call():
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), 2, 16, "train", device="cpu", stream=True, num_shards=1,
            base_url=fault_server.url, download_limits=TAIL_LIMITS,
            data_dir=str(tmp_path / "cache"))
        try:
            next(loader)
        finally:
            loader.close()

    error = outcome(first_call, 15)  # (the deadline, 5 s, and slack: a bound on a hang)
    assert isinstance(error, ConnectionError), error
    # the shard and its URL, then what went wrong
    url = f"{fault_server.url}/{NAME}"
    assert f"could not read the footer of shard {NAME} from {url}: " in str(error)
    assert "below the minimum of 2 KB/s" in str(error)  # too slow


def test_fetch_tail_returns_the_size_and_the_last_bytes_of_a_served_shard(tmp_path):
    body = bytes(range(256)) * 3  # 768 bytes
    (tmp_path / "a.parquet").write_bytes(body)
    server = ShardServer(str(tmp_path))
    try:
        assert small_reads.fetch_tail(f"{server.url}/a.parquet", 100, FAST) == (768, body[-100:])
        # more than the file: the whole file
        assert small_reads.fetch_tail(f"{server.url}/a.parquet", 5000, FAST) == (768, body)
    finally:
        server.close()


def test_fetch_small_returns_a_listing_and_none_for_a_missing_file(tmp_path):
    (tmp_path / "index.json").write_bytes(b'{"files": []}')
    server = ShardServer(str(tmp_path))
    try:
        assert small_reads.fetch_small(f"{server.url}/index.json", 1000, FAST) == b'{"files": []}'
        assert small_reads.fetch_small(f"{server.url}/gone.parquet", 1000, FAST) is None
    finally:
        server.close()
    with pytest.raises(ValueError, match=r"fetch_small reads http\(s\) URLs only, not 's3://b/x'"):
        small_reads.fetch_small("s3://b/x", 1000)
