"""
Tokenizing that grows with the cores a rank is given: tokens/s by cores, and against the tokenizer.
For each set of cores (1, then 2, ... up to the machine's), one fresh process pinned to them
(sched_setaffinity, as `taskset -c`) measures, on the same texts, with a consumer that does nothing:
- the tokenizer alone: encode(texts, num_threads=cores) over every document batch (tiktoken's own
  threads), for our tokenizer (encode_to_arrays) and one that returns lists (as nanochat's);
- the public loader in its worker process (B=32, T=2048), tokenizing on threads
  (tokenizer_processes=0), on as many processes as cores (the count a rank with a free trainer
  could use) and with the default (cores less one for the trainer);
- the serial part: CPU seconds per million tokens of the loader's own process (its threads read,
  send texts out, take documents back, pack and write the rows), without its tokenizing processes.
From the last it prints what one loader can emit at 8, 16 and 32 cores: the fewer of the
tokenizing processes' rate (cores - 1 of them) and the serial part's (1e6 / its CPU seconds per
million tokens). Speed is a measurement here, never a test assertion.

    python -m scripts.bench_cores                   # 1 and 2 cores here; ~3 min
    python -m scripts.bench_cores --cores 1,2,4,8   # on a bigger machine
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from nanochat.data.base.cli import run
from nanochat.data.base.datasets import split_parquet_files
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.tokenizer import RustBPETokenizer
from scripts.bench_dataloader import make_corpus, read_all, write_corpus
from scripts.list_tokenizer import ListTokenizer

B, T = 32, 2048
TOKENIZER_BATCH = 128


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process pid, its children not included (/proc/pid/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tokenizer_alone(tokenizer, text_batches, cores: int) -> float:
    """Tokens/s of the tokenizer's own batch call over every text batch, on `cores` threads."""
    encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
    bos = tokenizer.get_bos_token_id()
    start, tokens = time.perf_counter(), 0
    for texts in text_batches:
        tokens += sum(len(ids) for ids in encode(texts, prepend=bos, num_threads=cores))
    return tokens / (time.perf_counter() - start)


def loader_rate(tokenizer, data_dir: str, batches: int, processes: int | None) -> tuple:
    """(tokens/s, the loader process's CPU seconds per million tokens) of the public loader in its
    worker, over `batches` batches after the first (start-up) few."""
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, "train", device="cpu", data_dir=data_dir, rank=0, world_size=1,
        workers=1, tokenizer_processes=processes, tokenizer_batch_size=TOKENIZER_BATCH)
    try:
        for _ in range(3):  # start-up: the worker, its processes, the buffer's first fill
            next(loader)
        pid = loader.worker_pid
        cpu, start = _cpu_seconds(pid), time.perf_counter()
        for _ in range(batches):
            next(loader)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
    finally:
        loader.close()
    tokens = batches * B * (T + 1)
    return tokens / seconds, cpu / (tokens / 1e6)


def measure(cores: int, data_dir: str, tokenizer_dir: str, batches: int) -> dict:
    """Everything for one set of cores, in this process (pinned by the caller)."""
    ours = RustBPETokenizer.from_directory(tokenizer_dir)
    texts = [t for batch in read_all(split_parquet_files("train", data_dir)) for t in batch]
    text_batches = [texts[i:i + TOKENIZER_BATCH] for i in range(0, len(texts), TOKENIZER_BATCH)]
    found = {}
    for name, tokenizer in (("ours", ours), ("lists", ListTokenizer(ours))):
        found[name] = {"alone": tokenizer_alone(tokenizer, text_batches, cores),
                       "one_thread": tokenizer_alone(tokenizer, text_batches[:40], 1)}
        for label, processes in (("threads", 0), ("processes", cores), ("default", None)):
            found[name][label] = loader_rate(tokenizer, data_dir, batches, processes)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_cores")
    parser.add_argument("--cores", default=None,
                        help="comma-separated core counts (default: 1 and every core here)")
    parser.add_argument("--num-docs", type=int, default=12_000)
    parser.add_argument("--batches", type=int, default=40, help="loader batches timed per run")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a pinned child's job
    args = parser.parse_args(argv)
    if args.one:  # a child: cores, data_dir, tokenizer_dir
        cores, data_dir, tokenizer_dir = args.one.split(",", 2)
        print(json.dumps(measure(int(cores), data_dir, tokenizer_dir, args.batches)))
        return 0
    available = sorted(os.sched_getaffinity(0))
    counts = ([int(c) for c in args.cores.split(",")] if args.cores
              else sorted({1, len(available)}))
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, tokenizer_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
        docs = make_corpus(args.num_docs)
        write_corpus(docs, data_dir)
        RustBPETokenizer.train_from_iterator(iter(docs[:4000]), 16_384).save(tokenizer_dir)
        results = {}
        for cores in counts:
            pinned = ",".join(map(str, available[:cores]))
            print(f"cores {pinned} ...", flush=True)
            done = subprocess.run(
                ["taskset", "-c", pinned, sys.executable, "-m", "scripts.bench_cores",
                 "--batches", str(args.batches), "--one", f"{cores},{data_dir},{tokenizer_dir}"],
                capture_output=True, text=True, check=True)
            results[cores] = json.loads(done.stdout.strip().splitlines()[-1])
    report(results)
    return 0


def report(results: dict) -> None:
    first = min(results)
    for name in ("ours", "lists"):
        print(f"\n{name}: tokens/s (M) by cores; loader / the tokenizer alone on the same cores")
        print("cores  alone  threads  processes  default   processes/alone  scale vs 1 core  "
              "serial CPU s/M")
        # against the better of threads and processes on one core
        base = max(results[first][name]["processes"][0], results[first][name]["threads"][0])
        for cores, found in sorted(results.items()):
            one = found[name]
            rate, serial = one["processes"]
            scale = rate / base
            print(f"{cores:5d} {one['alone'] / 1e6:6.2f} {one['threads'][0] / 1e6:8.2f} "
                  f"{rate / 1e6:10.2f} {one['default'][0] / 1e6:8.2f} {rate / one['alone']:17.2f} "
                  f"{scale:16.2f} {serial:15.3f}")
        last = results[max(results)][name]
        per_process, serial = last["one_thread"], last["processes"][1]
        predicted = ", ".join(
            f"{cores} cores {min((cores - 1) * per_process, 1e6 / serial) / 1e6:.1f}M"
            for cores in (8, 16, 32))
        print(f"predicted (cores - 1 processes at {per_process / 1e6:.2f}M/s each, the serial "
              f"part at most {1 / serial:.1f}M/s): {predicted}")


if __name__ == "__main__":
    run(main, "bench_cores stopped; it only measures, in a temporary directory: rerun it")
