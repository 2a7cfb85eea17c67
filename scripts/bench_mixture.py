"""
Mixture benchmark: what mixing costs, and how close the realised mix stays to the target.

    python -m scripts.bench_mixture          # generated buckets, B=32, T=2048 (about 30 s)

Writes three pretokenized buckets of random tokens with different document lengths (web: long,
code: short, math: medium), then on the same data and in one run:
  - the mixture loader against the pretokenized loader on the same shards (the web bucket alone;
    all three buckets' shards as one directory), in tokens emitted per second: what the mixing
    itself costs (one packer and one state per bucket per batch, a row at a time);
  - the realised mix: the largest gap between a bucket's share and its weight over every window of
    1M trained tokens, per phase.
Speed is a measurement here, never a test assertion.
"""

import argparse
import os
import tempfile
import time

import numpy as np

from nanochat.data.base.cli import run
from nanochat.dataloader import pretokenized_distributed_data_loader_with_state_bos_bestfit
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit
from nanochat.data.pretokenized.token_shards import write_token_shard

BOS = 1  # any id outside the random tokens' range [2, 60000)


def make_bucket(root, name, n_tokens, median, seed):
    """Shards of documents with log-normal lengths, ~n_tokens in all (4 shards)."""
    rng = np.random.default_rng(seed)
    directory = os.path.join(root, "train", name)
    os.makedirs(directory)
    for s in range(4):
        entries, total = [], 0
        while total < n_tokens // 4:
            # sigma 1.0: lengths spread over an order of magnitude either side of the median
            n = int(np.exp(rng.normal(np.log(median), 1.0))) + 1
            tokens = rng.integers(2, 60000, size=n - 1)
            entries.append(np.concatenate(([BOS], tokens)).astype(np.uint16))
            total += n
        write_token_shard(os.path.join(directory, f"shard_{s:03d}"), entries, [0] * len(entries),
                          np.uint16)


def tokens_per_second(loader, n_batches, B, T):
    next(loader)  # start-up
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(loader)
    dt = time.perf_counter() - t0
    loader.close()  # its background thread must not compete with the next loader's run
    return n_batches * B * (T + 1) / dt


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_mixture", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-B", type=int, default=32)
    parser.add_argument("-T", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=300, help="batches per speed run")
    parser.add_argument("--tokens", type=int, default=40_000_000, help="tokens per bucket")
    args = parser.parse_args(argv)
    B, T = args.B, args.T
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        for i, (name, median) in enumerate([("web", 900), ("code", 120), ("math", 350)]):
            make_bucket(root, name, args.tokens, median, i)
        print(f"wrote 3 buckets of ~{args.tokens:,} tokens in {time.perf_counter() - t0:.1f}s")
        # 40M tokens in all: each bucket holds 40M, so no phase runs a bucket dry
        phases = [{"tokens": 24_000_000, "mix": {"web": 0.6, "code": 0.25, "math": 0.15}},
                  {"tokens": 16_000_000, "mix": {"web": 0.2, "code": 0.5, "math": 0.3}}]
        # allow_budget_mismatch: past the last phase a loader goes on with it instead of stopping
        kw = dict(device="cpu", data_dir=root, rank=0, world_size=1, allow_budget_mismatch=True,
                  bos_token=BOS)
        # plain pretokenized directories to compare with: the web bucket alone, and all three
        # buckets' shards (symlinks: the same files, so the same page cache)
        plain = {"web": os.path.join(root, "plain_web"), "all": os.path.join(root, "plain_all")}
        os.makedirs(plain["web"])
        os.symlink(os.path.join(root, "train", "web"), os.path.join(plain["web"], "train"))
        os.makedirs(os.path.join(plain["all"], "train"))
        for name in ("web", "code", "math"):
            for f in sorted(os.listdir(os.path.join(root, "train", name))):
                # the bucket's name in front: shard_000 of each bucket would collide
                os.symlink(os.path.join(root, "train", name, f),
                           os.path.join(plain["all"], "train", f"{name}_{f}"))
        plain_loader = pretokenized_distributed_data_loader_with_state_bos_bestfit
        runs = {
            "pretokenized loader, web alone": lambda: plain_loader(
                B, T, "train", device="cpu", data_dir=plain["web"], rank=0, world_size=1,
                bos_token=BOS),
            "pretokenized loader, 3 buckets' shards": lambda: plain_loader(
                B, T, "train", device="cpu", data_dir=plain["all"], rank=0, world_size=1,
                bos_token=BOS),
            "mixture loader, web alone": lambda: pretokenized_mixture_loader_with_state_bos_bestfit(
                # 10M tokens, then it goes on (allow_budget_mismatch)
                B, T, "train", [{"tokens": 10_000_000, "mix": {"web": 1}}], **kw),
            "mixture loader, 3 buckets": lambda: pretokenized_mixture_loader_with_state_bos_bestfit(
                B, T, "train", phases, **kw),
        }
        speed = {name: [] for name in runs}
        for _ in range(3):  # alternating rounds, so the machine's drift hits every loader alike
            for name, make in runs.items():
                speed[name].append(tokens_per_second(make(), args.batches, B, T))
        print(f"B={B} T={T}: tokens emitted per second (median of 3 alternating runs of "
              f"{args.batches} batches)")
        for name, values in speed.items():
            # each run against the pretokenized loader on the same shards
            same = "web alone" if "web" in name else "3 buckets' shards"
            base = np.median(speed["pretokenized loader, " + same])
            print(f"  {name:40s} {np.median(values):14,.0f}  {np.median(values) / base:5.2f}x the "
                  "pretokenized loader on the same shards")

        # the realised mix over every 1M-token window of each phase
        loader = pretokenized_mixture_loader_with_state_bos_bestfit(B, T, "train", phases, **kw)
        rows = {1: [], 2: []}
        while True:
            _, _, state = next(loader)
            if state["tokens_done"] > sum(p["tokens"] for p in phases):  # past the curriculum
                break
            rows[state["phase"]] += loader.stats["row_buckets"]
        loader.close()
        window = 1_000_000 // T  # rows in 1M trained tokens
        print(f"realised mix, worst gap over every window of {window} rows = {window * T:,} "
              "tokens:")
        for phase, names in rows.items():
            gaps = []
            for bucket, weight in phases[phase - 1]["mix"].items():
                # prefix sums: every window's count of this bucket in one subtraction
                hits = np.concatenate(([0], np.cumsum([n == bucket for n in names])))
                shares = (hits[window:] - hits[:-window]) / window
                gaps.append((bucket, np.abs(shares - weight).max()))
            print(f"  phase {phase} ({len(names):,} rows): " +
                  ", ".join(f"{b} {g:.2%}" for b, g in gaps) + "  (target <= 1.00%)")


if __name__ == "__main__":
    run(main, "bench_mixture stopped; it only measures, on data in temporary directories: "
              "rerun it")
