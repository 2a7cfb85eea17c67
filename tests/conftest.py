"""Shared fixtures: tiny parquet shards written with pyarrow into tmp dirs, a byte-level tokenizer,
where a state's buffered documents are, shards in the datasets' own directories, `need`, which
skips a test without an optional tool here but fails it in CI, and a local HTTP shard server that
injects faults. Where CI is set, a skipped test fails the run (a test marked cuda may skip without
a GPU)."""

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from byte_tokenizers import ByteArrayTokenizer, ByteTokenizer  # noqa: F401 (for the tests)
from nanochat.data.base import datasets
from nanochat.data.base.datasets import get_data_dir, index_to_filename
from nanochat.data.fetch import stores
from nanochat.data.fetch.limits import Limits
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.data.loader.order import parquet_index
from nanochat.data.pretokenized.token_reader import chunk_index
from nanochat.data.base.state import WindowKey, decode_keys
from nanochat.data.base.state_checks import config_shuffle
from nanochat.dataset import download_single_file, main
from nanochat.data.mixtures.mixture_plan import MixtureOptions
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit
from nanochat.tokenizer import RustBPETokenizer

TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/: its workers and helpers
REPO_ROOT = os.path.dirname(TESTS)
# download limits that give up fast: 2 attempts, 10 ms backoff, 5 s per request, 30 s per file
FAST = Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=30)
FAST_CLI = ["--max-attempts", "2", "--backoff-base", "0.01", "--timeout", "5"]  # FAST, as flags
WORDS = ("alpha", "beta", "gamma", "delta", "shard", "token", "river", "stone", "cloud", "paper")

# Most tests build a loader in this process (on threads): a worker process costs ~1.5 s to start.
# tests/data/loader/test_worker.py runs every kind of loader in one (the default) and checks it
# yields the same batches and states. A subprocess a test starts inherits the setting.
os.environ.setdefault("NANOCHAT_LOADER_WORKERS", "0")


def slow_beyond(values, n: int) -> list:
    """values for pytest.mark.parametrize: the first n in the fast tier (-m "not slow"), the rest
    marked slow."""
    return [v if i < n else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(values)]


def write_shard(path, texts, row_group_size):
    """Write one shard like the real ones: a single `text` column, zstd, fixed-size row groups."""
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    tmp = str(path) + ".tmp"
    pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
    os.replace(tmp, path)


