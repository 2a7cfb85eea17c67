"""
Measure the main path a reader follows: run the public best-fit loader on a few tiny shards up to
its third batch, trace which functions of the package run, and print, per module, the functions and
their lines; then what `import nanochat.dataloader` loads, and the path's size in this process
(workers=0, prefetch=0: everything in the caller) and with the worker process (the defaults:
workers=1, prefetch=4). What it prints is what docs/ARCHITECTURE.md's walk covers (~15 s on 2
cores):

    python -m scripts.main_path [--stream]
    python -m scripts.main_path --sizes   # every module's lines, the longest functions

--stream serves the shards from a local server (nanochat/data/fetch/serve.py) and streams them
(stream=True), so the shard cache joins the path. The tokenizer is a byte-level stand-in. The worker
process is traced by a sitecustomize.py this script writes into a temporary folder on the worker's
import path: it traces the worker and writes what ran when the worker ends.
"""

import argparse
import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading

import pyarrow as pa
import pyarrow.parquet as pq

import nanochat
from nanochat.data.base.cli import run
from nanochat.data.fetch.serve import ShardServer
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit

PACKAGE = os.path.dirname(os.path.abspath(nanochat.__file__))
# the rooms docs/ARCHITECTURE.md walks (tests/test_architecture.py's MAIN_PATH and STREAMING); the
# other modules the run touches are asides: the integer check, file listing, the state's format,
# the worker process, the downloader
ROOMS = ("dataloader.py", "build.py", "order.py", "rows.py", "packing.py", "prefetch.py",
         "cache.py")
# the worker's tracer: on its import path, Python runs it as the interpreter starts. The worker
# ends by os._exit, which runs no exit hook: the tracer writes what ran just before it
BOOTSTRAP = '''
import json, os, sys, threading
PACKAGE, OUT = os.environ["MAIN_PATH_PACKAGE"], os.environ["MAIN_PATH_OUT"]
ran, lock, exit_now = {}, threading.Lock(), os._exit

def tracer(frame, event, arg):  # (functions only: not a module's or a class's body, on import)
    if frame.f_code.co_filename.startswith(PACKAGE) and frame.f_code.co_flags & 1:
        ran.setdefault(frame.f_code.co_filename, set()).add(frame.f_lineno)
        return tracer
    return None

def write_then_exit(code):
    sys.settrace(None)
    with lock:
        for _ in range(10):  # (another thread may add a line while this one copies)
            try:
                copied = {path: sorted(list(lines)) for path, lines in list(ran.items())}
                break
            except RuntimeError:
                continue
        with open(OUT, "w") as f:
            json.dump(copied, f)
        exit_now(code)

os._exit = write_then_exit
threading.settrace(tracer)
sys.settrace(tracer)
'''


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


def trace(stream: bool, workers: int, tmp: str) -> dict[str, set[int]]:
    """Lines of the package executed while a fresh loader yields three batches, by file: in this
    process (prefetch=0: no thread), and with workers=1 (prefetch=4) in the worker process too."""
    ran: dict[str, set[int]] = {}

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        # functions only: a module's or a class's body runs on import (CO_OPTIMIZED: a function)
        if path.startswith(PACKAGE) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            ran.setdefault(path, set()).add(frame.f_lineno)
            return tracer
        return None

    hosted = os.path.join(tmp, "hosted")
    os.makedirs(hosted, exist_ok=True)
    write_shards(hosted)
    options = dict(data_dir=hosted)
    server = None
    if stream:  # the shards come from a local server into an empty cache
        server = ShardServer(hosted)
        options = dict(data_dir=os.path.join(tmp, f"cache{workers}"), stream=True, num_shards=2,
                       base_url=server.url)
    out = os.path.join(tmp, "worker.json")
    os.environ.update(MAIN_PATH_PACKAGE=PACKAGE, MAIN_PATH_OUT=out)
    threading.settrace(tracer)  # the loader's threads are traced too
    sys.settrace(tracer)
    # (the class under this module's name, not __main__'s: the worker unpickles it by that name)
    tokenizer = importlib.import_module("scripts.main_path").ByteTokenizer()
    try:
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, 2, 32, "train", device="cpu", buffer_size=8,
            tokenizer_batch_size=4, rank=0, world_size=1, workers=workers,
            prefetch=4 if workers else 0, **options)
        for _ in range(3):
            next(loader)
        loader.close()
    finally:
        sys.settrace(None)
        threading.settrace(None)
        if server is not None:
            server.close()
    if workers:
        with open(out, encoding="utf-8") as f:  # (written as the worker ended)
            for path, lines in json.load(f).items():
                ran.setdefault(path, set()).update(lines)
    return ran


