"""
Tokenizing that grows with the cores a rank is given: tokens/s by cores, and against the tokenizer.
Each round runs, for each set of cores (1, then every core here, or --cores), one fresh process
pinned to them (taskset -c); rounds alternate the sets, so that the host's drift (a shared host
moves a core's speed by a fifth between minutes) falls on each alike, and every ratio is taken
within a round, between runs a few seconds apart. On the same texts, a consumer that does nothing:
- the tokenizer alone: encode(texts, num_threads=cores) (tiktoken's own threads), for our
  tokenizer (encode_to_arrays) and one that returns lists (as nanochat's), run before the first
  loader and after each: a loader is held against the two runs around it;
- the machine: as many separate processes as cores, each the tokenizer alone on one thread, at
  once; their tokens/s on N cores over one's on 1 core is what these cores give to any loader;
- the public loader in its worker (B=32, T=2048) tokenizing on threads (tokenizer_processes=0,
  tokenizer_threads=4), on as many processes as cores, and with the default (cores less one for
  the trainer: processes from 2, else threads): tokens emitted per second, and tokens tokenized per
  second (best-fit crops about a third of what it tokenizes at T=2048);
- on 1 core, the loader in the caller (workers=0, prefetch=0): no worker process and no threads,
  so its own work and nothing else; what the default loses against it is the worker's boundary
  (the price of a trainer whose GIL no loader takes);
- the serial part: CPU seconds per million tokens tokenized of the loader's own process (its
  threads read, send texts out, take documents back, pack and write the rows), its tokenizing
  processes not included.
From the last two it predicts tokens tokenized per second at 8, 16 and 32 cores. Speed is a
measurement here, never a test assertion.

    python -m scripts.bench_cores                   # 1 and 2 cores here, 3 rounds; 5-7 min
    python -m scripts.bench_cores --cores 1,4,8,16  # on a bigger machine
"""

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time

from nanochat.data.base.cli import run
from nanochat.data.base.datasets import split_parquet_files
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.tokenizer import RustBPETokenizer
from scripts.bench_dataloader import cpu_seconds, make_corpus, read_all, write_corpus
from scripts.list_tokenizer import ListTokenizer

B, T = 32, 2048
TOKENIZER_BATCH = 128


def tokenizer_alone(tokenizer, text_batches, threads: int) -> float:
    """Tokens/s of the tokenizer's own batch call over the text batches, on `threads` threads."""
    encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
    bos = tokenizer.get_bos_token_id()
    start, tokens = time.perf_counter(), 0
    for texts in text_batches:
        tokens += sum(len(ids) for ids in encode(texts, prepend=bos, num_threads=threads))
    return tokens / (time.perf_counter() - start)


def _texts(data_dir: str) -> list[list[str]]:
    texts = [t for batch in read_all(split_parquet_files("train", data_dir)) for t in batch]
    return [texts[i:i + TOKENIZER_BATCH] for i in range(0, len(texts), TOKENIZER_BATCH)]


def _tokenizer(name: str, tokenizer_dir: str):
    ours = RustBPETokenizer.from_directory(tokenizer_dir)
    return ours if name == "ours" else ListTokenizer(ours)


