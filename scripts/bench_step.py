"""
What a loader costs a training step. The trainer has one Python thread that matters: the one that
launches kernels and steps the optimizer. A modelled step is P ms of pure-Python work that holds
the GIL (launches, bookkeeping), then G ms that release it (the GPU computing: a sleep), then
next(loader). Per loader it prints the step time against no loader, how much the Python part
stretches (the loader's threads take the GIL from it), next()'s wait at p50, p99 and the most, and
the gen-2 garbage collections in the trainer process. Each run is a fresh process; runs alternate,
and a round's ratios are to its own run without a loader.

    python -m scripts.bench_step                    # (P, G) = (30, 100) and (10, 40) ms, 3 rounds
    python -m scripts.bench_step --pg 30,100 --rounds 1 --steps 40
    python -m scripts.bench_step --device cuda   # every loader yields on the GPU (pinned staging)

Loaders: none (prebuilt batches); nanochat's algorithm in the caller (tests/oracle.py's best-fit,
rows made a tensor, as nanochat's loader runs); ours on threads of the trainer's process
(workers=0); and each of ours as it runs by default, in a worker process: tokenizing best-fit,
concatenating, streamed from a local HTTP server, pretokenized, and a mixture of two buckets; and
"spin": no loader, but a process at niceness 19 that only spins beside the trainer. The
tokenizing ones run with our tokenizer and with one whose encode returns lists (as nanochat's).
The corpus and the tokenizer are scripts/bench_dataloader.py's. Speed is a measurement here,
never a test assertion.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from nanochat.data.base.cli import run
from nanochat.dataloader import (pretokenized_distributed_data_loader_with_state_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import index_to_filename, split_parquet_files
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit
from nanochat.data.processing.tokenize_pair import pretokenize_file
from nanochat.tokenizer import RustBPETokenizer
from scripts.bench_dataloader import cpu_seconds, make_corpus, read_all, write_corpus
from scripts.list_tokenizer import ListTokenizer
from nanochat.data.fetch.serve import ShardServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))  # tests/ is no package: its modules by path
import oracle  # noqa: E402  nanochat's best-fit, written plainly

TOKENIZERS = ("ours", "lists")
# (loader, tokenizer) in the order the tables show them; "-": the loader takes no tokenizer
CONFIGS = ([("none", "-")] + [(loader, tokenizer) for tokenizer in TOKENIZERS
                              for loader in ("nanochat", "threads", "bestfit", "concat", "stream")]
           + [("pretokenized", "-"), ("mixture", "-"), ("spin", "-")])


# -----------------------------------------------------------------------------
# One run, in a fresh process


def python_work(iterations: int) -> int:
    """Pure-Python work that holds the GIL throughout: a trainer's launches and bookkeeping."""
    total = 0
    for i in range(iterations):
        total += i * i % 7
    return total


def make_loader(kind: str, tokenizer, args):
    """An iterator of (inputs, targets, state) of one kind."""
    B, T, data_dir, device = args.B, args.T, args.data_dir, args.device
    threads = args.tokenizer_threads  # (None: the loader's default)
    if kind in ("bestfit", "threads"):  # threads: workers=0; the others: the default, a worker
        return tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, B, T, "train", device=device, data_dir=data_dir,
            workers=0 if kind == "threads" else None, tokenizer_threads=threads)
    if kind == "concat":
        return tokenizing_distributed_data_loader_with_state(
            tokenizer, B, T, "train", device=device, data_dir=data_dir, tokenizer_threads=threads)
    if kind == "stream":
        return tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, B, T, "train", device=device, stream=True, base_url=args.url,
            tokenizer_threads=threads,
            num_shards=len(split_parquet_files("train", data_dir)),
            data_dir=tempfile.mkdtemp(prefix="nanochat-bench-step-cache-"))
    # (pretokenize_file writes no pretokenize.json: the BOS and vocabulary are the tokenizer's)
    vocab = dict(bos_token=tokenizer.get_bos_token_id(), vocab_size=tokenizer.get_vocab_size())
    if kind == "pretokenized":
        return pretokenized_distributed_data_loader_with_state_bos_bestfit(
            B, T, "train", device=device, data_dir=args.tokens_dir, **vocab)
    if kind == "mixture":
        return pretokenized_mixture_loader_with_state_bos_bestfit(
            B, T, "train", args.curriculum, device=device, data_dir=args.buckets_dir, **vocab)
    if kind == "nanochat":
        paths = split_parquet_files("train", data_dir)

        def rows():
            for inputs, targets, state in oracle.bestfit_loader(tokenizer, paths, B, T):
                yield torch.tensor(inputs), torch.tensor(targets), state

        def on_cuda():  # as nanochat: a pinned [inputs | targets] buffer, one non-blocking copy
            staging = torch.empty(2 * B * T, dtype=torch.long, pin_memory=True)
            buffer = torch.empty(2 * B * T, dtype=torch.long, device=device)
            for inputs, targets, state in rows():
                staging[:B * T].view(B, T).copy_(inputs)
                staging[B * T:].view(B, T).copy_(targets)
                buffer.copy_(staging, non_blocking=True)
                yield buffer[:B * T].view(B, T), buffer[B * T:].view(B, T), state
        return on_cuda() if torch.device(device).type == "cuda" else rows()
    prebuilt = torch.zeros(B, T, dtype=torch.long, device=device)
    if kind == "spin":
        return Spinner(prebuilt)
    return iter(lambda: (prebuilt, prebuilt, {}), None)


