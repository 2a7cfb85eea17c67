"""
Check that our modules drop into a nanochat checkout: nanochat's own scripts run unchanged on them,
and give what nanochat's own modules give. Needs a checkout of karpathy/nanochat (checked at
92d63d4) and a Python with nanochat's dependencies (torch, wandb, psutil, pyarrow, rustbpe,
tiktoken, filelock, pyyaml, pytest). Offline, on CPU, about 1.5 minutes per layout on 2 cores:

    python -m scripts.nanochat_dropin ~/nanochat --python ~/nanochat/.venv/bin/python

Each side ("orig": the checkout as it is; "ours": with the README's one `cp -r` of nanochat's three
files and nanochat/data into it) gets the same shards of English prose and runs scripts.tok_train,
tests/test_tokenizer.py, scripts.base_train (a tiny CPU model), scripts.base_eval --eval bpb and
base_train --resume-from-step. Then the sides are compared: tokenizer tables, token_bytes.pt, the
first batches and state keys of both splits, every loss and val bpb before the resume. Layouts
(--layout): climbmix (shards 0-7 + val 6542), fineweb (0-7 + val 1822), own (nine shards: the last
is val).
"""

import argparse
import importlib
import inspect
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nanochat.data.base.cli import run
from nanochat.tokenizer import RustBPETokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a user copies into a nanochat checkout, the README's one line: `cp -r` of these, each under
# nanochat/, into NANOCHAT/nanochat/ (nanochat's own common.py stays)
DROP_IN = ("dataloader.py", "dataset.py", "tokenizer.py", "data")
# modules whose docstrings are long English prose, importable without side effects
PROSE_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
                 "dataclasses", "datetime", "decimal", "email", "enum", "fractions", "functools",
                 "http.server", "inspect", "json", "logging", "multiprocessing", "os", "pathlib",
                 "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics",
                 "string", "subprocess", "tarfile", "textwrap", "threading", "unittest",
                 "urllib.request", "zipfile")
# nanochat's base_train at its smallest: 12 steps, a checkpoint at step 6 to resume from
TINY = ["--depth=2", "--head-dim=64", "--window-pattern=L", "--max-seq-len=128",
        "--device-batch-size=4", "--total-batch-size=1024", "--num-iterations=12", "--eval-every=6",
        "--eval-tokens=4096", "--core-metric-every=-1", "--sample-every=-1", "--save-every=6",
        "--warmup-steps=2"]
# the line that says how a step went
STEP_LINE = r"step \d+/\d+ \S+ \| loss: [\d.]+"
RESULT_LINES = {"tok_train": r"Saved token_bytes to \S+", "test_tokenizer": r"\d+ passed.*",
                "base_train": STEP_LINE, "base_train_resume": STEP_LINE,
                "base_eval": r"val bpb: [\d.]+", "batches": r"^$"}
BATCHES = """
import sys, torch
from nanochat.tokenizer import get_tokenizer
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit as loader
tokenizer, out = get_tokenizer(), {}
for split, n in (("train", 60), ("val", 10)):
    batches = loader(tokenizer, 4, 128, split, device="cpu")
    # x, y are views of one buffer that the next batch overwrites: each is copied before the next
    out[split] = [(x.tolist(), y.tolist(), [s["pq_idx"], s["rg_idx"], s["epoch"]]) for x, y, s in
                  (next(batches) for _ in range(n))]
torch.save(out, sys.argv[1])
"""


def drop_in(package: str) -> None:
    """Our drop-in copied into a checkout's nanochat/ folder, as the README's `cp -r` does."""
    subprocess.run(["cp", "-r", *(os.path.join(REPO, "nanochat", name) for name in DROP_IN),
                    package], check=True)


def prose_documents() -> list[str]:
    """Real English prose, offline and deterministic."""
    from pydoc_data.topics import topics
    docs = set(topics.values())
    for name in PROSE_MODULES:
        module = importlib.import_module(name)
        for obj in [module] + list(vars(module).values()):
            if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    docs.add(doc)
    docs = sorted(docs)  # a set of str has another order in every process (salted hashes)
    random.Random(0).shuffle(docs)  # neighbouring docstrings come from one module: spread them
    return docs


def write_layout(base_dir: str, layout: str) -> None:
    docs = prose_documents()
    chunks = [docs[i::9] for i in range(9)]  # nine shards: eight train and one val
    subdir, indices = {"climbmix": ("base_data_climbmix", list(range(8)) + [6542]),
                       "fineweb": ("base_data", list(range(8)) + [1822]),
                       "own": ("base_data_climbmix", list(range(9)))}[layout]
    os.makedirs(os.path.join(base_dir, subdir))
    for index, texts in zip(indices, chunks):
        table = pa.table({"text": pa.array(texts, type=pa.string())})
        # row groups of 64: several per shard, so the loaders' row-group walk is exercised
        pq.write_table(table, os.path.join(base_dir, subdir, f"shard_{index:05d}.parquet"),
                       row_group_size=64)