def output_files(directory) -> dict:
    """Every file under a pretokenize output but the hidden ones (locks, staged inputs): its path
    relative to directory -> its bytes."""
    out = {}
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith("."):
                with open(os.path.join(root, name), "rb") as f:
                    out[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return out


def write_shards(data_dir, files, row_group_size):
    """files: list of lists of texts, one per shard -> shard_00000.parquet, ... in data_dir."""
    os.makedirs(data_dir, exist_ok=True)
    paths = []
    for i, texts in enumerate(files):
        path = os.path.join(data_dir, f"shard_{i:05d}.parquet")
        write_shard(path, texts, row_group_size)
        paths.append(path)
    return paths


def sample_texts(seed: int, n: int, *, words=WORDS, lengths=range(5, 41), prefix: str = "doc",
                 empty_middle: bool = False) -> list[str]:
    """n documents "{prefix} {seed}-{i}: " + a number of words drawn from `lengths`, each word
    drawn from `words`; the same arguments give the same texts. empty_middle: document n // 2 is
    "" (a tokenizer makes it a lone BOS)."""
    rng = random.Random(seed)
    texts = [f"{prefix} {seed}-{i}: " + " ".join(rng.choice(words)
                                                 for _ in range(rng.choice(lengths)))
             for i in range(n)]
    if empty_middle:
        texts[n // 2] = ""
    return texts


@pytest.fixture
def parquet_dir(tmp_path, request):
    """Three train shards and a val shard (the last) of 30 documents each, row groups of 8, drawn
    by sample_texts with the test module's TEXTS (its words and lengths)."""
    texts = getattr(request.module, "TEXTS", None)
    if texts is None:
        pytest.fail(f"{request.module.__name__} uses parquet_dir: give it TEXTS, sample_texts' "
                    "arguments")
    data_dir = str(tmp_path / "parquet")
    write_shards(data_dir, [sample_texts(seed, 30, **texts) for seed in range(10, 14)],
                 row_group_size=8)
    return data_dir


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, request):
    """A directory holding a 300-token RustBPETokenizer trained on the test module's
    TOKENIZER_TEXTS (one per module: training takes a second)."""
    texts = getattr(request.module, "TOKENIZER_TEXTS", None)
    if texts is None:
        pytest.fail(f"{request.module.__name__} uses tokenizer_dir: give it TOKENIZER_TEXTS, the "
                    "documents to train on")
    path = str(tmp_path_factory.mktemp("tokenizer"))
    RustBPETokenizer.train_from_iterator(iter(texts), 300).save(path)
    return path


def cache_bytes(directory) -> int:
    """What cache_limit bounds: the shards in a streaming cache, partial downloads included, and
    the documents kept for buffers (.stream/kept/*/*); 0 before the cache exists."""
    directory = str(directory)
    if not os.path.isdir(directory):
        return 0
    kept = os.path.join(directory, STREAM_DIR, "kept")
    owners = os.listdir(kept) if os.path.isdir(kept) else []
    files = [os.path.join(directory, name) for name in os.listdir(directory)
             if name.endswith(".parquet") or name.endswith(".parquet.tmp")]
    total = 0
    for owner in owners:
        try:
            files += [os.path.join(kept, owner, name)
                      for name in os.listdir(os.path.join(kept, owner))]
        except FileNotFoundError:  # (dropped while this was looking)
            pass
    for path in files:
        try:
            total += os.path.getsize(path)
        except FileNotFoundError:  # (evicted or dropped while this was looking)
            pass
    return total


def peak_while(cache, work):
    """(work(), the most cache_bytes(cache) was while it ran, looked at every millisecond)."""
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], cache_bytes(cache))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return work(), peak[0]
    finally:
        stop.set()
        watcher.join()


def take(loader, n: int, *, copy=torch.Tensor.tolist) -> list[tuple]:
    """The next n (inputs, targets, state) of a loader, the tensors copied by `copy` (the yielded
    tensors are views the next batch overwrites): as lists, so that batches compare with ==; the
    state as yielded; the loader stays open."""
    out = []
    for _ in range(n):
        inputs, targets, state = next(loader)
        out.append((copy(inputs), copy(targets), state))
    return out


def take_across_epoch(loader, most: int) -> list:
    """take(loader, 1) until a batch's epoch differs from the first's (at most `most` batches),
    then 3 more: a run that crosses an epoch boundary."""
    run = take(loader, 1)
    while len(run) < most and run[-1][2]["epoch"] == run[0][2]["epoch"]:
        run += take(loader, 1)
    return run + take(loader, 3)


def take_tensors(loader, n: int) -> list[tuple]:
    """take, the tensors cloned (to compare with torch.equal)."""
    return take(loader, n, copy=torch.Tensor.clone)


def take_batches(loader, n: int) -> list:
    """The first n (inputs, targets, state) of a loader, cloned (the tensors are views the next
    batch overwrites) and the state through JSON, as a checkpoint saves it; the loader closed."""
    out = []
    for inputs, targets, state in loader:
        out.append((inputs.clone(), targets.clone(), json.loads(json.dumps(state))))
        if len(out) == n:
            break
    loader.close()
    return out


def assert_same_batches(got: list, expected: list) -> None:
    """take_batches' results equal, tensor for tensor and state for state (and not both empty)."""
    assert len(got) == len(expected) > 0
    for i, ((a, b, s), (x, y, t)) in enumerate(zip(got, expected)):
        assert torch.equal(a, x) and torch.equal(b, y), f"batch {i}"
        assert s == t, f"state {i}"


