"""
Tests for the bounds of one file's fetch (nanochat/data/fetch/limits.py: Limits, and Pace as the
bytes arrive): the limits' own checks, a trickling server failed by the rate over a window (its
bytes kept), and a deadline over all attempts. Against the fault-injecting local HTTP server of
conftest.py (`fault_server`); outcome() bounds a hang, no assertion times anything. Run:
    python -m pytest tests/data/fetch/test_limits.py -q
"""

import os
import re

import pytest

from conftest import assert_only_complete_shards, download_shard, outcome, serve_shards
from nanochat.data.fetch.limits import Limits
from nanochat.data.base.datasets import index_to_filename

NAME = index_to_filename(0)  # the shard most tests fetch


def test_limits_are_checked():
    with pytest.raises(ValueError, match="deadline"):
        Limits(deadline=0)


def test_trickling_server_fails_within_the_rate_window(fault_server, tmp_path, caplog):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "trickle"  # 100 bytes, then ~50 bytes/s
    # (outcome: a bound on a hang, not a benchmark; 14 KB at 50 B/s would take minutes)
    assert outcome(lambda: download_shard(fault_server, tmp_path, 0, max_attempts=2,
                                          min_rate=1000, rate_window=0.3)) is False
    # each attempt ended by its rate over the window, long before the body was through
    assert "below the minimum of 1 KB/s" in caplog.text
    assert fault_server.gets[NAME] == 2 and fault_server.sent[NAME] < len(served[0])
    assert fault_server.ranges[NAME][1].startswith("bytes=")  # the trickled bytes were kept


def test_trickle_once_then_the_rest(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["trickle"]
    assert download_shard(fault_server, tmp_path, 0, min_rate=1000, rate_window=0.3)
    kept = int(re.fullmatch(r"bytes=(\d+)-", fault_server.ranges[NAME][1]).group(1))
    assert kept > 100  # the fast part and what trickled before the window closed
    assert_only_complete_shards(tmp_path / "data", served)


def test_deadline_bounds_a_shard_however_its_attempts_go(fault_server, tmp_path, caplog):
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "trickle"
    # fast enough, never finished (outcome: a bound on a hang, not a benchmark)
    assert outcome(lambda: download_shard(fault_server, tmp_path, 0, min_rate=0,
                                          deadline=0.5)) is False
    assert "past the deadline" in caplog.text
    assert fault_server.sent[NAME] < len(served[0])  # cut mid-body
    assert os.path.getsize(tmp_path / "data" / f"{NAME}.tmp") > 100  # kept for the next run
