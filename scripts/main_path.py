"""
Measure the main path a reader follows: run the public best-fit loader on a few tiny shards for a
few batches, trace which functions of the package run, and print, per module, the functions and
their lines. What it prints is what docs/ARCHITECTURE.md's walk covers (~2 s on 2 cores):

    python -m scripts.main_path [--stream]

--stream serves the shards from a local server (nanochat/data/fetch/serve.py) and streams them
(stream=True), so the shard cache joins the path. The tokenizer is a byte-level stand-in. The
loader runs in this process (workers=0), where a tracer sees it: by default a worker process runs
the same functions, and prefetch.py's WorkerBatches and worker_main carry its batches across.
"""

import argparse
import ast
import os
import sys
import tempfile
import threading

import pyarrow as pa
import pyarrow.parquet as pq

import nanochat
from nanochat.data.base.cli import run
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.fetch.serve import ShardServer

PACKAGE = os.path.dirname(os.path.abspath(nanochat.__file__))
# the rooms docs/ARCHITECTURE.md walks (tests/test_architecture.py's MAIN_PATH and STREAMING); the
# other modules the run touches are asides: argument checks, file listing, the downloader
ROOMS = ("dataloader.py", "order.py", "rows.py", "packing.py", "state.py", "prefetch.py",
         "cache.py")


class ByteTokenizer:
    """Bytes + 1, BOS 0: the smallest tokenizer with the loader's interface."""

    def get_bos_token_id(self) -> int:
        return 0

    def get_vocab_size(self) -> int:
        return 257

    def encode(self, texts, prepend=None, num_threads=0):
        return [[prepend] + [b + 1 for b in text.encode()] for text in texts]


def write_shards(directory: str) -> None:
    """Two train shards and the val shard, 4 row groups each, under the hub's names."""
    for i in (0, 1, 6542):  # 6542: the hosted dataset's val shard
        texts = [f"document {i}-{j} " * (1 + j % 7) for j in range(64)]
        path = os.path.join(directory, f"shard_{i:05d}.parquet")
        pq.write_table(pa.table({"text": texts}), path, row_group_size=16)


def functions(path: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, last line) of every function in a file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found.append((name, child.lineno, child.end_lineno))
                visit(child, name + ".")
    visit(tree, "")
    return found


def trace(stream: bool) -> dict[str, set[int]]:
    """Lines of the package executed while a fresh loader yields three batches, by file."""
    ran: dict[str, set[int]] = {}

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            ran.setdefault(path, set()).add(frame.f_lineno)
            return tracer
        return None

    with tempfile.TemporaryDirectory() as tmp:
        hosted = os.path.join(tmp, "hosted")
        os.makedirs(hosted)
        write_shards(hosted)
        options = dict(data_dir=hosted)
        server = None
        if stream:  # the shards come from a local server into an empty cache
            server = ShardServer(hosted)
            options = dict(data_dir=os.path.join(tmp, "cache"), stream=True, num_shards=2,
                           base_url=server.url)
        threading.settrace(tracer)  # the loader's threads are traced too
        sys.settrace(tracer)
        try:
            loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
                ByteTokenizer(), 2, 32, "train", device="cpu", buffer_size=8,
                tokenizer_batch_size=4, rank=0, world_size=1, workers=0, **options)
            for _ in range(3):
                next(loader)
            loader.close()
        finally:
            sys.settrace(None)
            threading.settrace(None)
            if server is not None:
                server.close()
    return ran


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.main_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", action="store_true", help="stream the shards (stream=True)")
    args = parser.parse_args(argv)
    ran = trace(args.stream)
    total = rooms = 0
    for path in sorted(ran, key=lambda p: min(ran[p])):
        hit = [(name, first, last) for name, first, last in functions(path)
               if any(first <= line <= last for line in ran[path])]
        # a function inside another that ran is read with it: count the outermost only
        outer = [f for f in hit if not any(o[1] < f[1] and f[2] <= o[2] for o in hit)]
        lines = sum(last - first + 1 for _, first, last in outer)
        total += lines
        room = os.path.basename(path) in ROOMS
        rooms += lines if room else 0
        names = ", ".join(name for name, _, _ in outer)
        kind = "room " if room else "aside"
        print(f"{os.path.basename(path):16} {lines:5d} lines  {kind}  {names}")
    print(f"{'the rooms':16} {rooms:5d} lines")
    print(f"{'in all':16} {total:5d} lines in {len(ran)} modules")
    return 0


if __name__ == "__main__":
    run(main, "main_path stopped; it only traces a loader, on data in a temporary directory: "
              "rerun it")