class Spinner:
    """Prebuilt batches, and beside the trainer a process that only spins, at niceness 19 as the
    worker: what any work on another core costs the step on this machine."""

    def __init__(self, batch):
        self.batch = batch
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import os\nos.nice(19)\nwhile os.getppid() == {os.getpid()}:"
                                   "\n    pass"])  # (it ends with the run, however that ends)
        self.worker_pid = self.process.pid  # (its CPU goes in the worker's column)

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch, self.batch, {}

    def close(self):
        self.process.kill()
        self.process.wait()


def child(config: dict) -> dict:
    """One run: warm-up steps, then the measured ones; its figures."""
    args = argparse.Namespace(**config)
    tokenizer = RustBPETokenizer.from_directory(args.tokenizer_dir)
    if args.tokenizer == "lists":
        tokenizer = ListTokenizer(tokenizer)
    loader = make_loader(args.loader, tokenizer, args)
    collections = [0]
    cuda = torch.device(args.device).type == "cuda"

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections[0] += 1

    def step():
        t0 = time.perf_counter()
        python_work(args.iterations)
        t1 = time.perf_counter()
        time.sleep(args.G / 1e3)  # (the GPU's share of the step: the GIL is free)
        t2 = time.perf_counter()
        next(loader)
        if cuda:  # (a trainer's step ends in a sync: the batch's copy is part of the wait)
            torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t2, time.perf_counter() - t0

    try:
        for _ in range(args.warmup):  # (the loader's first buffer fill, read-ahead)
            step()
        gc.callbacks.append(count)
        cpu0 = cpu_seconds(os.getpid()), cpu_seconds(getattr(loader, "worker_pid", None))
        figures = [step() for _ in range(args.steps)]
        cpu1 = cpu_seconds(os.getpid()), cpu_seconds(getattr(loader, "worker_pid", None))
        gc.callbacks.remove(count)
    finally:
        if hasattr(loader, "close"):
            loader.close()
    python, wait, total = (np.array(column) * 1e3 for column in zip(*figures))
    return {"python_ms": float(np.mean(python)), "step_ms": float(np.mean(total)),
            "wait_p50": float(np.percentile(wait, 50)), "wait_p99": float(np.percentile(wait, 99)),
            "wait_max": float(wait.max()), "gen2": collections[0],
            # CPU time per step: the trainer process (its threads included) and the worker
            "cpu_trainer_ms": (cpu1[0] - cpu0[0]) * 1e3 / args.steps,
            "cpu_worker_ms": (cpu1[1] - cpu0[1]) * 1e3 / args.steps}


# -----------------------------------------------------------------------------
# The runs, alternating


def calibrate(ms: float) -> int:
    """Iterations of python_work that take `ms` here, alone."""
    n = 100_000
    while True:
        t0 = time.perf_counter()
        python_work(n)
        dt = time.perf_counter() - t0
        if dt > 0.05:
            return int(n * ms / 1e3 / dt)
        n *= 2


def run_config(config: dict) -> dict:
    """A child in a fresh process; its figures."""
    result = subprocess.run([sys.executable, "-m", "scripts.bench_step", "--child",
                             json.dumps(config)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", nargs="+", default=["30,100", "10,40"],
                        help="P,G: ms of GIL-holding Python, then ms that release it, per step")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps before measuring")
    parser.add_argument("--B", type=int, default=32)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--num-docs", type=int, default=12_000)
    parser.add_argument("--tokenizer-threads", type=int, default=None,
                        help="the tokenizing loaders' tokenizer_threads (default: theirs, the "
                             "rank's CPUs less one, from 1 to 4)")
    parser.add_argument("--device", default="cpu",
                        help="where every loader yields, and the prebuilt batches live: cpu, cuda")
    parser.add_argument("--only", nargs="+", metavar="LOADER[:TOKENIZER]",
                        help="run only these configurations, e.g. bestfit:ours pretokenized "
                             "(none, the step without a loader, always runs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # (one run, in a fresh process)
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.only:
        wanted = {tuple((name + ":-").split(":")[:2]) if ":" not in name else
                  tuple(name.split(":", 1)) for name in args.only}
        unknown = wanted - set(CONFIGS)
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)}; choose from "
                         + ", ".join(f"{loader}:{tokenizer}" for loader, tokenizer in CONFIGS))
        configs = [config for config in CONFIGS if config == ("none", "-") or config in wanted]
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    try:
        device_type = torch.device(args.device).type
    except RuntimeError:
        parser.error(f"--device must be a torch device such as cpu or cuda, got {args.device!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} but torch {torch.__version__} sees no CUDA GPU "
                     f"(CUDA build: {torch.version.cuda}); run with --device cpu")
    with tempfile.TemporaryDirectory(prefix="nanochat-bench-step-") as tmp:
        data = prepare(tmp, args.num_docs)
        server = ShardServer(data["hosted"])  # (on this process's threads: not the trainer's)
        print(f"bench_step: device={args.device} B={args.B} T={args.T}, {args.rounds} rounds of "
              f"{args.steps} steps after {args.warmup}, {os.cpu_count()} cores")
        for pg in args.pg:
            P, G = (float(x) for x in pg.split(","))
            base = dict(B=args.B, T=args.T, device=args.device, steps=args.steps,
                        tokenizer_threads=args.tokenizer_threads,
                        warmup=args.warmup, P=P, G=G, iterations=calibrate(P),
                        url=server.url) | data
            results = {config: [] for config in configs}
            for _ in range(args.rounds):  # (alternating: a noisy neighbour hits every one)
                for loader, tokenizer in configs:
                    results[(loader, tokenizer)].append(
                        run_config(base | {"loader": loader, "tokenizer": tokenizer}))
                    done = results[(loader, tokenizer)][-1]  # (a run cut short still says this)
                    print(f"  {loader}/{tokenizer}: step {done['step_ms']:.1f} ms, next() p99 "
                          f"{done['wait_p99']:.2f} ms", flush=True)
            report(P, G, results)
        server.shutdown()
    return 0


