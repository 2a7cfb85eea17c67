"""
The pretokenized best-fit loader against plain block slicing, on the same tokens: B=32, T=2048,
one process, each run a fresh process, the contenders alternating round after round.

    python -m scripts.bench_pretokenized                          # LitData skipped if absent
    python -m scripts.bench_pretokenized --litdata-python /work/litenv/bin/python
    python -m scripts.bench_pretokenized --work /tmp/pretok_bench  # keep the corpus for next time

Contenders: ours, best-fit with its exact-resume state (device='cpu'; in its worker process, the
default, and in this one, workers=0); a plain block slicer over our memory-mapped shards (no BOS
alignment, no packing: there is no pretokenized concatenating loader); LitData's TokensLoader over
an optimized copy of the same tokens (blocks of T+1 cut across documents, 0 workers), run by
--litdata-python, a venv with litdata, which is never a dependency of this package; and a memory
copy of the same bytes. The corpus and its BPE are
scripts/bench_dataloader.py's. It prints tokens/s (rows of T+1 tokens), the median over rounds,
and the ratios. Speed is a measurement here, never a test assertion.
"""

# numpy, the standard library and nanochat.data.base.cli (the standard library's only) at the top:
# the LitData runs import this module in a venv that may lack our dependencies (pyarrow, tiktoken)
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from nanochat.data.base.cli import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = ("bestfit", "bestfit-here", "slicer", "litdata", "memcpy")
LABELS = {
    "bestfit": "ours, best-fit (a worker process, the default)",
    "bestfit-here": "ours, best-fit (this process, workers=0)",
    "slicer": "block slicer over our shards (concatenation)",
    "litdata": "LitData TokensLoader (0 workers)",
    "memcpy": "memory copy of the same bytes",
}

# -----------------------------------------------------------------------------
# The corpus: bench_dataloader's, pretokenized, and an optimized copy for LitData


def prepare(work: str, num_docs: int, vocab_size: int, threads: int) -> str:
    """Write (once) the parquet corpus, its BPE and its pretokenized shards under work; returns the
    pretokenized directory (train/ and val/, with pretokenize.json's settings passed as
    arguments)."""
    from nanochat.data.base.datasets import split_parquet_files
    from nanochat.data.processing.tokenize_pair import pretokenize_file
    from nanochat.tokenizer import RustBPETokenizer
    from scripts.bench_dataloader import make_corpus, read_all, write_corpus
    tokens_dir = os.path.join(work, "tokens")
    done = os.path.join(work, "prepared.json")
    if os.path.exists(done):  # a kept --work directory: the same corpus as last time
        return tokens_dir
    data_dir = os.path.join(work, "data")
    t0 = time.perf_counter()
    write_corpus(make_corpus(num_docs), data_dir)
    # the first shard only: ~4,000 documents train a 16k vocab in seconds
    sample = (t for batch in read_all(split_parquet_files("train", data_dir)[:1]) for t in batch)
    tokenizer = RustBPETokenizer.train_from_iterator(sample, vocab_size)
    for split in ("train", "val"):
        for path in split_parquet_files(split, data_dir):
            name = os.path.basename(path)[:-len(".parquet")]
            pretokenize_file(tokenizer, path, os.path.join(tokens_dir, split, name),
                             num_threads=threads)
    meta = {"bos_token": tokenizer.get_bos_token_id(), "vocab_size": tokenizer.get_vocab_size()}
    with open(done, "w") as f:
        json.dump(meta, f)
    print(f"prepared {num_docs:,} documents, a {vocab_size:,}-token BPE and their pretokenized "
          f"shards in {time.perf_counter() - t0:.0f}s -> {tokens_dir}")
    return tokens_dir


def train_tokens(tokens_dir: str) -> np.ndarray:
    """Every token of the train shards, in order, as one array (the same bytes every contender
    reads). Reads the .bin files directly: the LitData venv has numpy, not our package's deps."""
    paths = sorted(glob.glob(os.path.join(tokens_dir, "train", "*.bin")))
    dtype = np.uint16 if read_meta(tokens_dir)["vocab_size"] <= 2**16 else np.uint32
    return np.concatenate([np.fromfile(path, dtype=dtype) for path in paths])


