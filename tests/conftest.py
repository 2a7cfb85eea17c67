"""Shared fixtures: tiny parquet shards written with pyarrow into tmp dirs, a byte-level tokenizer,
and where a state's buffered documents are. Where CI is set, a skipped test fails the run (a test
marked cuda may skip without a GPU)."""

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.data.fetch import stores
from nanochat.data.fetch.download import Limits
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.data.loader.order import UnitIndex
from nanochat.data.base.state import WindowKey, decode_keys
from nanochat.data.base.state_checks import config_shuffle
from nanochat.dataset import index_to_filename
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


class ByteTokenizer:
    """A stand-in for tests about packing, not BPE: one token per UTF-8 byte, BOS = 256."""

    bos = 256

    def get_bos_token_id(self):
        return self.bos

    def get_vocab_size(self):
        return 257

    def encode(self, texts, prepend=None, num_threads=1):
        def one(text):
            ids = list(text.encode("utf-8"))
            return ([prepend] if prepend is not None else []) + ids
        if isinstance(texts, str):
            return one(texts)
        return [one(t) for t in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


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
    """Where a state's buffered documents are: (epoch, pq_idx, rg_idx, row). A shuffled walk names
    those of its windows by position, (epoch, window, i): the i-th entry of that window's order."""
    config, index = state["config"], UnitIndex(paths, chunk_size)
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
    import importlib.util

    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed: pip install -e \".[dev]\""
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {reason}")
        pytest.skip(reason)


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