def read(ran: dict[str, set[int]]) -> dict[str, tuple[int, list[str]]]:
    """Per file where a function ran: the lines of the functions that ran (a function inside
    another that ran is read with it), and their names."""
    found = {}
    for path in sorted(ran, key=lambda p: min(ran[p])):
        hit = [(name, first, last) for name, first, last in functions(path)
               if any(first <= line <= last for line in ran[path])]
        outer = [f for f in hit if not any(o[1] < f[1] and f[2] <= o[2] for o in hit)]
        if outer:  # (a module whose body alone ran, on import, runs nothing of the path)
            found[path] = (sum(last - first + 1 for _, first, last in outer),
                           [name for name, _, _ in outer])
    return found


def executed(ran: dict[str, set[int]], read_here: dict) -> int:
    """Distinct lines executed inside the functions that ran."""
    total = 0
    for path in read_here:
        spans = functions(path)
        total += sum(1 for line in ran[path] if any(a < line <= b for _, a, b in spans))
    return total


def imported() -> tuple[int, int]:
    """(modules of ours, their lines) that `import nanochat.dataloader` loads, in a fresh
    interpreter."""
    code = ("import json, sys, nanochat.dataloader; print(json.dumps([m.__file__ for name, m in "
            "list(sys.modules.items()) if name.split('.')[0] == 'nanochat' "
            "and getattr(m, '__file__', None)]))")
    files = json.loads(subprocess.run([sys.executable, "-c", code], check=True, text=True,
                                      capture_output=True).stdout)
    lines = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            lines += sum(1 for _ in f)
    return len(files), lines


def sizes(longest: int = 5) -> None:
    """Every module of ours with its lines, longest first, then the longest functions."""
    package = os.path.dirname(PACKAGE)
    modules, spans = [], []
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    modules.append((sum(1 for _ in f), os.path.relpath(path, package)))
                spans += [(last - first + 1, f"{os.path.relpath(path, package)}:{first} {qual}")
                          for qual, first, last in functions(path)]
    for lines, path in sorted(modules, reverse=True):
        print(f"{lines:5d}  {path}")
    print(f"{sum(n for n, _ in modules):,} lines in {len(modules)} files")
    for lines, name in sorted(spans, reverse=True)[:longest]:
        print(f"longest function: {lines} lines  {name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.main_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", action="store_true", help="stream the shards (stream=True)")
    parser.add_argument("--sizes", action="store_true",
                        help="print every module's lines and the longest functions, then stop")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        here = trace(args.stream, 0, tmp)
        bootstrap = os.path.join(tmp, "bootstrap")
        os.makedirs(bootstrap)
        with open(os.path.join(bootstrap, "sitecustomize.py"), "w", encoding="utf-8") as f:
            f.write(BOOTSTRAP)
        sys.path.insert(0, bootstrap)  # (the worker's import path is this process's)
        try:
            worker = trace(args.stream, 1, tmp)
        finally:
            sys.path.remove(bootstrap)
    read_here, read_worker = read(here), read(worker)
    rooms = 0
    for path, (lines, names) in read_here.items():
        room = os.path.basename(path) in ROOMS
        rooms += lines if room else 0
        kind = "room " if room else "aside"
        print(f"{os.path.basename(path):16} {lines:5d} lines  {kind}  {', '.join(names)}")
    print(f"{'the rooms':16} {rooms:5d} lines")
    modules, lines = imported()
    print(f"import nanochat.dataloader: {modules} modules of ours, {lines:,} lines")
    counts = [f"{len(r)} modules, {sum(n for n, _ in r.values()):,} lines read "
              f"({executed(t, r):,} executed)" for t, r in ((here, read_here),
                                                            (worker, read_worker))]
    print(f"main path: {counts[0]} (in-process, prefetch=0); worker: {counts[1]} "
          "(both processes, the defaults)")
    extra = sorted(os.path.basename(p) for p in set(read_worker) - set(read_here))
    print(f"the worker adds: {', '.join(extra) or 'nothing'}")
    return 0


if __name__ == "__main__":
    run(main, "main_path stopped; it only traces a loader, on data in a temporary directory: "
              "rerun it")