def run_side(side: str, checkout: str, out: str, layout: str, python: str) -> dict:
    root = os.path.join(out, f"{layout}-{side}")
    shutil.rmtree(root, ignore_errors=True)
    src = os.path.join(root, "nanochat")
    # a copy: the user's checkout is never changed
    shutil.copytree(checkout, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__"))
    if side == "ours":
        drop_in(os.path.join(src, "nanochat"))
    base_dir = os.path.join(root, "base")
    write_layout(base_dir, layout)
    env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, PYTHONPATH=src)
    env.pop("NANOCHAT_DATASET", None)  # each side must find the layout's dataset by itself
    results = {"root": root, "base": base_dir}
    steps = [("tok_train", ["-m", "scripts.tok_train", "--max-chars=3000000", "--vocab-size=4096"]),
             ("test_tokenizer", ["-m", "pytest", "tests/test_tokenizer.py", "-q", "-p",
                                 "no:cacheprovider"]),
             ("batches", ["-c", BATCHES, os.path.join(root, "batches.pt")]),
             ("base_train", ["-m", "scripts.base_train", *TINY]),
             ("base_eval", ["-m", "scripts.base_eval", "--eval", "bpb", "--device-batch-size=4",
                            "--split-tokens=4096"]),
             ("base_train_resume", ["-m", "scripts.base_train", *TINY, "--resume-from-step=6"])]
    for name, args in steps:
        done = subprocess.run([python, *args], cwd=src, env=env, capture_output=True, text=True)
        log = done.stdout + done.stderr
        with open(os.path.join(root, f"{name}.log"), "w") as f:
            f.write(log)
        results[name] = (done.returncode, log)
        found = re.findall(RESULT_LINES.get(name, r"(?m)^.+$"), log)  # else: the last line
        print(f"  {side:4} {name:18} exit {done.returncode}  {found[-1][:100] if found else ''}")
    return results


def losses(log: str) -> list:
    """(step, loss, "epoch pq: N rg: N") of every step line of nanochat's base_train."""
    return re.findall(r"step (\d+)/\d+ \([^)]*\) \| loss: ([\d.]+) \|.*?\| "
                      r"epoch: (\S+ pq: \d+ rg: \d+)", log)


def compare(orig: dict, ours: dict) -> bool:
    def tables(base):
        # json or pickle, never run
        tokenizer = RustBPETokenizer.from_directory(os.path.join(base, "tokenizer"))
        return tokenizer.mergeable_ranks, tokenizer.special_tokens, tokenizer.pattern
    checks = [("tokenizer merges, special tokens, pattern", tables(orig["base"]),
               tables(ours["base"]))]
    pt = [torch.load(os.path.join(r["base"], "tokenizer", "token_bytes.pt")).tolist()
          for r in (orig, ours)]
    checks.append(("token_bytes.pt", *pt))
    a, b = (torch.load(os.path.join(r["root"], "batches.pt")) for r in (orig, ours))
    for split in ("train", "val"):
        checks.append((f"{split}: {len(a[split])} batches and nanochat's keys of their states",
                       a[split], b[split]))
    checks.append(("base_train: every loss and state's nanochat keys",
                   *(losses(r["base_train"][1]) for r in (orig, ours))))
    bpb = [re.findall(r"Validation bpb: ([\d.]+)", r["base_train"][1]) for r in (orig, ours)]
    checks.append((f"base_train: val bpb {bpb[0]}", *bpb))
    evals = [re.findall(r"(\w+) bpb: ([\d.]+)", r["base_eval"][1]) for r in (orig, ours)]
    checks.append((f"base_eval: {evals[0]}", *evals))
    for name, x, y in checks:
        print(f"  {'same' if x == y else 'DIFFERENT'}: {name}")
    return all(x == y for _, x, y in checks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.nanochat_dropin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout",
                        help="a karpathy/nanochat checkout (left unchanged: it is copied)")
    parser.add_argument("--python", default=sys.executable,
                        help="a Python with nanochat's dependencies")
    parser.add_argument("--layout", choices=("climbmix", "fineweb", "own"), default="climbmix",
                        help="the shards' names: a dataset's, or your own (default: climbmix)")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "nanochat_dropin"),
                        help="where the two copies and their logs go (default: %(default)s)")
    args = parser.parse_args(argv)
    # (absolute: the scripts run in the copies, not here)
    args.out, args.checkout = os.path.abspath(args.out), os.path.abspath(args.checkout)
    print(f"checkout={args.checkout} python={args.python} layout={args.layout} out={args.out}")
    if not os.path.isfile(os.path.join(args.checkout, "scripts", "base_train.py")):
        parser.error(f"{args.checkout} is not a nanochat checkout (no scripts/base_train.py)")
    sides = {side: run_side(side, args.checkout, args.out, args.layout, args.python)
             for side in ("orig", "ours")}
    # the steps' results are (exit code, log) tuples; "root" and "base" are paths
    failed = [f"{side} {name}" for side, r in sides.items() for name, v in r.items()
              if isinstance(v, tuple) and v[0] != 0]
    same = compare(sides["orig"], sides["ours"])
    print(f"{'all runs passed' if not failed else 'failed: ' + ', '.join(failed)}; "
          f"{'identical before the resume' if same else 'the sides differ'}")
    return 0 if same and not failed else 1


if __name__ == "__main__":
    run(main, "nanochat_dropin stopped; it changes only its copies of the checkout, under --out: "
              "rerun it (it copies afresh)")
