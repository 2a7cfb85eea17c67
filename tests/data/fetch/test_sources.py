"""
One source per directory, and every shortfall said. Two real shard servers on 127.0.0.1 serve
different files under the same names (dataset A and dataset B): a directory filled from one is
refused for the other, at the call, by a streaming loader and by `python -m nanochat.dataset -n`;
every installed shard records its source; a shard recorded before sources were is adopted by the
first source that asks. Also: `-n` reads a server's index.json (`serve`), a listing with fewer
train shards than asked for fetches what there is and exits 1, and a rerun is advised only where it
can help.

    python -m pytest tests/data/fetch/test_sources.py -q
"""

import json
import os
import random
import re

import pytest

from conftest import FAST, FAST_CLI, assert_same_batches, ByteTokenizer, take_batches, write_shard
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.dataset import main
from nanochat.data.fetch import download, sources
from nanochat.data.fetch.records import record_path
from nanochat.data.fetch.sources import OtherSourceError
from nanochat.data.fetch.serve import ShardServer

NAMES = ["a.parquet", "b.parquet", "c.parquet", "zz_val.parquet"]


@pytest.fixture(autouse=True)
def _sources_asked_afresh():
    """Each test's sources are asked as in a new process: a port an earlier test's server left
    silent may be this test's server's."""
    sources._SILENT.clear()


def _write(directory, tag: str, names=NAMES) -> None:
    """Shards under the given names whose every document starts with <tag:name>."""
    rng = random.Random(tag)
    os.makedirs(directory, exist_ok=True)
    for name in names:
        texts = [f"<{tag}:{name}> " + "".join(rng.choice("abcdefgh ")
                                               for _ in range(rng.randint(1, 60)))
                 for _ in range(80)]
        write_shard(os.path.join(directory, name), texts, 16)


def _tags(batches) -> set[str]:
    """The datasets whose documents the batches hold."""
    text = ByteTokenizer().decode([t for x, _, _ in batches for t in x.flatten().tolist()])
    return set(re.findall(r"<(\w+):", text))


def _stream(cache, url, n=12):
    return take_batches(tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B=4, T=64, split="train", device="cpu", data_dir=str(cache),
        stream=True, base_url=url, download_limits=FAST, tokenizer_batch_size=8), n)


@pytest.fixture
def two_sources(tmp_path):
    """Servers A and B: the same file names, other files. Yields (url_a, url_b, servers)."""
    _write(tmp_path / "A", "A")
    _write(tmp_path / "B", "B")
    servers = [ShardServer(str(tmp_path / "A")), ShardServer(str(tmp_path / "B"))]
    yield servers[0].url, servers[1].url, servers
    for server in servers:
        server.close()


@pytest.mark.slow
def test_a_cache_filled_from_one_source_is_refused_for_another(two_sources, tmp_path):
    url_a, url_b, (server_a, server_b) = two_sources
    cache = tmp_path / "cache"
    assert _tags(_stream(cache, url_a)) == {"A"}
    record = json.loads(open(record_path(str(cache / "a.parquet"))).read())
    assert record["source"] == f"{url_a}/a.parquet"
    assert record["source_version"] == f'"{server_a.etag(str(tmp_path / "A" / "a.parquet"))}"'
    with pytest.raises(OtherSourceError) as raised:  # at the call: nothing is read from B
        tokenizing_distributed_data_loader_with_state_bos_bestfit(
            ByteTokenizer(), B=4, T=64, split="train", device="cpu", data_dir=str(cache),
            stream=True, base_url=url_b, download_limits=FAST)
    message = str(raised.value)
    assert "\n" not in message
    assert f"shard(s) fetched from {url_a} (a.parquet, b.parquet, ...), not from {url_b}, " \
           "which this run reads from" in message
    assert "one directory holds one source's shards" in message
    assert "Pass another data directory for this source" in message
    assert [p for p in server_b.fetched() if p.endswith(".parquet")] == []
    # A again: its own shards, still all A's
    assert _tags(_stream(cache, url_a)) == {"A"}
    # B into a cache of its own: all B's
    assert _tags(_stream(tmp_path / "cache_b", url_b)) == {"B"}


def test_a_directory_downloaded_from_one_source_is_refused_for_another(two_sources, tmp_path):
    url_a, url_b, (_, server_b) = two_sources
    data_dir = tmp_path / "data"
    args = ["--data-dir", str(data_dir), *FAST_CLI]
    assert main(["-n", "2", "--base-url", url_a, *args]) == 0
    before = {n: (data_dir / n).read_bytes() for n in os.listdir(data_dir) if n.endswith("quet")}
    with pytest.raises(OtherSourceError, match=f"fetched from {url_a} .*, not from {url_b},"):
        main(["-n", "3", "--base-url", url_b, *args])
    # nothing of B's fetched, nothing of A's touched
    assert [p for p in server_b.fetched() if p.endswith(".parquet")] == []
    assert {n: (data_dir / n).read_bytes() for n in before} == before
    assert sorted(before) == ["a.parquet", "b.parquet", "zz_val.parquet"]
    # the same source again: more of its shards
    assert main(["-n", "3", "--base-url", url_a, *args]) == 0
    assert os.path.exists(data_dir / "c.parquet")