def worker_env() -> dict:
    """The environment for torchrun workers: no inherited rank, one thread each, and this checkout's
    nanochat first on the path (a worker runs as a script, so the checkout is not on its path and an
    editable install elsewhere would be imported instead)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return dict(env, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")])))


def outcome(call, seconds: float = 60.0):
    """What call() returns or raises (the exception, as a value), run on a thread; fails when it
    has done neither in `seconds`: a stall (the thread is left behind, a daemon)."""
    result = []

    def run():
        try:
            result.append(call())
        except Exception as e:
            result.append(e)

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + seconds
    while not result and time.monotonic() < deadline:
        time.sleep(0.01)
    assert result, f"neither returned nor raised in {seconds:g}s: a stall"
    return result[0]


def ctrl_c(args: list[str], when, *, seconds: float = 60.0, **popen) -> tuple[int, str, str]:
    """Run args in a session of its own, and once when() is true send SIGINT to its whole process
    group, as Ctrl-C on a terminal does (its worker processes get it too): (exit status, stdout,
    stderr). Fails if when() is not true within `seconds`, or the command ends first."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + seconds
        while not when():
            if process.poll() is not None:
                raise AssertionError("it ended before it was interrupted: "
                                     + process.communicate()[1])
            assert time.monotonic() < deadline, f"not under way within {seconds:g}s"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=seconds)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, out, err


