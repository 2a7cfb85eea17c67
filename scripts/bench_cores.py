"""
Tokenizing that grows with the cores a rank is given: tokens/s by cores, and against the tokenizer.
For each set of cores (1, then every core here, or --cores), one fresh process pinned to them
(taskset -c) measures, on the same texts, with a consumer that does nothing, alternating so that
the host's drift falls on every side alike (medians of --rounds):
- the tokenizer alone: encode(texts, num_threads=cores) over the document batches (tiktoken's own
  threads), for our tokenizer (encode_to_arrays) and one that returns lists (as nanochat's);
- the public loader in its worker (B=32, T=2048) tokenizing on threads (tokenizer_processes=0,
  tokenizer_threads=4), on as many processes as cores, and with the default (cores less one for
  the trainer: processes from 2, else threads): tokens emitted per second, and tokens tokenized per
  second (best-fit crops about a third of what it tokenizes at T=2048), the one to hold against the
  tokenizer alone;
- the serial part: CPU seconds per million tokens tokenized of the loader's own process (its
  threads read, send texts out, take documents back, pack and write the rows), its tokenizing
  processes not included.
From the last two it predicts tokens tokenized per second at 8, 16 and 32 cores: the fewer of
cores - 1 processes at one thread's rate and the serial part's 1e6 / (its CPU seconds per
million). Speed is a measurement here, never a test assertion.

    python -m scripts.bench_cores                   # 1 and 2 cores here; ~6 min
    python -m scripts.bench_cores --cores 1,4,8,16  # on a bigger machine
"""

import argparse
import json
import os
import statistics
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
    """Tokens/s of the tokenizer's own batch call over the text batches, on `cores` threads."""
    encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
    bos = tokenizer.get_bos_token_id()
    start, tokens = time.perf_counter(), 0
    for texts in text_batches:
        tokens += sum(len(ids) for ids in encode(texts, prepend=bos, num_threads=cores))
    return tokens / (time.perf_counter() - start)


def loader_rate(tokenizer, data_dir: str, batches: int, **settings) -> dict:
    """The public loader in its worker, over `batches` batches after the first (start-up) few:
    tokens emitted and tokens tokenized per second (best-fit crops some of what it tokenizes), and
    the loader process's CPU seconds per million tokens tokenized."""
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, "train", device="cpu", data_dir=data_dir, rank=0, world_size=1,
        workers=1, tokenizer_batch_size=TOKENIZER_BATCH, **settings)
    try:
        for _ in range(3):  # start-up: the worker, its processes, the buffer's first fill
            next(loader)
        pid, tokenized = loader.worker_pid, loader.stats["tokens_tokenized"]
        cpu, start = _cpu_seconds(pid), time.perf_counter()
        for _ in range(batches):
            next(loader)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
        tokenized = loader.stats["tokens_tokenized"] - tokenized
    finally:
        loader.close()
    return {"emitted": batches * B * (T + 1) / seconds, "tokenized": tokenized / seconds,
            "serial": cpu / (tokenized / 1e6)}


def measure(cores: int, data_dir: str, tokenizer_dir: str, batches: int, rounds: int) -> dict:
    """Everything for one set of cores, in this process (pinned by the caller). The tokenizer alone
    and the loader alternate, `rounds` times each, so that the machine's drift (a shared host's
    clock moves a core's speed by a third between minutes) falls on both: the medians are kept."""
    ours = RustBPETokenizer.from_directory(tokenizer_dir)
    texts = [t for batch in read_all(split_parquet_files("train", data_dir)) for t in batch]
    text_batches = [texts[i:i + TOKENIZER_BATCH] for i in range(0, len(texts), TOKENIZER_BATCH)]
    found = {}
    for name, tokenizer in (("ours", ours), ("lists", ListTokenizer(ours))):
        runs: dict = {"alone": [], "one_thread": [], "threads": [], "processes": [], "default": []}
        for _ in range(rounds):
            runs["alone"].append(tokenizer_alone(tokenizer, text_batches, cores))
            runs["one_thread"].append(tokenizer_alone(tokenizer, text_batches[:60], 1))
            for label, settings in (("threads", dict(tokenizer_processes=0, tokenizer_threads=4)),
                                    ("processes", dict(tokenizer_processes=cores)),
                                    ("default", {})):
                runs[label].append(loader_rate(tokenizer, data_dir, batches, **settings))
        found[name] = {label: (statistics.median(values) if label in ("alone", "one_thread")
                               else {key: statistics.median(run[key] for run in values)
                                     for key in values[0]})
                       for label, values in runs.items()}
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_cores")
    parser.add_argument("--cores", default=None,
                        help="comma-separated core counts (default: 1 and every core here)")
    parser.add_argument("--num-docs", type=int, default=12_000)
    parser.add_argument("--batches", type=int, default=120, help="loader batches timed per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a pinned child's job
    args = parser.parse_args(argv)
    if args.one:  # a child: cores, data_dir, tokenizer_dir
        cores, data_dir, tokenizer_dir = args.one.split(",", 2)
        print(json.dumps(measure(int(cores), data_dir, tokenizer_dir, args.batches, args.rounds)))
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
                 "--batches", str(args.batches), "--rounds", str(args.rounds),
                 "--one", f"{cores},{data_dir},{tokenizer_dir}"],
                capture_output=True, text=True, check=True)
            results[cores] = json.loads(done.stdout.strip().splitlines()[-1])
    report(results)
    return 0


def report(results: dict) -> None:
    first = min(results)
    for name in ("ours", "lists"):
        print(f"\n{name}: M tokens/s by cores (medians); tokenized by the loader / the tokenizer "
              "alone on the same cores; emitted against one core's best")
        print("cores  alone  threads  processes  default  | processes: tokenized  /alone  "
              "scale  serial s/M | default: /alone")
        one_core = results[first][name]
        base = max(one_core["processes"]["emitted"], one_core["threads"]["emitted"])
        for cores, found in sorted(results.items()):
            one = found[name]
            rate = one["processes"]
            print(f"{cores:5d} {one['alone'] / 1e6:6.2f} {one['threads']['emitted'] / 1e6:8.2f} "
                  f"{rate['emitted'] / 1e6:10.2f} {one['default']['emitted'] / 1e6:8.2f}  | "
                  f"{rate['tokenized'] / 1e6:20.2f} {rate['tokenized'] / one['alone']:7.2f} "
                  f"{rate['emitted'] / base:6.2f} {rate['serial']:11.3f} | "
                  f"{one['default']['tokenized'] / one['alone']:15.2f}")
        last = results[max(results)][name]
        per_process, serial = last["one_thread"], last["processes"]["serial"]
        predicted = ", ".join(
            f"{cores} cores {min((cores - 1) * per_process, 1e6 / serial) / 1e6:.1f}M"
            for cores in (8, 16, 32))
        print(f"predicted tokens tokenized/s (cores - 1 processes at {per_process / 1e6:.2f}M/s "
              f"each, the serial part at most {1 / serial:.1f}M/s): {predicted}")


if __name__ == "__main__":
    run(main, "bench_cores stopped; it only measures, in a temporary directory: rerun it")
