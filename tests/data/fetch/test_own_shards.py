"""
Your own shards, streamed: docs/streaming.md's recipe ("Your own shards") run as written, the
serve command (`python -m nanochat.dataset serve DIR`) as a real process on 127.0.0.1, and shards
of any names streamed by the rule on disk (val is the last in sorted order). Streamed batches and
states are checked token for token against the same loader over the same directory on disk.
Also: the listing (made from the directory, or the directory's own index.json), its errors, the
refusal of a dataset's directory as the cache, the Range error, --help, and Ctrl-C, which stops
the server in one line with exit status 130.

    python -m pytest tests/data/fetch/test_own_shards.py -q
"""

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch

from conftest import (FAST, REPO_ROOT, ByteTokenizer, assert_interrupted,
                      assert_same_batches as _same, outcome, take_batches as _batches, worker_env,
                      write_shard)
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import split_parquet_files
from nanochat.data.fetch import serve
from nanochat.data.fetch.serve import ShardServer

# the recipe's commands, exactly as docs/streaming.md gives them
REPACKAGE = "python -m nanochat.dataset repackage my.jsonl --out shards/"
SERVE = "python -m nanochat.dataset serve shards/ --port 8000"
URL = "http://127.0.0.1:8000"


def _run(command: str, cwd, **kwargs) -> subprocess.CompletedProcess:
    """A `python -m ...` command line as a user types it, run by this interpreter in cwd (this
    checkout's nanochat first on the path)."""
    args = [sys.executable] + command.split()[1:]
    return subprocess.run(args, cwd=cwd, env=worker_env(), capture_output=True, text=True,
                          timeout=120, **kwargs)


class Served:
    """`python -m nanochat.dataset serve ...` as a process: its URL from the line it prints."""

    def __init__(self, command: str, cwd):
        args = [sys.executable] + command.split()[1:]
        self.process = subprocess.Popen(args, cwd=cwd, env=worker_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.line = self.process.stdout.readline()  # printed once it listens
        match = re.search(r" at (http://127\.0\.0\.1:\d+);", self.line)
        assert match, (self.line, self.process.stderr.read() if not self.line else "")
        self.url = match.group(1)

    def stop(self) -> tuple[int, str, str]:
        """Ctrl-C, as a user stops it: (exit status, what it printed after its first line, what
        it printed to stderr)."""
        self.process.send_signal(signal.SIGINT)
        rest, err = self.process.communicate(timeout=30)
        return self.process.returncode, rest, err


def _loader(data_dir, split="train", **kwargs):
    return tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B=4, T=64, split=split, device="cpu", data_dir=str(data_dir),
        tokenizer_batch_size=8, **kwargs)


def _shards_in(batches: list) -> set[str]:
    """The shards whose documents the batches hold (each document starts with its shard's name)."""
    tokens = [t for inputs, _, _ in batches for t in inputs.flatten().tolist()]
    text = ByteTokenizer().decode(tokens)
    return set(re.findall(r"<([^<>]+\.parquet)>", text))


def _write_own(directory, names: list[str], docs: int = 120) -> None:
    """Shards under the given names, each document naming its shard (so a batch shows which one it
    came from)."""
    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    for name in names:
        texts = [f"<{name}> doc {j}: " + "".join(rng.choice("abcdefgh ")
                                                   for _ in range(rng.randint(1, 80)))
                 for j in range(docs)]
        write_shard(os.path.join(directory, name), texts, 16)


# -----------------------------------------------------------------------------
# The recipe, as written