def assert_interrupted(code: int, err: str, line: str) -> None:
    """What Ctrl-C must leave on stderr: the one line nanochat.data.base.cli.run prints, last,
    exit status 130, and no traceback (of this process or of its workers)."""
    assert code == 130, (code, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [x for x in err.splitlines() if x.startswith("interrupted:")] == [line], err
    assert err.endswith(line + "\n"), err


def least_accepted(make) -> int:
    """The least cache_limit that make(cache_limit) accepts (a streaming loader: closed at once),
    by bisection."""
    low, high = 1, 1 << 30
    while low < high:
        mid = (low + high) // 2
        try:
            make(mid).close()
            high = mid
        except ValueError as e:
            assert "is below what this streaming loader must hold" in str(e), e
            low = mid + 1
    return low


# -----------------------------------------------------------------------------
# Under CI nothing skips silently: a skip fails the run, but for tests marked cuda without a GPU

def _skip_is_an_error(report, cuda: bool) -> None:
    """Turn a skipped report into a failure that gives the skip's reason, where CI is set."""
    if report.skipped and os.environ.get("CI") and not hasattr(report, "wasxfail") and not cuda:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"CI is set, and this skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_is_an_error(outcome.get_result(), item.get_closest_marker("cuda") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips as a whole (pytest.importorskip at its top) fails under CI too."""
    outcome = yield
    _skip_is_an_error(outcome.get_result(), cuda=False)


@pytest.fixture
def byte_tokenizer():
    return ByteTokenizer()


@pytest.fixture(autouse=True)
def _isolated_base_dir(tmp_path, monkeypatch):
    """No test reads or writes the user's ~/.cache/nanochat."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "nanochat_base"))
    monkeypatch.delenv("NANOCHAT_DATASET", raising=False)
    monkeypatch.delenv("NANOCHAT_DATA_URL", raising=False)
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


# -----------------------------------------------------------------------------
# Optional tools: a test skips without them here, and fails in CI, where nothing may skip silently


def skip_unless_ci(reason: str) -> None:
    """Skip the test, except where the environment variable CI is set: there it fails, so that a
    missing tool never passes a run by skipping its tests."""
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {reason}")
    pytest.skip(reason)


def need(module: str, install: str):
    """The module, imported; not installed: skip_unless_ci, with install (how to get it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        skip_unless_ci(f"{module} is not installed: {install}")


# -----------------------------------------------------------------------------
# The datasets' own directories under the base dir, where the readers look when given no data_dir


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """Warnings are logged once per process: start each test with none logged yet."""
    monkeypatch.setattr(datasets, "_LOGGED", set())
    caplog.set_level("WARNING", logger="nanochat.data")
    return caplog


def basenames(paths) -> list[str]:
    return [os.path.basename(p) for p in paths]


def dataset_shards(name: str, indices) -> str:
    """Shards of these indices in a dataset's directory, one document and row group each."""
    data_dir = get_data_dir(name)
    os.makedirs(data_dir, exist_ok=True)
    for i in indices:
        write_shard(os.path.join(data_dir, index_to_filename(i)), [f"{name} {i}"],
                    row_group_size=1)
    return data_dir
def write_hosted(directory, num_train: int = 7, docs: int = 300, seed: int = 0) -> list[int]:
    """num_train train shards and the val shard, named as the dataset's, of documents of 18-77
    characters in row groups of 32 (those longer than a row wait in a best-fit buffer); their
    sizes, sorted."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for i in list(range(num_train)) + [6542]:
        texts = [f"shard {i} doc {j}: " + "".join(rng.choice("abcdefgh ")
                                                   for _ in range(rng.randint(1, 60)))
                 for j in range(docs)]
        write_shard(os.path.join(directory, index_to_filename(i)), texts, 32)
    return sorted(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


@contextlib.contextmanager
def hosting(directory):
    """write_hosted's shards in directory, served over HTTP: (directory, ShardServer, sizes)."""
    sizes = write_hosted(directory)
    server = ShardServer(str(directory))
    try:
        yield str(directory), server, sizes
    finally:
        server.close()


@pytest.fixture
def hosted(tmp_path):
    """hosting's shards and server, fresh for one test."""
    with hosting(tmp_path / "hosted") as shards:
        yield shards


def buffered_places(state, paths, chunk_size=None) -> list[tuple]:
    """Where a state's buffered documents are: (epoch, pq_idx, rg_idx, doc_index). A shuffled walk
    names those of its windows by position, (epoch, window, i): the i-th entry of that window's
    order."""
    config = state["config"]
    index = parquet_index(paths) if chunk_size is None else chunk_index(paths, chunk_size)
    shuffle = config_shuffle(config)
    places = []
    for key in decode_keys(state["buffer"]):
        if isinstance(key, WindowKey):
            table = shuffle.window_table(index, key[0], config["rank"], config["world_size"],
                                         key[1])
            key = (key[0], *shuffle.entry(table, key[2]))
        places.append(key)
    return places


# -----------------------------------------------------------------------------
# A real S3 API on 127.0.0.1 (tests/s3_server.py): one moto server for the session

def _require_s3_tools():
    """Skip without the dev extras, except in CI, which must never skip these silently."""

    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        skip_unless_ci(f"{', '.join(missing)} not installed: pip install -e \".[dev]\"")


@pytest.fixture
def fresh_filesystems():
    """Each test's store endpoint and credentials are read afresh (the fixtures change them)."""
    stores.forget_filesystems()
    yield
    stores.forget_filesystems()


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server (tests/s3_server.py's S3Server) for the whole session."""
    _require_s3_tools()
    from s3_server import S3Server

    with S3Server() as server:
        yield server


def _s3_env(monkeypatch, tmp_path, endpoint):
    """Point every AWS client at endpoint with test credentials; no ~/.aws, no developer env."""
    import s3fs

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws" / "credentials"))
    s3fs.S3FileSystem.clear_instance_cache()  # an instance keeps the endpoint it was made with
    stores.forget_filesystems()  # and so do the ones nanochat.data.fetch.stores keeps


@pytest.fixture
def s3(s3_server, tmp_path, monkeypatch):
    """A fresh bucket on the session's server, with the AWS env pointing at it (S3Bucket)."""
    import s3fs
    from s3_server import S3Bucket

    _s3_env(monkeypatch, tmp_path, s3_server.endpoint)
    yield S3Bucket(s3_server.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    stores.forget_filesystems()


@pytest.fixture
def s3_faulty(s3_server, tmp_path, monkeypatch):
    """Like `s3`, but the AWS env points at a fresh FaultProxy (`.proxy`) before the server."""
    import s3fs
    from s3_server import FaultProxy, S3Bucket

    proxy = FaultProxy(s3_server.endpoint)
    try:
        _s3_env(monkeypatch, tmp_path, proxy.endpoint)
        yield S3Bucket(s3_server.endpoint, proxy)
    finally:
        proxy.close()
        s3fs.S3FileSystem.clear_instance_cache()
        stores.forget_filesystems()


# -----------------------------------------------------------------------------
# The downloader's tests (tests/data/fetch/): a local HTTP shard server that injects faults

FAST_BACKOFF = ["--backoff-base", "0.01"]  # 5 attempts then cost 0.01+0.02+0.04+0.08 s of sleep




def sha256_hex(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def corrupt_page(body: bytes) -> bytes:
    """The shard with one byte flipped in the middle of row group 1's first page (the dictionary
    page, which holds the texts): same size, PAR1 at both ends, the footer intact, and row group 1
    no longer decompresses."""
    chunk = pq.read_metadata(pa.BufferReader(body)).row_group(1).column(0)
    if chunk.has_dictionary_page:
        first, end = chunk.dictionary_page_offset, chunk.data_page_offset
    else:
        first, end = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
    middle = (first + end) // 2
    bad = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
    with pytest.raises(OSError, match="ZSTD"):  # or the tests built on it would pass vacuously
        pq.ParquetFile(pa.BufferReader(bad)).read_row_group(1)
    return bad

class _FaultState:
    """What the handler serves, how it misbehaves, and what it saw.
    faults[name]: behaviours for the 1st, 2nd, ... GET of that file; always[name]: for every GET.
    Behaviours: "500", "503:0", "429:1" (code[:Retry-After]), "drop" (half the body, then close),
    "short" (all but 100 bytes of the body), "cut" (half the body and no Content-Length),
    "garbage" (right length, not parquet), "flip" (right length, one byte changed),
    "flip_page" (right length, PAR1 and footer intact, a page that does not decompress),
    "html" (a 200 web page), "bad_range" (206 with a Content-Range from 0),
    "slow" (wait 0.3 s before the body), "trickle" (100 bytes, then 1 byte every 20 ms).
    drop_every: every body stops after this many bytes. etag: "sha256" (a quoted sha256 of the
    body, as the hub sends for LFS files), "md5" (a validator only) or None.
    redirect: /resolve/main/NAME answers 302 to /cdn/NAME with the sha256 in X-Linked-Etag, as the
    hub does; the CDN's ETag is an md5."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, list[str]] = {}
        self.always: dict[str, str] = {}
        self.range_support = True
        self.if_range_support = True
        self.etag = "sha256"
        self.redirect = False
        self.drop_every = None
        self.gets = Counter()
        self.listings = 0  # GETs of index.json when it is not served (as the hub has none)
        self.heads = Counter()
        self.sent = Counter()  # body bytes written, by name
        self.ranges = defaultdict(list)  # name -> the Range header of each GET (None when absent)
        self.if_ranges = defaultdict(list)  # name -> the If-Range header of each GET
        self.lock = threading.Lock()
        self.url = ""

    def behaviour(self, name: str, n: int) -> str | None:
        if name in self.always:
            return self.always[name]
        faults = self.faults.get(name, [])
        return faults[n - 1] if n <= len(faults) else None

    def etag_of(self, body: bytes, cdn: bool) -> str | None:
        if self.etag == "md5" or cdn:
            return f'"{hashlib.md5(body).hexdigest()}"'
        return f'"{sha256_hex(body)}"' if self.etag == "sha256" else None


class _FaultHandler(BaseHTTPRequestHandler):
    # HTTP/1.0: every response ends with a close, so a short write is seen as a truncated body

    def log_message(self, format, *args):
        pass  # keep pytest output clean

    def _empty(self, code: int, headers: dict | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _slow_headers(self) -> None:
        """The status line and headers a byte at a time, never finished in time."""
        try:
            for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Padding: " + b"x" * 10_000:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on us, as it should

    def do_HEAD(self):
        state, name = self.server.state, self.path.rsplit("/", 1)[-1]
        with state.lock:
            state.heads[name] += 1
        body = state.files.get(name)
        if body is None:
            return self._empty(404)
        if state.always.get(name) == "slow_headers":
            return self._slow_headers()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()

    def _write(self, name: str, data: bytes) -> None:
        self.wfile.write(data)
        with self.server.state.lock:
            self.server.state.sent[name] += len(data)

    def do_GET(self):
        state, name = self.server.state, self.path.rsplit("/", 1)[-1]
        body = state.files.get(name)
        cdn = self.path.startswith("/cdn/")
        if name == "index.json" and body is None:  # the downloader asks for a listing first
            with state.lock:
                state.listings += 1
            return self._empty(404)
        if state.redirect and not cdn and body is not None:
            return self._empty(302, {"Location": f"/cdn/{name}",
                                     "X-Linked-Etag": f'"{sha256_hex(body)}"'})
        with state.lock:
            state.gets[name] += 1
            state.ranges[name].append(self.headers.get("Range"))
            state.if_ranges[name].append(self.headers.get("If-Range"))
            fault = state.behaviour(name, state.gets[name])
        if body is None:
            return self._empty(404)
        if fault and fault[:3].isdigit():
            code, _, retry_after = fault.partition(":")
            return self._empty(int(code), {"Retry-After": retry_after} if retry_after else None)
        if fault == "redirect_invalid":  # to a CDN host that does not resolve
            return self._empty(302, {"Location": f"http://cdn.invalid/x/{name}"})
        if fault == "slow_headers":
            return self._slow_headers()
        if fault == "html":
            page = b"<!DOCTYPE html><html><body>rate limited, try later</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            return self._write(name, page)
        etag = state.etag_of(body, cdn)
        start = 0
        requested = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        same_version = if_range is None or if_range == etag or not state.if_range_support
        if requested and state.range_support and same_version:
            first, last_n = re.fullmatch(r"bytes=(\d*)-(\d*)", requested).groups()
            # bytes=-n: the last n bytes, what a streaming loader reads a footer with
            start = int(first) if first else max(len(body) - int(last_n), 0)
            if start >= len(body):
                return self._empty(416, {"Content-Range": f"bytes */{len(body)}"})
            self.send_response(206)
            first = 0 if fault == "bad_range" else start
            self.send_header("Content-Range", f"bytes {first}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        if etag:
            self.send_header("ETag", etag)
        payload = body[start:]
        if fault == "garbage":
            payload = b"\x00not parquet" * (len(payload) // 12) + b"!" * (len(payload) % 12)
        if fault == "flip_page":
            payload = corrupt_page(body)[start:]
        if fault == "flip":
            middle = len(payload) // 2
            payload = payload[:middle] + bytes([payload[middle] ^ 1]) + payload[middle + 1:]
        if fault != "cut":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault == "slow":
            time.sleep(0.3)
        if fault in ("drop", "cut"):
            payload = payload[:len(payload) // 2]
        if fault == "short":
            payload = payload[:max(len(payload) - 100, 0)]
        if state.drop_every is not None:
            payload = payload[:state.drop_every]
        if fault == "trickle":
            self._write(name, payload[:100])
            try:
                for i in range(100, len(payload)):
                    time.sleep(0.02)
                    self._write(name, payload[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on us, as it should
            return
        self._write(name, payload)


@pytest.fixture
def fault_server(tmp_path):
    """A local shard server (http://127.0.0.1:PORT/resolve/main) that misbehaves on request: set
    its files, faults and always (see _FaultState), then read what it saw."""
    state = _FaultState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FaultHandler)
    httpd.daemon_threads = True
    httpd.state = state
    # a short poll so that shutdown() at teardown returns in ~50 ms, not the default 0.5 s
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/resolve/main"
    yield state
    httpd.shutdown()
    httpd.server_close()


def serve_shards(server, tmp_path, indices, *, big: bool = False) -> dict[int, bytes]:
    """Write a real shard per index (~14 KB; big: ~220 KB of hex text in 8 row groups),
    register its bytes with the server, return them by index."""
    folder = tmp_path / "served"
    folder.mkdir(exist_ok=True)
    served = {}
    for i in indices:
        path = folder / index_to_filename(i)
        if big:
            rng = random.Random(i)
            write_shard(path, [rng.randbytes(200).hex() for _ in range(1000)], row_group_size=128)
        else:
            write_shard(path, sample_texts(i, 300), row_group_size=64)
        served[i] = path.read_bytes()
        server.files[index_to_filename(i)] = served[i]
    return served


def assert_only_complete_shards(data_dir, served: dict[int, bytes], *,
                                 partial_ok: bool = False) -> None:
    """Every *.parquet in data_dir is byte-identical to what was served, with a record of its size
    and sha256; no temp files remain (unless partial_ok: a failed shard keeps its partial download
    for the next run)."""
    names = sorted(os.listdir(data_dir))
    if not partial_ok:
        assert not [n for n in names if n.endswith(".tmp")], names
    parquet = [n for n in names if n.endswith(".parquet")]
    assert parquet == sorted(index_to_filename(i) for i in served)
    for i, body in served.items():
        path = os.path.join(data_dir, index_to_filename(i))
        with open(path, "rb") as f:
            assert f.read() == body
        with open(path + ".json") as f:
            assert json.load(f)["sha256"] == sha256_hex(body)


def download_shard(server, tmp_path, index, **kwargs) -> bool:
    """download_single_file of shard index from server into tmp_path/data, backing off 10 ms."""
    return download_single_file(index, str(tmp_path / "data"), server.url, backoff_base=0.01,
                                **kwargs)


def dataset_cli(server, data_dir, *args) -> int:
    """`python -m nanochat.dataset` from server into data_dir, backing off 10 ms: its exit
    status."""
    return main(["--base-url", server.url, "--data-dir", str(data_dir), *FAST_BACKOFF, *args])



def bit_flipped(body):
    """body with its 101st byte changed: same size, PAR1 at both ends."""
    return body[:100] + bytes([body[100] ^ 1]) + body[101:]


def gpt_simple_windows(tokens: list[int], max_length: int,
                       overlap: int) -> list[tuple[list[int], int]]:
    """GPT-Simple's windows of one document (its tokens + EOD), the reference: from the
    definition with plain lists, window k holds tokens
    [k * step, k * step + L) (step = L - O), and a window is written only if it holds a token that
    no earlier one had."""
    windows, k = [], 0
    while True:
        first = k * (max_length - overlap)
        windows.append((tokens[first:first + max_length], overlap if k else 0))
        if first + max_length >= len(tokens):
            return windows
        k += 1


def token_bucket(root, name: str, low: int, *, n_docs: int = 3000, bos: int = 1,
                 seed: int = 0) -> str:
    """A mixture bucket root/train/<name>/: one pair of n_docs documents of 2 to 40 tokens, BOS
    first, the others drawn from [low, low + 1000) (so a row's bucket shows in its ids)."""
    rng = np.random.default_rng(seed)
    directory = os.path.join(root, "train", name)
    os.makedirs(directory, exist_ok=True)
    entries = [np.concatenate(([bos], rng.integers(low, low + 1000, size=n))).astype(np.uint16)
               for n in rng.integers(1, 40, size=n_docs)]
    write_token_shard(os.path.join(directory, "shard_000"), entries, [0] * n_docs, np.uint16)
    return directory


def mixture_options(data_dir, curriculum, **given) -> MixtureOptions:
    """The mixture loader's arguments as its plan takes them: its defaults, small sizes (B=2, T=31,
    buffers of 16, chunks of 32, BOS 1, 4,000 ids, on the CPU) and the arguments given."""
    parameters = inspect.signature(pretokenized_mixture_loader_with_state_bos_bestfit).parameters
    defaults = {name: p.default for name, p in parameters.items()
                if p.default is not inspect.Parameter.empty}
    return MixtureOptions(**defaults | dict(B=2, T=31, split="train", curriculum=curriculum,
                                            data_dir=data_dir, buffer_size=16, chunk_size=32,
                                            bos_token=1, vocab_size=4000, device="cpu") | given)