def prepare(tmp: str, num_docs: int) -> dict:
    """The corpus, its tokenizer, the same shards hosted under the dataset's names (the last one is
    val), pretokenized, and in two buckets for a mixture."""
    data_dir, tokenizer_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
    write_corpus(make_corpus(num_docs), data_dir)
    sample = (t for batch in read_all(split_parquet_files("train", data_dir)[:1]) for t in batch)
    tokenizer = RustBPETokenizer.train_from_iterator(sample, 16_384)
    tokenizer.save(tokenizer_dir)
    hosted, tokens_dir, buckets_dir = (os.path.join(tmp, name)
                                       for name in ("hosted", "tokens", "buckets"))
    os.makedirs(hosted)
    train = split_parquet_files("train", data_dir)
    for i, path in enumerate(train):
        os.link(path, os.path.join(hosted, index_to_filename(i)))
    val = split_parquet_files("val", data_dir)[0]
    os.link(val, os.path.join(hosted, index_to_filename(6542)))
    tokens = 0
    for split, paths in (("train", train), ("val", [val])):
        for i, path in enumerate(paths):
            name = os.path.basename(path)[:-len(".parquet")]
            tokens += pretokenize_file(tokenizer, path, os.path.join(tokens_dir, split, name),
                                       num_threads=2)["tokens"]
            for bucket in ("a", "b"):  # every shard in both buckets: each has every token
                directory = os.path.join(buckets_dir, split, bucket)
                os.makedirs(directory, exist_ok=True)
                for ext in (".bin", ".idx"):
                    os.link(os.path.join(tokens_dir, split, name + ext),
                            os.path.join(directory, name + ext))
    # one phase, half of what the buckets hold: it outlasts any run of this script
    curriculum = [{"tokens": tokens // 2, "mix": {"a": 0.5, "b": 0.5}}]
    return {"data_dir": data_dir, "tokenizer_dir": tokenizer_dir, "hosted": hosted,
            "tokens_dir": tokens_dir, "buckets_dir": buckets_dir, "curriculum": curriculum}


def report(P: float, G: float, results: dict) -> None:
    """One table per (P, G): medians over the rounds; the added time and the Python part's stretch
    are the medians of each round's ratio to the same round's step without a loader (a host that
    drifts between minutes moves both alike), with the lowest and highest round after them."""
    def median(config, key):
        return float(np.median([r[key] for r in results[config]]))

    def against_none(config, key) -> str:
        pairs = zip(results[config], results[("none", "-")])
        changes = [100 * (run[key] / none[key] - 1) for run, none in pairs]
        return f"{np.median(changes):+.1f}% ({min(changes):+.1f} to {max(changes):+.1f})"

    step0, python0 = median(("none", "-"), "step_ms"), median(("none", "-"), "python_ms")
    print(f"\nP={P:g} ms of Python, G={G:g} ms GIL-free: with no loader a step takes "
          f"{step0:.1f} ms (Python {python0:.1f} ms)")
    print("| loader | tokenizer | step ms | added | Python part | next() p50 / p99 / max ms | "
          "gen-2 GCs | CPU ms/step: trainer, worker |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for config in results:
        waits = " / ".join(f"{median(config, k):.2f}" for k in ("wait_p50", "wait_p99", "wait_max"))
        gen2 = [r["gen2"] for r in results[config]]
        print(f"| {config[0]} | {config[1]} | {median(config, 'step_ms'):.1f} | "
              f"{against_none(config, 'step_ms')} | {against_none(config, 'python_ms')} | "
              f"{waits} | {', '.join(map(str, gen2))} | "
              f"{median(config, 'cpu_trainer_ms'):.1f}, {median(config, 'cpu_worker_ms'):.1f} |",
              flush=True)


if __name__ == "__main__":
    run(main, "bench_step stopped; it only measures, on data in temporary directories: "
              "rerun it")