@pytest.mark.slow
def test_the_recipe_for_your_own_shards_runs_as_written(tmp_path, monkeypatch):
    doc = open(os.path.join(REPO_ROOT, "docs", "streaming.md"), encoding="utf-8").read()
    section = doc[doc.index("## Your own shards"):]
    section = section[:section.index("\n## ", 1)]
    for shown in (REPACKAGE, SERVE, f'base_url="{URL}"', 'data_dir="shards_cache/"'):
        assert shown in section, shown
    rng = random.Random(1)
    with open(tmp_path / "my.jsonl", "w") as f:
        for j in range(600):
            text = f"doc {j} " + " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "é"])
                                          for _ in range(rng.randint(1, 60)))
            f.write(json.dumps({"text": text}) + "\n")
    # (a few shards of 150 documents: the recipe's default size would make one tiny pair)
    result = _run(REPACKAGE + " --docs-per-shard 150", tmp_path)
    assert result.returncode == 0, result.stderr
    names = sorted(os.listdir(tmp_path / "shards"))
    assert names == [f"shard_{i:05d}.parquet" for i in range(4)]
    served = Served(SERVE.replace("--port 8000", "--port 0"), tmp_path)  # (8000 may be taken)
    try:
        assert f'base_url="{served.url}"' in served.line
        assert "(4 parquet files, val shard_00003.parquet)" in served.line
        # the doc's Python, run as written: only the port (and, without a GPU, the device) differ
        snippet = section.split("```python\n")[1].split("```")[0]
        code = snippet.replace(URL, served.url)
        if not torch.cuda.is_available():
            code = code.replace('device="cuda"', 'device="cpu"')
        monkeypatch.chdir(tmp_path)  # its data_dir is relative: shards_cache/ here
        namespace = {"tokenizer": ByteTokenizer(), "tokenizing_distributed_data_loader_with_state"
                     "_bos_bestfit": tokenizing_distributed_data_loader_with_state_bos_bestfit}
        exec(code, namespace)
        first = _batches(namespace["train_loader"], 1)
        cache = tmp_path / "shards_cache"
        streamed = _batches(_loader(cache, stream=True, base_url=served.url, cache_limit="2GB",
                                    download_limits=FAST), 40)
    finally:
        code, rest, err = served.stop()
    assert rest == ""
    assert_interrupted(code, err, "interrupted: serve stopped; it changed nothing: rerun the same "
                                  "command to serve again")
    _same(streamed, _batches(_loader(tmp_path / "shards"), 40))
    _same([(x.cpu(), y.cpu(), state) for x, y, state in first],
          _batches(tokenizing_distributed_data_loader_with_state_bos_bestfit(
              ByteTokenizer(), B=32, T=2048, split="train", device="cpu",
              data_dir=str(tmp_path / "shards")), 1))
    # the train shards were fetched under their own names (val's footer only: a train loader);
    # nothing was written into shards/
    assert sorted(n for n in os.listdir(cache) if n.endswith(".parquet")) == names[:-1]
    assert sorted(os.listdir(tmp_path / "shards")) == names


# -----------------------------------------------------------------------------
# Any names: the rule on disk


@pytest.fixture
def odd(tmp_path):
    """Shards named a, b, c d (a space: %20 in its URL) and zz_val, served by the serve command;
    yields (directory, URL)."""
    directory = tmp_path / "odd"
    _write_own(directory, ["b.parquet", "a.parquet", "c d.parquet", "zz_val.parquet"])
    served = Served(f"python -m nanochat.dataset serve {directory} --port 0", tmp_path)
    yield directory, served.url
    assert served.stop()[0] == 130  # Ctrl-C


@pytest.mark.slow
def test_shards_of_any_names_stream_by_the_rule_on_disk(odd, tmp_path):
    directory, url = odd
    listing = requests.get(f"{url}/index.json", timeout=10).json()
    assert listing == {"files": [{"name": n, "size": os.path.getsize(directory / n)}
                                 for n in ("a.parquet", "b.parquet", "c d.parquet",
                                           "zz_val.parquet")]}
    assert not os.path.exists(directory / "index.json")  # made per request, never written
    cache = tmp_path / "cache"
    for split, n in (("train", 60), ("val", 20)):
        streamed = _batches(_loader(cache, split, stream=True, base_url=url,
                                    download_limits=FAST), n)
        expected = _batches(_loader(directory, split), n)
        _same(streamed, expected)
        # val is the last name in sorted order; train the others
        assert _shards_in(streamed) == ({"a.parquet", "b.parquet", "c d.parquet"}
                                        if split == "train" else {"zz_val.parquet"})
    # num_shards: the first N train names
    two = _batches(_loader(tmp_path / "cache2", stream=True, base_url=url, num_shards=2,
                           download_limits=FAST), 60)
    assert _shards_in(two) == {"a.parquet", "b.parquet"}
    assert "c d.parquet" not in os.listdir(tmp_path / "cache2")