def read_meta(tokens_dir: str) -> dict:
    with open(os.path.join(os.path.dirname(tokens_dir), "prepared.json")) as f:
        return json.load(f)


def optimize_for_litdata(tokens_dir: str) -> str:
    """LitData's optimized dataset of the train tokens (once), as its docs build one for
    TokensLoader: the token stream in chunks, read back as blocks of block_size."""
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader
    out = os.path.join(os.path.dirname(tokens_dir), "litdata")
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    paths = sorted(glob.glob(os.path.join(tokens_dir, "train", "*.bin")))
    dtype = "uint16" if read_meta(tokens_dir)["vocab_size"] <= 2**16 else "uint32"
    optimize(fn=shard_tokens, inputs=[(path, dtype) for path in paths], output_dir=out,
             chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=1)
    return out


def shard_tokens(item):
    """LitData's optimize fn: one item per shard (TokensLoader reads across item boundaries), in
    the shards' own dtype, so LitData stores and reads back the same bytes as ours. (Module level:
    optimize pickles it into its worker.)"""
    import torch
    path, dtype = item
    yield torch.from_numpy(np.fromfile(path, dtype=dtype))


# -----------------------------------------------------------------------------
# One contender, in this (fresh) process


def run_one(name: str, tokens_dir: str, B: int, T: int, batches: int, warmup: int) -> dict:
    """Time `batches` batches of `name` after `warmup` untimed ones: {tokens, seconds}."""
    make = {"bestfit": lambda: ours(tokens_dir, B, T, workers=1),
            "bestfit-here": lambda: ours(tokens_dir, B, T, workers=0),
            "slicer": lambda: slicer(tokens_dir, B, T),
            "litdata": lambda: litdata_batches(tokens_dir, B, T),
            "memcpy": lambda: memcpy(tokens_dir, B, T)}[name]
    it = make()
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t0
    return {"name": name, "tokens": batches * B * (T + 1), "seconds": seconds}


def ours(tokens_dir: str, B: int, T: int, workers: int):
    from nanochat.dataloader import pretokenized_distributed_data_loader_with_state_bos_bestfit
    meta = read_meta(tokens_dir)
    return pretokenized_distributed_data_loader_with_state_bos_bestfit(
        B, T, "train", device="cpu", data_dir=tokens_dir, bos_token=meta["bos_token"],
        vocab_size=meta["vocab_size"], rank=0, world_size=1, workers=workers)


def slicer(tokens_dir: str, B: int, T: int):
    """Consecutive (B, T+1) blocks of the train shards' memory maps, copied into one batch buffer
    and handed out as a tensor: concatenation at its plainest."""
    import torch
    from nanochat.data.pretokenized.token_shards import TokenShard
    shards = [TokenShard(path) for path in sorted(glob.glob(
        os.path.join(tokens_dir, "train", "*.bin")))]
    batch = np.empty(B * (T + 1), dtype=shards[0].dtype)
    tensor = torch.from_numpy(batch).view(B, T + 1)  # shares batch's memory: no copy
    while True:
        for shard in shards:  # a shard's tail shorter than a batch is dropped, as drop_last
            for start in range(0, len(shard.tokens) - batch.size + 1, batch.size):
                np.copyto(batch, shard.tokens[start:start + batch.size])
                yield tensor


def litdata_batches(tokens_dir: str, B: int, T: int):
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader
    dataset = StreamingDataset(optimize_for_litdata(tokens_dir),
                               item_loader=TokensLoader(block_size=T + 1), drop_last=True)
    loader = StreamingDataLoader(dataset, batch_size=B, num_workers=0, drop_last=True)
    while True:  # epoch after epoch, as our loader runs
        yield from loader


def memcpy(tokens_dir: str, B: int, T: int):
    """The same bytes copied batch by batch from memory into one buffer: the physical bound."""
    tokens = train_tokens(tokens_dir)
    batch = np.empty(B * (T + 1), dtype=tokens.dtype)
    while True:
        for start in range(0, tokens.size - batch.size + 1, batch.size):
            np.copyto(batch, tokens[start:start + batch.size])
            yield batch


