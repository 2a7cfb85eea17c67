"""
Downloads per shard when the ranks of one machine drift apart (stream=True): 3 torchrun ranks
(gloo, CPU) stream shards of 10 row groups from a 127.0.0.1 server into one cache. Rank 0 reads 4
row groups of each shard and ranks 1 and 2 read 3, so ranks 1 and 2 move through the shards
faster; the ranks take each batch together, as DDP training steps do. For each cache_limit (in
largest shards) it prints how far the ranks drifted, the shard visits (each epoch's shard some rank
read), the downloads, and downloads per visit and per distinct shard downloaded (1.00x: none
downloaded twice; shards fetched ahead and not read yet make per visit a little more). About 20 s
a run on 2 cores.

    python -m scripts.bench_drift                       # limits of 10, 30 and 45 shards
    python -m scripts.bench_drift --limits 20 30 45 --runs 3
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.data.base.cli import run
from nanochat.data.base.datasets import get_dataset, index_to_filename
from nanochat.data.fetch.serve import ShardServer

DOCS, ROW_GROUP, CHARS = 40, 4, 20  # per shard: 10 row groups of 4 documents of 20 characters


class Bytes:
    """One token per UTF-8 byte, BOS = 256: the loader's work here is fetching, not tokenizing."""

    def get_bos_token_id(self):
        return 256

    def get_vocab_size(self):
        return 257

    def encode(self, texts, prepend=None, num_threads=1):
        return [[prepend, *text.encode()] if prepend is not None else list(text.encode())
                for text in texts]


def worker(out: str, steps: int) -> None:
    """One rank: streams as the environment says, and writes the shard of each batch it took."""
    import torch.distributed as dist

    from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit

    dist.init_process_group("gloo")
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        Bytes(), B=2, T=32, split="train", device="cpu", buffer_size=8, tokenizer_batch_size=2,
        prefetch=0)
    read = []
    for _ in range(steps):
        dist.barrier()  # (the ranks step together)
        state = next(loader)[2]
        read.append((state["epoch"], state["pq_idx"]))
    loader.close()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(read, f)
    dist.destroy_process_group()


def host(directory: str, num_shards: int) -> int:
    """The train shards and the val shard, as the hub names them; the largest shard's bytes."""
    os.makedirs(directory)
    rng = random.Random(0)
    for name in [index_to_filename(i) for i in range(num_shards)] + [get_dataset().val_filename]:
        texts = ["".join(rng.choice("abcdefgh ") for _ in range(CHARS)) for _ in range(DOCS)]
        pq.write_table(pa.table({"text": texts}), os.path.join(directory, name),
                       row_group_size=ROW_GROUP, compression="zstd")
    return max(os.path.getsize(os.path.join(directory, index_to_filename(i)))
               for i in range(num_shards))


def run_once(tmp: str, server: ShardServer, cache_limit: int, args) -> tuple[int, int, Counter]:
    """One run of 3 ranks: (how far apart the ranks ended, in shards; the shard visits, each
    (epoch, shard) some rank read; downloads per shard)."""
    out = tempfile.mkdtemp(dir=tmp)
    before = len(server.fetched())
    env = dict(os.environ, NANOCHAT_STREAM="1", NANOCHAT_BASE_DIR=tempfile.mkdtemp(dir=tmp),
               NANOCHAT_DATA_URL=server.url, NANOCHAT_STREAM_SHARDS=str(args.shards),
               NANOCHAT_CACHE_LIMIT=str(cache_limit), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "-m", "scripts.bench_drift", "--worker", out, "--steps", str(args.steps)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    ends, visits = [], set()
    for rank in range(3):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            read = [tuple(visit) for visit in json.load(f)]
        ends.append(read[-1][1])
        visits.update(read)
    return max(ends) - min(ends), len(visits), Counter(server.fetched()[before:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_drift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits", type=float, nargs="+", default=[10, 30, 45],
                        help="cache_limit values, in largest shards")
    parser.add_argument("--steps", type=int, default=400, help="batches each rank takes")
    parser.add_argument("--shards", type=int, default=150, help="train shards hosted")
    parser.add_argument("--runs", type=int, default=1, help="runs per cache_limit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # (a rank, under torchrun)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    with tempfile.TemporaryDirectory(prefix="nanochat-bench-drift-") as tmp:
        largest = host(os.path.join(tmp, "hosted"), args.shards)
        server = ShardServer(os.path.join(tmp, "hosted"))
        print(f"3 local ranks, {args.steps} steps, {args.shards} shards of {DOCS // ROW_GROUP} "
              f"row groups (4, 3, 3 per rank), the largest {largest} bytes")
        print("| cache_limit | run | ranks apart at the end | shard visits | downloads | "
              "of shards | per visit | per shard |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        try:
            for limit in args.limits:
                for i in range(args.runs):
                    apart, visits, downloads = run_once(tmp, server, int(limit * largest), args)
                    total = sum(downloads.values())
                    print(f"| {limit:g} shards | {i + 1} | {apart} shards | {visits} | {total} | "
                          f"{len(downloads)} | {total / visits:.2f}x | "
                          f"{total / len(downloads):.2f}x |", flush=True)
        finally:
            server.close()
    return 0


if __name__ == "__main__":
    run(main, "bench_drift stopped; it only measures, on data in temporary directories: "
              "rerun it")
