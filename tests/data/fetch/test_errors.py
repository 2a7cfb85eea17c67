"""
Tests for the errors a retry cannot heal (nanochat/data/fetch/errors.py): an address without
http:// or https:// refused before any request, a host that does not resolve (the API, the CLI, a
redirect's target) stopping the run at once without a retry, and a failed lookup of a host that
has answered, retried. Against the fault-injecting local HTTP server of conftest.py
(`fault_server`). Run:
    python -m pytest tests/data/fetch/test_errors.py -q
"""

import os
import socket
import subprocess
import sys

import pytest

from conftest import (REPO_ROOT, assert_only_complete_shards, download_shard, outcome,
                      serve_shards)
from nanochat.data.fetch import errors
from nanochat.data.fetch.errors import HostNotFoundError
from nanochat.dataset import download_shards, download_single_file, main
from nanochat.data.base.datasets import index_to_filename

NAME = index_to_filename(0)  # the shard most tests fetch


@pytest.mark.parametrize("url", ["127.0.0.1:8000/resolve/main", "ftp://example.com/x", "http://",
                                 "/srv/shards"])
def test_url_without_http_scheme_is_refused_up_front(fault_server, tmp_path, url):
    data_dir = str(tmp_path / "data")
    for call in (lambda: download_shards([0], data_dir, url),
                 lambda: download_single_file(0, data_dir, url),
                 lambda: main(["-n", "1", "--base-url", url, "--data-dir", data_dir])):
        with pytest.raises(ValueError, match="must start with http:// or https://"):
            call()
    assert not os.path.exists(data_dir)


def test_unresolvable_host_stops_the_run_at_once(tmp_path, caplog):
    # .invalid never resolves (RFC 2606); a retry would log "retrying in 30s" before its wait
    url = "http://shards.invalid/resolve/main"
    data_dir = tmp_path / "data"
    error = outcome(lambda: download_shards(range(8), str(data_dir), url, num_workers=4,
                                            backoff_base=30, check_disk=False))
    assert isinstance(error, HostNotFoundError), error
    assert "cannot resolve the host 'shards.invalid' of http://shards.invalid/" in str(error)
    error = outcome(lambda: download_single_file(0, str(data_dir), url, backoff_base=30))
    assert isinstance(error, HostNotFoundError) and "shards.invalid" in str(error), error
    assert "retrying" not in caplog.text
    assert not [n for n in os.listdir(data_dir) if not n.endswith(".lock")]


@pytest.mark.slow
def test_unresolvable_host_on_the_cli_is_one_error(tmp_path):
    cmd = [sys.executable, "-m", "nanochat.dataset", "-n", "240",
           "--base-url", "https://shards.invalid/x", "--data-dir", str(tmp_path / "data")]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "shards.invalid" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "error: cannot resolve the host 'shards.invalid' of https://")
    assert "WARNING" not in result.stderr


def test_a_redirect_to_a_host_that_does_not_resolve_names_that_host(fault_server, tmp_path):
    serve_shards(fault_server, tmp_path, [0])
    fault_server.always[NAME] = "redirect_invalid"
    with pytest.raises(HostNotFoundError,
                       match="cannot resolve the host 'cdn.invalid' of http://cdn.invalid/x/"):
        download_shard(fault_server, tmp_path, 0)


def test_a_dns_failure_after_the_host_answered_is_retried(fault_server, tmp_path, monkeypatch):
    # a resolver's hiccup in a long run (EAI_AGAIN) is not "the host does not exist": retried,
    # not fatal
    served = serve_shards(fault_server, tmp_path, [0])
    fault_server.faults[NAME] = ["drop"]
    lookups, getaddrinfo = [], socket.getaddrinfo

    def flaky(*args, **kwargs):
        lookups.append(args[0])
        if len(lookups) == 2:  # the reconnect after the drop
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return getaddrinfo(*args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    monkeypatch.setattr(errors, "_ANSWERED_HOSTS", set())
    assert download_shard(fault_server, tmp_path, 0)
    assert len(lookups) == 3 and fault_server.gets[NAME] == 2
    assert fault_server.ranges[NAME] == [None, f"bytes={len(served[0]) // 2}-"]
    assert_only_complete_shards(tmp_path / "data", served)
