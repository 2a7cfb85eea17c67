"""
Streaming benchmark: training while the shards stream in over a throttled link (stream=True),
against fetching them all first, on one corpus in one run (about a minute on 2 cores).

    python -m scripts.bench_streaming                   # 10 shards of ~2.8 MB, 80 and 10 MB/s
    python -m scripts.bench_streaming --rates 80 10 1   # link rates in MB/s
    python -m scripts.bench_streaming --step-ms 0       # no training step: the loader's top pace

It serves shards of scripts/demo.py's corpus from nanochat/data/fetch/serve.py on 127.0.0.1 at each
link rate, and (unless --no-s3) from an S3 API: moto's server on 127.0.0.1, unthrottled, as the
tests start it (the dev extras). Each batch is followed by a simulated training step (--step-ms).
Per link: fetch all, then train; and stream=True into an empty cache with cache_limit =
--cache-shards x the largest shard. Each prints the time to the first batch, next()'s waits after
it, the rate shards were consumed at and the peak disk use, and checks the batches equal the
on-disk loader's. Speed is a measurement, never a test assertion; docs/benchmarks.md has figures.
"""

import argparse
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time

import pyarrow.parquet as pq

from nanochat.data.base.cli import run
from nanochat.data.fetch import stores
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import get_dataset
from nanochat.dataset import download_shards
from nanochat.tokenizer import RustBPETokenizer
from scripts.demo import generate_documents, write_hosted_shards
from nanochat.data.fetch.serve import ShardServer

ROW_GROUP_SIZE = 1024  # documents per row group, as the hosted shards


# -----------------------------------------------------------------------------
# Disk use


def shard_bytes(directory: str) -> int:
    """Bytes of the shard files in directory, partial downloads (.parquet.tmp) included; 0 if it is
    not there."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith((".parquet", ".parquet.tmp")):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:  # renamed or evicted since the listing
                        pass
    except FileNotFoundError:
        pass
    return total


class DiskSampler:
    """The peak of shard_bytes(directory), sampled on a thread every `interval` seconds until
    stop()."""

    def __init__(self, directory: str, interval: float = 0.01):
        self.directory, self.interval, self.peak = directory, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shard_bytes(self.directory))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# -----------------------------------------------------------------------------
# One run of the loader


def consumed_bytes(state: dict, sizes: list[int], row_groups: list[int]) -> float:
    """Bytes of the train shards up to and including the state's row group: what the packer has
    taken documents from (one rank; row groups as a share of their shard's bytes)."""
    if state["epoch"] != 1:
        raise ValueError("the run went past the first epoch; pass fewer --batches or more "
                         "--shards")
    pq_idx, rg_idx = state["pq_idx"], state["rg_idx"]
    return sum(sizes[:pq_idx]) + sizes[pq_idx] * (rg_idx + 1) / row_groups[pq_idx]


def run_loader(tokenizer, args, data_dir: str, num_batches: int, step_s: float,
               t_start: float | None = None, **stream_kwargs) -> dict:
    """The first batch and num_batches more from a fresh best-fit loader on the CPU, each followed
    by a step_s sleep (a training step). Returns the seconds to the first batch (from t_start,
    default now), the seconds and next()'s wait after it, a sha256 of every batch, the first and
    last states, and the shard cache's figures when streaming."""
    t_start = time.perf_counter() if t_start is None else t_start
    digest = hashlib.sha256()
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, args.B, args.T, "train", device="cpu", data_dir=data_dir, rank=0, world_size=1,
        **stream_kwargs)
    try:
        inputs, targets, first_state = next(loader)
        first_s = time.perf_counter() - t_start
        digest.update(inputs.numpy().tobytes() + targets.numpy().tobytes())
        wait0, t0 = loader.stats["wait_seconds"], time.perf_counter()
        state = first_state
        for _ in range(num_batches):
            time.sleep(step_s)
            inputs, targets, state = next(loader)
            digest.update(inputs.numpy().tobytes() + targets.numpy().tobytes())
        result = {"first_s": first_s, "seconds": time.perf_counter() - t0,
                  "wait_s": loader.stats["wait_seconds"] - wait0, "digest": digest.hexdigest(),
                  "first_state": first_state, "state": state}
        status = loader.cache_status()  # a streaming loader's shard cache figures, else None
        if status is not None:
            result |= {"peak_bytes": status.peak_bytes, "fetched_bytes": status.fetched_bytes}
    finally:
        loader.close()
    return result


