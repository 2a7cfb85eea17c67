"""
The pretokenize command's executors against the tokenizer alone: tokens/s, cost per unit, splits.
One process runs the sides one after another, each first in turn over --rounds (medians; 6 for
steadier figures on a shared host), each into a fresh output directory, on
scripts/bench_dataloader.py's generated corpus and a BPE trained on it:
1. tokens/s on every core (2 here): the tokenizer alone, in the executors' shape (spawned
   processes, one a core, each encoding its share of the row groups with encode_to_arrays on one
   thread, texts in memory, nothing read or written: fairer than one encode on 2 threads, whose
   threads share one process's texts and interpreter); the local executor (--num-workers = cores);
   the Ray executor, on a cluster of as many CPUs started once in this process (its start timed
   apart). Both executors tokenize every shard (val too); whether Ray's files equal the local ones.
   The local executor's runs include starting its workers (spawn, imports, the tokenizer); Ray's
   workers start with the cluster and serve every run.
2. the cost of a unit beyond tokenizing: runs of one tiny jsonl file a core (the run's fixed
   cost: the plan, the lock, the local workers' start) and of --tiny files per executor: the
   seconds per further unit (scheduling, the write, the fsync'ed rename); and on Ray, a task
   whose worker dies once against one that does not (the retry).
3. one big plain .jsonl of --mb MB: one unit on one core (tokenize_unit on one thread, this
   process pinned to a core), one unit with --num-workers 1 (its encode on os.cpu_count() threads),
   and split into ~8 units on every core; Ray's cluster is shut down by then.
4. core-hours to pretokenize FineWeb-Edu-100B (100e9 tokens) and ClimbMix-400B (400e9) at each
   one's tokens/s per core (this corpus and BPE; real text and a 65,536 vocabulary differ).
Speed is a measurement here, never a test assertion.

    python -m scripts.bench_pretokenize            # ~5 min on 2 cores
    python -m scripts.bench_pretokenize --quick    # seconds: checks that it runs
"""

import argparse
import contextlib
import filecmp
import io
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time

from nanochat.data.base.cli import run
from nanochat.data.base.datasets import split_parquet_files
from nanochat.data.processing.pretokenize_run import PretokenizeRun, run_pretokenize
from nanochat.data.processing.units import plan_units, tokenize_unit
from nanochat.pretokenize import pretokenize_job
from nanochat.tokenizer import RustBPETokenizer
from scripts.bench_dataloader import make_corpus, read_all, write_corpus