def test_a_shard_replaced_while_served_gets_its_new_etag(tmp_path):
    """The ETag is the body's sha256, which the downloader checks: a file replaced while the server
    runs must not keep its old one."""
    _write_own(tmp_path / "d", ["a.parquet", "b.parquet"])
    server = ShardServer(str(tmp_path / "d"))
    try:
        def etag():
            return requests.head(f"{server.url}/a.parquet", timeout=10).headers["ETag"]

        first = etag()
        os.replace(tmp_path / "d" / "b.parquet", tmp_path / "d" / "a.parquet")
        with open(tmp_path / "d" / "a.parquet", "rb") as f:
            assert etag() == f'"{hashlib.sha256(f.read()).hexdigest()}"' != first
    finally:
        server.close()


@pytest.mark.slow
def test_a_dataset_directory_is_refused_as_the_cache_of_your_own_shards(odd, tmp_path):
    _, url = odd
    for data_dir in (tmp_path / "base_data_climbmix", None):  # None: the default, that one too
        kwargs = dict(B=4, T=64, split="train", device="cpu", stream=True, base_url=url,
                      download_limits=FAST)
        if data_dir is not None:
            kwargs["data_dir"] = str(data_dir)
        with pytest.raises(ValueError) as raised:
            tokenizing_distributed_data_loader_with_state_bos_bestfit(ByteTokenizer(), **kwargs)
        message = str(raised.value)
        assert message.startswith(f"{url}/index.json lists shards of your own (val "
                                  "zz_val.parquet), and data_dir "), message
        assert "is the directory of climbmix-400b" in message
        assert "Pass a data_dir of their own as the cache" in message


@pytest.mark.slow
def test_scripts_that_pass_no_data_dir_stream_them_by_the_environment(odd, tmp_path,
                                                                     monkeypatch):
    """nanochat's own scripts pass no data_dir, stream or base_url: NANOCHAT_DATA_DIR names the
    cache, NANOCHAT_DATA_URL the server, NANOCHAT_STREAM=1 turns streaming on. On disk,
    NANOCHAT_DATA_DIR names your shards themselves."""
    directory, url = odd
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(directory))
    assert split_parquet_files("val") == [str(directory / "zz_val.parquet")]
    expected = _batches(tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8), 30)
    cache = tmp_path / "my_cache"
    for name, value in (("NANOCHAT_DATA_DIR", str(cache)), ("NANOCHAT_DATA_URL", url),
                        ("NANOCHAT_STREAM", "1")):
        monkeypatch.setenv(name, value)
    streamed = _batches(tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B=4, T=64, split="train", device="cpu", tokenizer_batch_size=8,
        download_limits=FAST), 30)
    _same(streamed, expected)
    assert "a.parquet" in os.listdir(cache)  # streamed into the cache the environment names


def test_a_mirror_of_the_dataset_streams_into_its_directory(tmp_path):
    """A listing of the dataset's own names is the dataset's split: accepted in its directory."""
    hosted = tmp_path / "hosted"
    _write_own(hosted, ["shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"])
    server = ShardServer(str(hosted))
    try:
        streamed = _batches(_loader(tmp_path / "base_data_climbmix", stream=True,
                                    base_url=server.url, download_limits=FAST), 10)
    finally:
        server.close()
    _same(streamed, _batches(_loader(hosted), 10))


def test_without_a_listing_the_datasets_names_apply(tmp_path, monkeypatch, caplog):
    """A server with no index.json (a 404, as the Hugging Face hub answers): the dataset's names,
    val shard_06542.parquet, even though a file of your own sorts after it."""
    monkeypatch.setattr(serve, "LISTING", "not-served.json")  # the server's: it answers 404
    hosted = tmp_path / "hosted"
    _write_own(hosted, ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet",
                        "shard_06542.parquet", "zz_mine.parquet"])
    server = ShardServer(str(hosted))
    try:
        streamed = _batches(_loader(tmp_path / "cache", stream=True, base_url=server.url,
                                    num_shards=2, download_limits=FAST), 60)
        val = _batches(_loader(tmp_path / "cache", "val", stream=True, base_url=server.url,
                               download_limits=FAST), 1)
    finally:
        server.close()
    assert ("index.json", None) in server.gets
    # one warning says why the names are the dataset's, and how to stream names of your own
    said = [r.getMessage() for r in caplog.records if "/index.json not found" in r.getMessage()]
    assert len(said) == 1 and "python -m nanochat.dataset serve DIR" in said[0], said
    assert _shards_in(streamed) == {"shard_00000.parquet", "shard_00001.parquet"}
    assert _shards_in(val) == {"shard_06542.parquet"}