def test_a_shard_recorded_without_a_source_is_adopted_by_the_first_that_asks(two_sources,
                                                                           tmp_path, caplog):
    url_a, url_b, _ = two_sources
    data_dir = tmp_path / "data"
    args = ["--data-dir", str(data_dir), *FAST_CLI]
    assert main(["-n", "1", "--base-url", url_a, *args]) == 0
    record_file = record_path(str(data_dir / "a.parquet"))
    record = json.loads(open(record_file).read())
    old = {k: v for k, v in record.items() if k not in ("source", "source_version")}
    with open(record_file, "w") as f:  # as a version that recorded no source wrote it
        json.dump(old, f)
    caplog.set_level("INFO")
    assert main(["-n", "1", "--base-url", url_a, *args]) == 0
    assert json.loads(open(record_file).read()) == old | {"source": f"{url_a}/a.parquet",
                                                          "source_version": None}
    assert any("records no source: taken as from" in r.getMessage() for r in caplog.records)
    with pytest.raises(OtherSourceError):
        main(["-n", "1", "--base-url", url_b, *args])


def test_shards_of_no_record_are_your_own_and_count_for_any_source(two_sources, tmp_path):
    """A shard with no .json record at all (nanochat's own downloader writes none) is checked, not
    refused: it is the user's."""
    url_a, _, (server_a, _) = two_sources
    data_dir = tmp_path / "data"
    _write(data_dir, "A", ["a.parquet"])
    assert main(["-n", "1", "--base-url", url_a, "--data-dir", str(data_dir), *FAST_CLI]) == 0
    assert not os.path.exists(record_path(str(data_dir / "a.parquet")))
    assert "/a.parquet" not in server_a.fetched()


def test_a_directory_with_shards_of_other_names_from_another_source_is_refused(tmp_path):
    """Another source's shards of other names would mix two datasets (and make one's val
    another's train): refused too, though no name is shared."""
    _write(tmp_path / "A", "A", ["a.parquet", "b.parquet", "zz_val.parquet"])
    _write(tmp_path / "B", "B", ["m_val.parquet", "x.parquet", "y.parquet"])
    servers = [ShardServer(str(tmp_path / "A")), ShardServer(str(tmp_path / "B"))]
    data_dir = tmp_path / "data"
    try:
        assert main(["-n", "2", "--base-url", servers[0].url, "--data-dir", str(data_dir),
                     *FAST_CLI]) == 0
        with pytest.raises(OtherSourceError, match=f"holds 3 shard.s. fetched from "
                                                   f"{servers[0].url} "):
            main(["-n", "2", "--base-url", servers[1].url, "--data-dir", str(data_dir),
                  *FAST_CLI])
        assert sorted(n for n in os.listdir(data_dir) if n.endswith(".parquet")) == [
            "a.parquet", "b.parquet", "zz_val.parquet"]
    finally:
        for server in servers:
            server.close()


@pytest.mark.slow
def test_the_same_files_at_a_new_address_are_adopted(tmp_path, caplog):
    """serve restarted on another port (or a mirror) states the same sha256 for every shard
    there: the run goes on, and the records name the new address."""
    _write(tmp_path / "A", "A")
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    first = ShardServer(str(tmp_path / "A"))
    try:
        assert main(["-n", "2", "--base-url", first.url, "--data-dir", str(data_dir),
                     *FAST_CLI]) == 0
        expected = _stream(cache, first.url)
    finally:
        first.close()
    second = ShardServer(str(tmp_path / "A"))
    caplog.set_level("INFO")
    try:
        assert main(["-n", "3", "--base-url", second.url, "--data-dir", str(data_dir),
                     *FAST_CLI]) == 0
        assert [p for p in second.fetched() if p.endswith(".parquet")] == ["c.parquet"]
        streamed = _stream(cache, second.url)
    finally:
        second.close()
    assert_same_batches(streamed, expected)
    for directory in (data_dir, cache):
        record = json.loads(open(record_path(str(directory / "a.parquet"))).read())
        assert record["source"] == f"{second.url}/a.parquet"
    assert any("are the same files at" in r.getMessage() for r in caplog.records)