def both_runs(base_url: str, fetched, tokenizer, args, work: str, step_s: float,
              cache_limit: int) -> dict:
    """Fetch all then train, and stream=True, from base_url; fetched() lists the shards the source
    has sent whole so far, in order."""
    # a dataset's directory name: streamed_split reads its val index from it
    subdir = get_dataset().subdir
    fetched_dir = os.path.join(work, "fetched", subdir)
    t0 = time.perf_counter()
    indices = list(range(args.shards)) + [get_dataset().max_shard]  # -n N fetches val too
    failed = download_shards(indices, fetched_dir, base_url=base_url, progress=False)
    if failed:
        raise RuntimeError(f"could not fetch shards {failed} from {base_url}")
    download_s = time.perf_counter() - t0
    fetch_all = run_loader(tokenizer, args, fetched_dir, args.batches, step_s, t_start=t0)
    fetch_all |= {"download_s": download_s, "disk_bytes": shard_bytes(fetched_dir)}
    shutil.rmtree(os.path.dirname(fetched_dir))

    cache_dir = os.path.join(work, "stream", subdir)
    sampler, before = DiskSampler(cache_dir), len(fetched())
    try:
        stream = run_loader(tokenizer, args, cache_dir, args.batches, step_s, stream=True,
                            cache_limit=cache_limit, prefetch_shards=args.prefetch_shards,
                            num_shards=args.shards, base_url=base_url)
    finally:
        peak = sampler.stop()
    stream |= {"disk_bytes": peak, "gets": fetched()[before:]}
    shutil.rmtree(os.path.dirname(cache_dir))
    return {"fetch_all": fetch_all, "stream": stream}


def link_rate_run(
    hosted: str, rate: float, tokenizer, args, work: str, step_s: float, cache_limit: int
) -> dict:
    """Both runs against one server throttled to `rate` bytes/s: fetch all then train, and
    stream=True."""
    server = ShardServer(hosted, rate=rate)
    try:
        return both_runs(server.url, server.fetched, tokenizer, args, work, step_s, cache_limit)
    finally:
        server.close()