def test_the_directorys_own_index_json_is_served_and_followed(tmp_path):
    hosted = tmp_path / "hosted"
    _write_own(hosted, ["x1.parquet", "x2.parquet", "x3.parquet"])
    # its own listing: x1 and x2 only (x2 is val), in another order, a non-parquet name left out
    own = {"files": [{"name": "x2.parquet"}, {"name": "notes.txt"}, {"name": "x1.parquet"}]}
    (hosted / "index.json").write_text(json.dumps(own))
    server = ShardServer(str(hosted))
    try:
        assert requests.get(f"{server.url}/index.json", timeout=10).json() == own
        streamed = _batches(_loader(tmp_path / "cache", stream=True, base_url=server.url,
                                    download_limits=FAST), 10)
        val = _batches(_loader(tmp_path / "cache", "val", stream=True, base_url=server.url,
                               download_limits=FAST), 1)
    finally:
        server.close()
    assert (_shards_in(streamed), _shards_in(val)) == ({"x1.parquet"}, {"x2.parquet"})
    assert "x3.parquet" not in os.listdir(tmp_path / "cache")


def test_a_restart_with_the_server_gone_goes_on_with_the_kept_listing(tmp_path, caplog):
    """The listing is asked at every start, and kept: a restart that needs nothing from the server
    (every shard in the cache, the catalog read) goes on without it, as it does on the hub's
    names."""
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    _write_own(hosted, ["p.parquet", "q.parquet", "r.parquet"], docs=30)
    expected = _batches(_loader(hosted), 40)
    server = ShardServer(str(hosted))
    try:
        _same(_batches(_loader(cache, stream=True, base_url=server.url, download_limits=FAST),
                       40), expected)  # (into the second epoch: every train shard fetched)
    finally:
        server.close()
    kept = json.loads((cache / ".stream" / "listing.json").read_text())
    assert kept == {"base_url": server.url, "names": ["p.parquet", "q.parquet", "r.parquet"]}
    with caplog.at_level("WARNING", logger="nanochat.data.streaming.catalog"):
        again = _batches(_loader(cache, stream=True, base_url=server.url,
                                 download_limits=FAST), 40)
    _same(again, expected)
    assert f"could not read the shard listing {server.url}/index.json: " in caplog.text
    assert f"going on with the listing kept in {cache / '.stream' / 'listing.json'}" in caplog.text
    # a fresh cache has none to go on with: the error, naming the listing
    error = outcome(lambda: _loader(tmp_path / "fresh", stream=True, base_url=server.url,
                                    download_limits=FAST))
    assert isinstance(error, ConnectionError)
    assert str(error).startswith(f"could not read the shard listing {server.url}/index.json: ")


@pytest.mark.parametrize("listing, message", [
    ({"files": [{"name": "only.parquet"}]}, "lists 1 parquet files; a loader needs at least 2"),
    ({"files": []}, "lists 0 parquet files; a loader needs at least 2"),
    ({"files": [{"name": "../a.parquet"}, {"name": "b.parquet"}]}, "which is not a file name"),
    ({"shards": ["a.parquet"]}, "has no list of files with names"),
    ("not json {", "is not JSON"),
])
def test_a_wrong_listing_is_an_error_naming_its_url(tmp_path, listing, message):
    hosted = tmp_path / "hosted"
    _write_own(hosted, ["a.parquet", "b.parquet"])
    (hosted / "index.json").write_text(listing if isinstance(listing, str)
                                       else json.dumps(listing))
    server = ShardServer(str(hosted))
    try:
        with pytest.raises(ValueError) as raised:
            _loader(tmp_path / "cache", stream=True, base_url=server.url, download_limits=FAST)
    finally:
        server.close()
    assert str(raised.value).startswith(f"the shard listing {server.url}/index.json "), raised.value
    assert message in str(raised.value)


# -----------------------------------------------------------------------------
# The command and the Range error