def test_new_files_at_the_same_address(tmp_path):
    """Another dataset served at the address a cache was filled from (serve B on A's port): a
    streaming loader refuses at the call; the downloader fetches the changed shards anew, and
    says it replaced them."""
    _write(tmp_path / "A", "A")
    _write(tmp_path / "B", "B")
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    server = ShardServer(str(tmp_path / "A"))
    url, port = server.url, server.server_address[1]
    try:
        assert main(["-n", "2", "--base-url", url, "--data-dir", str(data_dir), *FAST_CLI]) == 0
        assert _tags(_stream(cache, url)) == {"A"}
    finally:
        server.close()
    server = ShardServer(str(tmp_path / "B"), port=port)
    try:
        with pytest.raises(OtherSourceError) as raised:
            tokenizing_distributed_data_loader_with_state_bos_bestfit(
                ByteTokenizer(), B=4, T=64, split="train", device="cpu", data_dir=str(cache),
                stream=True, base_url=url, download_limits=FAST)
        assert "shard(s) on disk changed at their source" in str(raised.value)
        assert "now states sha256" in str(raised.value)
        assert "Pass another data_dir for the source as it is now" in str(raised.value)
        assert main(["-n", "2", "--base-url", url, "--data-dir", str(data_dir), *FAST_CLI]) == 0
    finally:
        server.close()
    for name in ("a.parquet", "b.parquet", "zz_val.parquet"):
        assert (data_dir / name).read_bytes() == (tmp_path / "B" / name).read_bytes()


# -----------------------------------------------------------------------------
# -n over HTTP: the server's listing, and shortfalls


def test_n_from_serve_reads_its_listing(two_sources, tmp_path, capsys):
    url_a, _, _ = two_sources
    data_dir = tmp_path / "data"
    assert main(["-n", "2", "--base-url", url_a, "--data-dir", str(data_dir), *FAST_CLI]) == 0
    out = capsys.readouterr().out
    assert sorted(n for n in os.listdir(data_dir) if n.endswith(".parquet")) == [
        "a.parquet", "b.parquet", "zz_val.parquet"]  # val: the listing's last name
    assert f"downloaded 3/3 shards to {data_dir}\n" in out
    assert "train_shards=2 val_shard=zz_val.parquet" in out


def test_n_past_what_a_server_lists_fetches_what_there_is_and_exits_1(two_sources, tmp_path,
                                                                       capsys):
    url_a, _, _ = two_sources
    data_dir = tmp_path / "data"
    assert main(["-n", "5", "--base-url", url_a, "--data-dir", str(data_dir), *FAST_CLI]) == 1
    out = capsys.readouterr().out
    assert (f"-n 5 asks for more train shards than the 3 {url_a}/index.json lists: fetching those "
            "3 and val, then exiting 1") in out
    assert (f"downloaded 4 of the 6 shards asked for (5 train and val) to {data_dir}: "
            f"{url_a}/index.json lists only 3 train shards") in out
    assert not re.search(r"downloaded (\d+)/\1 ", out)
    assert sorted(n for n in os.listdir(data_dir) if n.endswith(".parquet")) == NAMES


def test_a_rerun_is_advised_only_where_it_can_help(tmp_path, capsys):
    """A listed shard the server does not have (a 404) fails for good: no advice to rerun."""
    _write(tmp_path / "A", "A")
    with open(tmp_path / "A" / "index.json", "w") as f:  # lists a shard it does not serve
        json.dump({"files": [{"name": n} for n in ["a.parquet", "gone.parquet",
                                                   "zz_val.parquet"]]}, f)
    server = ShardServer(str(tmp_path / "A"))
    try:
        code = main(["-n", "2", "--base-url", server.url, "--data-dir", str(tmp_path / "d"),
                     *FAST_CLI])
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 1
    assert "failed (1); a rerun cannot help: check the source and the names it has:\n" \
           "  1 x HTTP 404: gone.parquet" in out
    assert "rerun the same command" not in out


def test_a_rerun_is_advised_after_a_deadline(tmp_path, capsys):
    """Past the deadline a shard fails this run, but a rerun resumes it: the advice is given."""
    _write(tmp_path / "A", "A")
    server = ShardServer(str(tmp_path / "A"), rate=1000)  # ~3 s a shard
    try:
        code = main(["-n", "1", "--base-url", server.url, "--data-dir", str(tmp_path / "d"),
                     "--deadline", "1", "--min-rate", "0", *FAST_CLI])
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"failed \(\d\); rerun the same command to retry \(partial downloads "
                     r"resume\):\n  \d x past the deadline: ", out), out


def test_a_source_that_cannot_be_asked_leaves_the_shards_as_they_are(tmp_path, caplog):
    """Offline, a shard on disk is taken as its source's file by its record, with one warning:
    a rerun with every shard there needs no network."""
    _write(tmp_path / "A", "A")
    server = ShardServer(str(tmp_path / "A"))
    url, path = f"{server.url}/a.parquet", str(tmp_path / "d" / "a.parquet")
    try:
        assert download.download_file(url, path, FAST) == ""
    finally:
        server.close()
    before = open(path, "rb").read()
    sources._SILENT.clear()  # (asked afresh, as in a new process)
    assert download.download_file(url, path, FAST) is None  # there, and not fetched again
    assert download.download_file(url, path, FAST) is None  # (asked once per process)
    assert open(path, "rb").read() == before
    warnings = [r.getMessage() for r in caplog.records if "could not ask" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"could not ask {server.url} whether")