# -----------------------------------------------------------------------------
# Rounds of fresh processes


def run_child(python: str, name: str, tokens_dir: str, args) -> dict | None:
    cmd = [python, "-m", "scripts.bench_pretokenized", "--one", name, "--tokens-dir", tokens_dir,
           "-B", str(args.B), "-T", str(args.T), "--batches", str(args.batches),
           "--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"{name}: failed (rc {result.returncode}):\n{result.stderr[-2000:]}")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def litdata_available(python: str | None) -> str | None:
    """Why LitData is skipped, or None when `python` can import it."""
    if python is None:
        return "no --litdata-python given"
    probe = subprocess.run([python, "-c", "import litdata"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import litdata"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_pretokenized", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=None,
                        help="where the corpus is written and kept (default: a temporary folder)")
    parser.add_argument("--num-docs", type=int, default=24_000,
                        help="documents in the generated corpus (~1,000 tokens each)")
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("--threads", type=int, default=4, help="tokenizer threads (pretokenize)")
    parser.add_argument("-B", type=int, default=32)
    parser.add_argument("-T", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=300, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--litdata-python", default=None,
                        help="a Python with litdata installed (its own venv)")
    parser.add_argument("--one", choices=CONTENDERS, default=None,
                        help="(internal) time one contender in this process, print JSON")
    parser.add_argument("--tokens-dir", default=None, help="(internal, with --one)")
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.tokens_dir, args.B, args.T, args.batches,
                                 args.warmup)))
        return
    print(f"bench_pretokenized: {vars(args)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or tmp
        tokens_dir = prepare(work, args.num_docs, args.vocab_size, args.threads)
        n_tokens = train_tokens(tokens_dir).size
        print(f"train tokens: {n_tokens:,} ({n_tokens / (args.B * (args.T + 1)):.0f} batches of "
              f"B={args.B} x T+1={args.T + 1})")
        pythons = {name: sys.executable for name in CONTENDERS}
        skipped = litdata_available(args.litdata_python)
        if skipped:
            print(f"LitData TokensLoader: skipped ({skipped})")
            del pythons["litdata"]
        else:
            pythons["litdata"] = args.litdata_python
            run_child(args.litdata_python, "litdata", tokens_dir, args)  # optimizes, untimed
        tps: dict = {name: [] for name in pythons}
        for r in range(args.rounds):
            for name, python in pythons.items():
                result = run_child(python, name, tokens_dir, args)
                if result is not None:
                    tps[name].append(result["tokens"] / result["seconds"])
            print(f"round {r + 1}: " + ", ".join(f"{name} {v[-1] / 1e6:.1f}M" for name, v
                                                in tps.items() if v))
        report(tps, args)


def report(tps: dict, args) -> None:
    median = {name: statistics.median(v) for name, v in tps.items() if v}
    print(f"\nB={args.B} T={args.T}, one process, {args.rounds} rounds of fresh processes, "
          f"{args.batches} timed batches each; tokens/s counts rows of T+1 tokens")
    print(f"{'contender':48s} {'median tok/s':>14s} {'range':>18s}")
    for name, value in median.items():
        low, high = min(tps[name]), max(tps[name])
        print(f"{LABELS[name]:48s} {value / 1e6:12.1f} M {low / 1e6:7.1f}-{high / 1e6:.1f} M")
    print()
    for ours_name in ("bestfit", "bestfit-here"):
        if ours_name in median and "litdata" in median:
            print(f"{LABELS[ours_name]} / LitData TokensLoader: "
                  f"{median[ours_name] / median['litdata']:.2f}")
    if "slicer" in median and "memcpy" in median:
        print(f"block slicer / memory copy: {median['slicer'] / median['memcpy']:.2f}")
    if "litdata" in median and "memcpy" in median:
        print(f"LitData TokensLoader / memory copy: {median['litdata'] / median['memcpy']:.2f}")


if __name__ == "__main__":
    run(main, "bench_pretokenized stopped; it only measures, on data in temporary directories: "
              "rerun it")