@contextlib.contextmanager
def aws_environment(endpoint: str):
    """AWS clients pointed at endpoint with the test server's credentials (no ~/.aws, no instance
    role), the environment restored after; nanochat.data.fetch.stores forgets its filesystems
    each way."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    for name in saved:
        del os.environ[name]
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                       "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    stores.forget_filesystems()
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(saved)
        stores.forget_filesystems()


def s3_run(hosted: str, tokenizer, args, work: str, step_s: float, cache_limit: int) -> dict:
    """Both runs against moto's S3 server on 127.0.0.1, the shards uploaded to a fresh bucket.
    The loader reaches it through tests/s3_server.py's FaultProxy with no fault set: a
    pass-through whose request log says which shards were fetched (a GET from byte 0)."""
    from tests.s3_server import FaultProxy, S3Bucket, S3Server  # the dev extras

    with S3Server() as server:
        bucket, proxy = S3Bucket(server.endpoint), FaultProxy(server.endpoint)
        try:
            bucket.upload_dir(hosted, "shards")

            def fetched() -> list[str]:
                return [os.path.basename(seen.path.split("?")[0]) for seen in proxy.seen()
                        if seen.method == "GET" and seen.path.split("?")[0].endswith(".parquet")
                        and (seen.range is None or seen.range.startswith("bytes=0-"))]

            with aws_environment(proxy.endpoint):
                runs = both_runs(bucket.url("shards"), fetched, tokenizer, args, work, step_s,
                                 cache_limit)
        finally:
            proxy.close()
    total = shard_bytes(hosted)
    runs["rate"] = total / runs["fetch_all"]["download_s"]  # what the fetch-all download reached
    return runs


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_streaming", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[80.0, 10.0],
                        help="link rates in MB/s, one pair of runs each (default: 80 10)")
    parser.add_argument("--shards", type=int, default=10,
                        help="train shards; one val shard is added (default: 10)")
    parser.add_argument("--docs-per-shard", type=int, default=5000,
                        help="documents per shard (default: 5000, ~2.8 MB)")
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("-B", type=int, default=32)
    parser.add_argument("-T", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=120,
                        help="batches after the first, per run "
                             "(default: 120, about 6 of the 10 shards)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="simulated training step after each batch, ms "
                             "(default: 1.5x the on-disk loader's time per batch; 0: none)")
    parser.add_argument("--cache-shards", type=float, default=6.5,
                        help="cache_limit in shards: this many times the largest (default: 6.5)")
    parser.add_argument("--prefetch-shards", type=int, default=2,
                        help="the loader's prefetch_shards (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default: 0)")
    parser.add_argument("--no-s3", action="store_true",
                        help="skip the run against moto's S3 server (it needs the dev extras)")
    args = parser.parse_args(argv)
    for name in ("shards", "docs_per_shard", "batches", "B", "T"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.rates) <= 0:
        parser.error(f"--rates must be > 0 MB/s, got {args.rates}")
    if args.step_ms is not None and args.step_ms < 0:
        parser.error(f"--step-ms must be >= 0, got {args.step_ms}")
    if args.cache_shards <= 0 or args.prefetch_shards < 0:
        parser.error("--cache-shards must be > 0 and --prefetch-shards >= 0")
    return args


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"bench_streaming: {vars(args)}")
    with tempfile.TemporaryDirectory(prefix="nanochat-bench-streaming-") as tmp:
        hosted = os.path.join(tmp, "hosted")
        t0 = time.perf_counter()
        docs = generate_documents((args.shards + 1) * args.docs_per_shard, args.seed)
        paths = write_hosted_shards(docs, hosted, args.shards, ROW_GROUP_SIZE)
        sizes = [os.path.getsize(p) for p in paths[:-1]]
        row_groups = [pq.ParquetFile(p).num_row_groups for p in paths[:-1]]
        print(f"corpus: {len(docs):,} documents, {sum(map(len, docs)) / 1e6:.0f}M characters -> "
              f"{args.shards} train shards of {min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB "
              f"({row_groups[0]} row groups) + val, {mb(sum(map(os.path.getsize, paths)))} in all, "
              f"in {time.perf_counter() - t0:.1f}s")
        del docs
        t0 = time.perf_counter()
        texts = pq.read_table(paths[0], columns=["text"]).column("text").to_pylist()
        tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), args.vocab_size)
        print(f"tokenizer: a {tokenizer.get_vocab_size():,}-token BPE trained on the first shard "
              f"in {time.perf_counter() - t0:.1f}s")

        # on disk, no network, no step: the loader's top pace, and the batches every run must yield
        reference = run_loader(tokenizer, args, hosted, args.batches, 0.0)
        pace = reference["seconds"] / args.batches
        step_s = 1.5 * pace if args.step_ms is None else args.step_ms / 1e3
        last = reference["state"]
        print(f"on disk, no step: {args.batches} batches of {args.B}x{args.T} after the first in "
              f"{reference['seconds']:.1f}s, {pace * 1e3:.0f} ms a batch, up to shard "
              f"{last['pq_idx']} row group {last['rg_idx']} (of {args.shards} shards)")
        print(f"training step after each batch: {step_s * 1e3:.0f} ms"
              + (" (1.5x that)" if args.step_ms is None else " (--step-ms)"))
        cache_limit = int(args.cache_shards * max(sizes))
        print(f"cache_limit: {mb(cache_limit)} ({args.cache_shards:g} x the largest shard), "
              f"prefetch_shards {args.prefetch_shards}")

        work = os.path.join(tmp, "runs")
        results = [(f"link {rate:g} MB/s", rate,
                    link_rate_run(hosted, rate * 1e6, tokenizer, args, work, step_s, cache_limit))
                   for rate in args.rates]
        if not args.no_s3:
            runs = s3_run(hosted, tokenizer, args, work, step_s, cache_limit)
            results.append((f"S3 API (moto_server on 127.0.0.1, unthrottled: the fetch-all "
                            f"download reached {runs['rate'] / 1e6:.0f} MB/s)",
                            runs["rate"] / 1e6, runs))

    same = True
    for title, rate, runs in results:
        print(f"\n{title}")
        print(f"  {'':22s} {'first batch':>11s} {'last batch':>10s} "
              f"{'next() waited after the first':>30s} {'consumed':>10s}   peak disk")
        for name, label in (("fetch_all", "fetch all, then train"), ("stream", "stream=True")):
            r = runs[name]
            consumed = (consumed_bytes(r["state"], sizes, row_groups)
                        - consumed_bytes(r["first_state"], sizes, row_groups))
            r["rate"] = consumed / r["seconds"]
            disk = (f"{mb(r['disk_bytes'])} (every shard)" if name == "fetch_all" else
                    f"{mb(r['disk_bytes'])} sampled, {mb(r['peak_bytes'])} the cache's peak_bytes")
            print(f"  {label:22s} {r['first_s']:10.2f}s {r['first_s'] + r['seconds']:9.1f}s "
                  f"{r['wait_s']:20.2f}s of {r['seconds']:4.1f}s {r['rate'] / 1e6:5.2f} MB/s   "
                  f"{disk}")
        f, s = runs["fetch_all"], runs["stream"]
        peak = max(s["disk_bytes"], s["peak_bytes"])
        print(f"  fetch all: the download took {f['download_s']:.2f}s of its {f['first_s']:.2f}s "
              f"to the first batch")
        print(f"  stream: first batch {f['first_s'] / s['first_s']:.1f}x sooner; the link carries "
              f"{rate / (f['rate'] / 1e6):.1f}x what the loader consumes on disk; next() waited "
              f"{s['wait_s']:.2f}s after the first batch ({f['wait_s']:.2f}s on disk)")
        print(f"  stream: peak disk {mb(peak)} of cache_limit {mb(cache_limit)} "
              f"({peak / cache_limit:.2f}); fetched {len(s['gets'])} shards "
              f"({len(set(s['gets']))} distinct, {mb(s['fetched_bytes'])}), in order: "
              f"{', '.join(name.removesuffix('.parquet') for name in s['gets'])}")
        for name, label in (("fetch_all", "fetch all"), ("stream", "stream")):
            r = runs[name]
            equal = r["digest"] == reference["digest"] and r["state"] == reference["state"]
            same &= equal
            print(f"  {label}: {1 + args.batches} batches (sha256 {r['digest'][:12]}...) and the "
                  f"last state {'equal' if equal else 'DIFFER FROM'} those of the on-disk loader "
                  f"without the network")
    return 0 if same else 1


if __name__ == "__main__":
    run(main, "bench_streaming stopped; it only measures, on data in temporary directories: "
              "rerun it")