CORES = os.cpu_count() or 1
PARTS = 8  # the big input's units when split
DATASETS = {"FineWeb-Edu-100B": 100e9, "ClimbMix-400B": 400e9}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_pretokenize")
    parser.add_argument("--shards", type=int, default=16, help="parquet train shards (+ a val)")
    parser.add_argument("--docs-per-shard", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("--tiny", type=int, default=64, help="tiny jsonl files (part 2)")
    parser.add_argument("--mb", type=float, default=128, help="the big jsonl's size (part 3)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--quick", action="store_true", help="a small run, to check it works")
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.docs_per_shard, args.tiny, args.mb, args.rounds = 2, 512, 8, 4, 1
    print(f"bench_pretokenize: {CORES} cores, {vars(args)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(tmp, args)
        import ray  # (an extra: only here, so that spawned local workers do not import it)
        t0 = time.perf_counter()
        ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False)
        ray_start = time.perf_counter() - t0
        print(f"Ray cluster of {CORES} CPUs started in {ray_start:.1f}s (not in the runs below)")
        try:
            rates = executors(paths, args.rounds)
            per_unit = unit_costs(paths, args.tiny, args.rounds)
            per_unit["retry"] = retry_cost(ray, tmp, args.rounds)
        finally:
            ray.shutdown()
        splits = split_input(paths, args.rounds)
    report(rates, per_unit, splits, ray_start, args.tiny)
    return 0


def prepare(tmp: str, args) -> dict:
    """The parquet shards, the BPE, the tiny jsonl files and the big one, under tmp."""
    t0 = time.perf_counter()
    docs = make_corpus(args.shards * args.docs_per_shard)
    paths = {name: os.path.join(tmp, name)
             for name in ("data", "tokenizer", "tiny", "big.jsonl", "out")}
    write_corpus(docs, paths["data"], args.docs_per_shard)
    RustBPETokenizer.train_from_iterator(iter(docs[:4000]), args.vocab_size).save(
        paths["tokenizer"])
    os.makedirs(paths["tiny"])
    for i in range(args.tiny):  # 4 documents of ~40 words each
        with open(os.path.join(paths["tiny"], f"tiny_{i:04d}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": " ".join(d.split()[:40])}) + "\n"
                         for d in docs[4 * i:4 * i + 4])
    with open(paths["big.jsonl"], "wb") as f:
        size = 0
        for doc in itertools.cycle(docs):  # the corpus's documents, again if need be
            size += f.write(json.dumps({"text": doc}).encode() + b"\n")
            if size >= args.mb * 2**20:
                break
    mb = os.path.getsize(paths["big.jsonl"]) / 2**20
    print(f"prepared {len(docs):,} documents in {args.shards} + 1 parquet shards, a "
          f"{args.vocab_size:,} BPE, {args.tiny} tiny jsonl files and a {mb:.0f} MB jsonl in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    return paths


# 1. tokens/s: the tokenizer alone, the local executor, the Ray executor


def executors(paths: dict, rounds: int) -> dict:
    """Median tokens/s of each side over rounds, and "identical": whether Ray's files equal the
    local executor's in every round."""
    found: dict = {"alone": [], "local": [], "ray": []}
    identical = True
    for r in range(rounds):
        tokens = {}
        for side in rotated(list(found), r):
            if side == "alone":
                tokens[side], seconds = tokenizer_alone(paths["data"], paths["tokenizer"])
            else:
                output = os.path.join(paths["out"], side)
                job = pretokenize_job([paths["data"]], output, tokenizer_dir=paths["tokenizer"])
                seconds = timed_run(job, side, CORES)
                tokens[side] = tokens_in(output)
            found[side].append(tokens[side] / seconds)
        if len(set(tokens.values())) != 1:
            raise RuntimeError(f"the sides' token counts differ: {tokens}")
        identical &= same_files(os.path.join(paths["out"], "local"),
                                os.path.join(paths["out"], "ray"))
        shutil.rmtree(paths["out"])
        print(f"round {r + 1}: {tokens['alone']:,} tokens; M tokens/s: " + ", ".join(
            f"{side} {v[-1] / 1e6:.2f}" for side, v in found.items()), flush=True)
    return {side: statistics.median(v) for side, v in found.items()} | {"identical": identical}


def rotated(sides: list, r: int) -> list:
    """The sides in round r's order: each goes first in turn, so that a drift up or down of the
    host's speed through a round falls on every side alike."""
    return sides[r % len(sides):] + sides[:r % len(sides)]


def tokenizer_alone(data_dir: str, tokenizer_dir: str) -> tuple[int, float]:
    """(tokens, wall seconds) of CORES spawned processes encoding every row group of the dataset
    (val too, as the executors), each its share on one thread, from when all hold their texts."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(CORES + 1), ctx.Queue()
    children = [ctx.Process(target=encode_share, args=(data_dir, tokenizer_dir, k, start, results))
                for k in range(CORES)]
    for child in children:
        child.start()
    start.wait(timeout=600)
    t0 = time.perf_counter()
    tokens = sum(results.get(timeout=600) for _ in children)
    seconds = time.perf_counter() - t0
    for child in children:
        child.join()
    return tokens, seconds


def encode_share(data_dir: str, tokenizer_dir: str, k: int, start, results) -> None:
    """tokenizer_alone's child k: row groups k, k + CORES, ..., with the BOS as a pair's entry."""
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    paths = split_parquet_files("train", data_dir) + split_parquet_files("val", data_dir)
    batches = read_all(paths)[k::CORES]
    bos = tokenizer.get_bos_token_id()
    start.wait(timeout=600)
    results.put(sum(len(doc) for texts in batches
                    for doc in tokenizer.encode_to_arrays(texts, prepend=bos, num_threads=1)))


def timed_run(job, executor: str, num_workers: int) -> float:
    """Wall seconds of run_pretokenize on the executor (its printed lines kept out of ours)."""
    lines, t0 = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(lines), contextlib.redirect_stderr(lines):
        status = run_pretokenize(PretokenizeRun(job, num_workers, rank=0, world_size=1,
                                                lock_timeout=10.0, executor=executor))
    seconds = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"the {executor} executor failed:\n{lines.getvalue()}")
    return seconds


def tokens_in(output: str) -> int:
    """Tokens in the .bin files under output (2 bytes a token up to a 65,536 vocabulary)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(output)
               for f in files if f.endswith(".bin")) // 2


def same_files(a: str, b: str) -> bool:
    """Whether two outputs hold the same files (hidden lock files aside), byte for byte."""
    names = files_under(a)
    return names == files_under(b) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def files_under(top: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, files in os.walk(top)
                  for f in files if not f.startswith("."))


# 2. the cost of a unit beyond tokenizing


def unit_costs(paths: dict, tiny: int, rounds: int) -> dict:
    """{executor: (median seconds of a run of CORES tiny files, of `tiny` files)}."""
    inputs = sorted(os.path.join(paths["tiny"], f) for f in os.listdir(paths["tiny"]))
    times: dict = {(executor, n): [] for executor in ("local", "ray") for n in (CORES, tiny)}
    for r in range(rounds):
        for executor, n in times:
            job = pretokenize_job(inputs[:n], os.path.join(paths["out"], f"{executor}-{n}"),
                                  tokenizer_dir=paths["tokenizer"])
            times[executor, n].append(timed_run(job, executor, CORES))
        shutil.rmtree(paths["out"])
        print(f"round {r + 1}: tiny files, seconds: " + ", ".join(
            f"{executor} {n} {v[-1]:.2f}" for (executor, n), v in times.items()), flush=True)
    return {executor: (statistics.median(times[executor, CORES]),
                       statistics.median(times[executor, tiny])) for executor in ("local", "ray")}