@pytest.mark.slow
def test_serve_help_and_its_refusals(tmp_path):
    result = _run("python -m nanochat.dataset serve --help", tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: python -m nanochat.dataset serve [-h] [--port PORT]")
    for flag in ("--host", "--rate BYTES_PER_S", "127.0.0.1", "Ctrl-C", "index.json"):
        assert flag in result.stdout, flag
    result = _run("python -m nanochat.dataset --help", tmp_path)
    assert result.returncode == 0 and "python -m nanochat.dataset serve --help" in result.stdout
    result = _run(f"python -m nanochat.dataset serve {tmp_path / 'nowhere'}", tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: {tmp_path / 'nowhere'} does not exist; pass the directory "
                             "that holds your *.parquet shards\n")
    (tmp_path / "empty").mkdir()
    result = _run(f"python -m nanochat.dataset serve {tmp_path / 'empty'}", tmp_path)
    assert result.returncode == 2 and "holds no *.parquet files" in result.stderr
    assert "repackage" in result.stderr
    _write_own(tmp_path / "shards", ["a.parquet", "b.parquet"])
    taken = ShardServer(str(tmp_path / "shards"))  # a port in use
    try:
        port = taken.server_address[1]
        result = _run(f"python -m nanochat.dataset serve shards --port {port}", tmp_path)
    finally:
        taken.close()
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1 port {port} (" in result.stderr
    assert result.stderr.endswith("); pass another --port, or --port 0 for a free one\n")


@pytest.mark.slow
def test_serve_answers_only_for_shards_and_the_listing(tmp_path):
    """Other files in the directory (notes, credentials, partial downloads, a subdirectory's
    shards) are a 404, by GET and HEAD; shards, a symlinked one too, and the listing are served."""
    hosted, elsewhere = tmp_path / "hosted", tmp_path / "elsewhere"
    _write_own(hosted, ["a.parquet", "b.parquet"])
    _write_own(elsewhere, ["c.parquet"])
    (hosted / "c.parquet").symlink_to(elsewhere / "c.parquet")
    secrets = {"notes.txt": "mine", ".env": "TOKEN=x", "credentials.json": '{"key": "x"}',
               "a.parquet.tmp": "PAR1", "sub/d.parquet": "PAR1"}
    for name, text in secrets.items():
        os.makedirs(os.path.dirname(hosted / name), exist_ok=True)
        (hosted / name).write_text(text)
    server = ShardServer(str(hosted))
    try:
        for name in [*secrets, "sub", "sub%2Fd.parquet", "..%2Fhosted%2Fnotes.txt"]:
            for method in (requests.get, requests.head):
                assert method(f"{server.url}/{name}", timeout=10).status_code == 404, name
        for name in ("a.parquet", "b.parquet", "c.parquet"):
            got = requests.get(f"{server.url}/{name}", timeout=10)
            assert got.status_code == 200 and got.content == (hosted / name).read_bytes(), name
        listing = requests.get(f"{server.url}/index.json", timeout=10).json()
        assert [entry["name"] for entry in listing["files"]] == ["a.parquet", "b.parquet",
                                                                 "c.parquet"]
    finally:
        server.close()
    result = _run("python -m nanochat.dataset serve --help", tmp_path)
    assert "Nothing else: any other name, or another file in DIR, is a 404" in " ".join(
        result.stdout.split())


def test_a_server_that_ignores_range_is_refused_naming_serve(tmp_path):
    hosted = tmp_path / "hosted"
    _write_own(hosted, ["a.parquet", "b.parquet"])
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 partial(SimpleHTTPRequestHandler, directory=str(hosted)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # its listing (http.server serves the file), then the footer of a.parquet: refused
        (hosted / "index.json").write_text(json.dumps({"files": [{"name": "a.parquet"},
                                                                 {"name": "b.parquet"}]}))
        error = outcome(lambda: _loader(tmp_path / "cache", stream=True, base_url=url,
                                        download_limits=FAST))
    finally:
        server.shutdown()
        server.server_close()
    assert isinstance(error, ConnectionError), error
    message = str(error)
    assert message == (
        f"could not read the footer of shard a.parquet from {url}/a.parquet: HTTP 200 to a Range "
        "request; a streaming loader reads each shard's footer before fetching the shard, so the "
        "server must honour Range requests, as the Hugging Face hub does (python -m http.server "
        "does not). To serve a directory of shards: python -m nanochat.dataset serve DIR")
    assert message.count(url) == 1