def _one_of_many(name: str, data_dir: str, tokenizer_dir: str, start, rates) -> None:
    """One of the machine's separate processes: the tokenizer alone on one thread, started with
    the others (`start`, a barrier), its tokens/s put on `rates`."""
    tokenizer, text_batches = _tokenizer(name, tokenizer_dir), _texts(data_dir)
    probe = text_batches[:len(text_batches) // 3]
    tokenizer_alone(tokenizer, probe[:4], 1)  # warm up before the others start
    start.wait()
    rates.put(tokenizer_alone(tokenizer, probe, 1))


def machine_rate(name: str, processes: int, data_dir: str, tokenizer_dir: str) -> float:
    """Tokens/s of `processes` separate processes tokenizing at once, one thread each: what these
    cores give to any loader (fresh interpreters, so no thread pool is forked)."""
    context = multiprocessing.get_context("spawn")
    start, rates = context.Barrier(processes), context.Queue()
    children = [context.Process(target=_one_of_many,
                                args=(name, data_dir, tokenizer_dir, start, rates))
                for _ in range(processes)]
    for child in children:
        child.start()
    found: list[float] = []
    while len(found) < processes:
        try:
            found.append(rates.get(timeout=1.0))
        except queue.Empty:  # a process that died says so now, not after a long wait
            dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
            if dead:
                for child in children:
                    child.kill()
                raise RuntimeError(f"a tokenizer process of the machine's run exited with "
                                   f"{dead[0]}; its error is above") from None
    for child in children:
        child.join()
    return sum(found)


def loader_rate(tokenizer, data_dir: str, batches: int, **settings) -> dict:
    """The public loader (in its worker unless `settings` say workers=0), over `batches` batches
    after the first (start-up) few: tokens emitted and tokens tokenized per second (best-fit crops
    some of what it tokenizes), and the worker's CPU seconds per million tokens tokenized (0 with
    no worker)."""
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, "train", device="cpu", data_dir=data_dir, rank=0, world_size=1,
        tokenizer_batch_size=TOKENIZER_BATCH, **({"workers": 1} | settings))
    try:
        for _ in range(3):  # start-up: the worker, its processes, the buffer's first fill
            next(loader)
        pid, tokenized = loader.worker_pid, loader.stats["tokens_tokenized"]
        cpu, start = cpu_seconds(pid), time.perf_counter()
        for _ in range(batches):
            next(loader)
        seconds, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
        tokenized = loader.stats["tokens_tokenized"] - tokenized
    finally:
        loader.close()
    return {"emitted": batches * B * (T + 1) / seconds, "tokenized": tokenized / seconds,
            "serial": cpu / (tokenized / 1e6)}