def retry_cost(ray, tmp: str, rounds: int) -> tuple[float, float]:
    """Median seconds of a task that returns at once, and of one whose worker dies on its first try
    (os._exit, as a kill -9 would end it) and that Ray runs again: the executor's task options."""
    from nanochat.data.processing.ray_executor import MAX_RETRIES

    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_dies_once)
    plain, retried = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        ray.get(task.remote(None))
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ray.get(task.remote(os.path.join(tmp, f"died-{r}")))
        retried.append(time.perf_counter() - t0)
    return statistics.median(plain), statistics.median(retried)


def _dies_once(marker: str | None) -> int:
    """A task's body: its worker process dies the first time it runs for a marker path."""
    if marker is not None and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return os.getpid()


# 3. a big input, whole on one core against split on every core


def split_input(paths: dict, rounds: int) -> dict:
    """{side: median seconds} for the big jsonl (and "tokens": its tokens): one unit on one core,
    one unit with --num-workers 1, PARTS units on every core."""
    mb = os.path.getsize(paths["big.jsonl"]) / 2**20
    sides = {"one core": (None, 1), "--num-workers 1": (None, 1),
             f"{PARTS} units, {CORES} workers": (mb / PARTS * 1.01, CORES)}
    times: dict = {side: [] for side in sides}
    for r in range(rounds):
        for side in rotated(list(sides), r):
            unit_mb, num_workers = sides[side]
            job = pretokenize_job([paths["big.jsonl"]], os.path.join(paths["out"], str(r)),
                                  tokenizer_dir=paths["tokenizer"], unit_mb=unit_mb)
            times[side].append(one_core(job) if side == "one core"
                               else timed_run(job, "local", num_workers))
            tokens = tokens_in(paths["out"])
            shutil.rmtree(paths["out"])
        print(f"round {r + 1}: big jsonl, seconds: " + ", ".join(
            f"{side} {v[-1]:.1f}" for side, v in times.items()), flush=True)
    return {side: statistics.median(v) for side, v in times.items()} | {"tokens": tokens}


def one_core(job) -> float:
    """Seconds of tokenize_unit on one thread for the job's one unit, every thread of this process
    pinned to one core (threads started meanwhile inherit it)."""
    [unit] = plan_units(job)
    every = os.sched_getaffinity(0)
    pin({min(every)})
    try:
        t0 = time.perf_counter()
        tokenize_unit(job, unit, num_threads=1)
        return time.perf_counter() - t0
    finally:
        pin(every)


def pin(cpus: set) -> None:
    for tid in os.listdir("/proc/self/task"):  # every thread of this process
        os.sched_setaffinity(int(tid), cpus)


# The figures


def report(rates: dict, per_unit: dict, splits: dict, ray_start: float, tiny: int) -> None:
    print(f"\n1. M tokens/s on {CORES} cores (medians): " + ", ".join(
        f"{side} {rates[side] / 1e6:.2f} ({rates[side] / rates['alone']:.2f} of alone)"
        for side in ("alone", "local", "ray")))
    same = "yes" if rates["identical"] else "no"
    print(f"   Ray / local {rates['ray'] / rates['local']:.2f}; Ray's start {ray_start:.1f}s (not "
          f"in its runs); identical (Ray's files against local's): {same}")
    print(f"2. beyond tokenizing: runs of {CORES} and of {tiny} tiny jsonl files (4 short "
          "documents each)")
    plain, retried = per_unit.pop("retry")
    for executor, (few, many) in per_unit.items():
        print(f"   {executor:5s}: {CORES} files {few:.2f}s (a run's fixed cost), {tiny} files "
              f"{many:.2f}s -> {(many - few) / (tiny - CORES) * 1e3:.1f} ms a further unit")
    print(f"   a retry on Ray: a task whose worker dies once {retried:.2f}s, against {plain:.3f}s "
          "for one that returns (plus the work the dead try had done); the local executor does "
          "not retry: a dead worker stops its run, and a rerun writes the rest")
    whole, tokens = splits.pop("one core"), splits.pop("tokens")
    print(f"3. the big jsonl ({tokens:,} tokens): one core {whole:.1f}s "
          f"({tokens / whole / 1e6:.2f}M tokens/s); " + ", ".join(
              f"{side} {seconds:.1f}s (x{whole / seconds:.2f})"
              for side, seconds in splits.items()))
    print("4. core-hours (tokens / (tokens/s per core) / 3600):")
    for side in ("alone", "local", "ray"):
        per_core = rates[side] / CORES
        print(f"   {side:5s} at {per_core / 1e6:.2f}M tokens/s a core: " + ", ".join(
            f"{name} {tokens / per_core / 3600:,.0f}" for name, tokens in DATASETS.items()))


if __name__ == "__main__":
    run(main, "bench_pretokenize stopped; it only measures, in a temporary directory: rerun it")