def measure(cores: int, data_dir: str, tokenizer_dir: str, batches: int) -> dict:
    """One round for one set of cores, in this process (pinned by the caller): per tokenizer, the
    tokenizer alone around each loader (each loader's "alone" is the mean of the runs just before
    and just after it), one thread alone, the machine's separate processes, and the loaders."""
    text_batches = _texts(data_dir)
    probe = text_batches[:len(text_batches) // 3]  # ~4M tokens: a few seconds on one core
    found = {}
    for name in ("ours", "lists"):
        tokenizer = _tokenizer(name, tokenizer_dir)
        tokenizer_alone(tokenizer, probe[:4], cores)  # warm up: the first calls of a process
        alone = [tokenizer_alone(tokenizer, probe, cores)]
        one = {"one_thread": tokenizer_alone(tokenizer, probe, 1),
               "machine": machine_rate(name, cores, data_dir, tokenizer_dir)}
        loaders = [("threads", dict(tokenizer_processes=0, tokenizer_threads=4)),
                   ("processes", dict(tokenizer_processes=cores)), ("default", {})]
        if cores == 1:  # no worker process, no threads: the loader's own work, nothing else
            loaders.append(("caller", dict(workers=0, prefetch=0)))
        for label, settings in loaders:
            one[label] = loader_rate(tokenizer, data_dir, batches, **settings)
            alone.append(tokenizer_alone(tokenizer, probe, cores))
            one[label]["alone"] = (alone[-2] + alone[-1]) / 2
        one["alone"] = statistics.median(alone)
        found[name] = one
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_cores")
    parser.add_argument("--cores", default=None,
                        help="comma-separated core counts (default: 1 and every core here)")
    parser.add_argument("--num-docs", type=int, default=12_000)
    parser.add_argument("--batches", type=int, default=120, help="loader batches timed per run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each a run of every set of cores")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a pinned child's job
    args = parser.parse_args(argv)
    if args.one:  # a child: cores, data_dir, tokenizer_dir
        cores, data_dir, tokenizer_dir = args.one.split(",", 2)
        print(json.dumps(measure(int(cores), data_dir, tokenizer_dir, args.batches)))
        return 0
    available = sorted(os.sched_getaffinity(0))
    counts = ([int(c) for c in args.cores.split(",")] if args.cores
              else sorted({1, len(available)}))
    if max(counts) > len(available) or min(counts) < 1:
        parser.error(f"--cores {args.cores}: this process may use {len(available)} cores")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, tokenizer_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
        docs = make_corpus(args.num_docs)
        write_corpus(docs, data_dir)
        RustBPETokenizer.train_from_iterator(iter(docs[:4000]), 16_384).save(tokenizer_dir)
        rounds = []
        for r in range(args.rounds):
            rounds.append({})
            for cores in counts:
                pinned = ",".join(map(str, available[:cores]))
                print(f"round {r + 1}/{args.rounds}: cores {pinned} ...", flush=True)
                done = subprocess.run(
                    ["taskset", "-c", pinned, sys.executable, "-m", "scripts.bench_cores",
                     "--batches", str(args.batches),
                     "--one", f"{cores},{data_dir},{tokenizer_dir}"],
                    capture_output=True, text=True, check=True)
                rounds[-1][cores] = json.loads(done.stdout.strip().splitlines()[-1])
    report(rounds)
    return 0


def _spread(values: list) -> str:
    """The median, then the lowest and highest of the rounds."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(rounds: list[dict]) -> None:
    counts = sorted(rounds[0])
    first = counts[0]
    for name in ("ours", "lists"):
        print(f"\n{name}: M tokens/s by cores (medians of {len(rounds)} rounds); the ratios' "
              "median (lowest-highest), each taken within a round: the loader's tokens tokenized "
              "/ the tokenizer alone just around it; emitted / the best emitted on "
              f"{first} core(s); the machine's separate processes / one")
        print("cores  alone  threads  processes  default | processes: /alone  default: /alone"
              "    caller: /alone  |  scale  machine | serial s/M")
        for cores in counts:
            print(_row(cores, [one[cores][name] for one in rounds],
                       [one[first][name] for one in rounds]))
        last = [one[counts[-1]][name] for one in rounds]
        per_process = statistics.median(f["one_thread"] for f in last)
        serial = statistics.median(f["processes"]["serial"] for f in last)
        predicted = ", ".join(
            f"{cores} cores {min((cores - 1) * per_process, 1e6 / serial) / 1e6:.1f}M"
            for cores in (8, 16, 32))
        print(f"predicted tokens tokenized/s (cores - 1 processes at {per_process / 1e6:.2f}M/s "
              f"each, the serial part at most {1 / serial:.1f}M/s): {predicted}")


def _row(cores: int, found: list[dict], fewest: list[dict]) -> str:
    """One line of the table: `found`, a tokenizer's figures on `cores` in each round; `fewest`,
    its figures on the fewest cores in the same rounds."""
    def rate(label: str) -> str:
        return f"{statistics.median(f[label]['emitted'] for f in found) / 1e6:.2f}"

    def against_alone(label: str) -> str:
        return _spread([f[label]["tokenized"] / f[label]["alone"] for f in found])

    best = [max(f["processes"]["emitted"], f["threads"]["emitted"]) for f in fewest]
    scale = _spread([f["processes"]["emitted"] / b for f, b in zip(found, best)])
    machine = _spread([f["machine"] / one["machine"] for f, one in zip(found, fewest)])
    serial = statistics.median(f["processes"]["serial"] for f in found)
    alone = statistics.median(f["alone"] for f in found) / 1e6
    caller = against_alone("caller") if "caller" in found[0] else "-"
    return (f"{cores:5d} {alone:6.2f} {rate('threads'):>8} {rate('processes'):>10} "
            f"{rate('default'):>8} | {against_alone('processes'):>17} "
            f"{against_alone('default'):>16} {caller:>17}  | {scale:>6} {machine} | {serial:.3f}")


if __name__ == "__main__":
    run(main, "bench_cores stopped; it only measures, in a temporary directory: rerun it")
