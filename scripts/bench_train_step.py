"""
What a loader costs a real training step: nanochat's own scripts.base_train (depth 4 by default) run
on a copy of a nanochat checkout (checked at 92d63d4) with nanochat's loader ("orig"), with our
modules copied in ("ours", as scripts/nanochat_dropin.py copies them), and with our modules but the
train batches built once, kept on the device and cycled ("prebuilt": no loader cost). It prints
each side's median and p90 step time `dt` over the steps after the first 10 (compilation, warm-up)
and their ratio to prebuilt. The corpus is nanochat_dropin's prose (about 0.7M characters, so the
loaders loop over it many times); each side runs scripts.tok_train once. Speed is a measurement.

    python -m scripts.bench_train_step --checkout ~/nanochat --python ~/nanochat/.venv/bin/python
    python -m scripts.bench_train_step --checkout ~/nanochat --depth 2 --B 4 --T 128 --steps 12 \
        --device-type=cpu --head-dim=64 --window-pattern=L     # on CPU, about a minute per side

Arguments it does not know go to base_train as they are (after its own flags: they win).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from nanochat.data.base.cli import run
from scripts.nanochat_dropin import REPO, drop_in, write_layout

SIDES = ("orig", "ours", "prebuilt")
# nanochat's step line: "step 00012/00100 (12.00%) | loss: 7.1 | lrm: 1.00 | dt: 35.12ms | ..."
STEP = re.compile(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms", re.M)
# the import base_train makes its loaders with; the prebuilt side redirects it to PREBUILT
IMPORT = "from nanochat.dataloader import "
PREBUILT = '''"""bench_train_step's prebuilt side: the train loader's first K batches, built by our
loader, cloned (its tensors are views of a buffer that the next batch overwrites), then cycled
forever, so that a training step pays no loader cost at all. Val batches: our loader's, as they are.
"""
from nanochat.dataloader import tokenizing_distributed_data_loader_bos_bestfit  # noqa: F401
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit as ours

K = 20


def tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, **kwargs):
    loader = ours(*args, **kwargs)
    if kwargs.get("split", args[3] if len(args) > 3 else None) != "train":
        return loader
    batches = [(x.clone(), y.clone(), dict(state)) for x, y, state in
               (next(loader) for _ in range(K))]
    loader.close()  # (its worker would otherwise keep preparing batches nobody takes)

    def cycle():
        while True:
            yield from batches
    return cycle()
'''
# base_train with every torch.compile on another backend ("eager": no code generation, so no C
# compiler): nanochat's fused optimizer steps compile with fullgraph=True, which fails when
# compilation is disabled (TORCH_COMPILE_DISABLE=1) instead
WITH_BACKEND = """import runpy, sys, torch
compile, backend = torch.compile, sys.argv.pop(1)
torch.compile = lambda *args, **kwargs: compile(*args, **kwargs | {"backend": backend})
runpy.run_module("scripts.base_train", run_name="__main__", alter_sys=True)
"""


def copy_checkout(checkout: str, src: str, side: str) -> None:
    """The checkout copied to src (it is never changed), our modules in it for ours and prebuilt."""
    shutil.copytree(checkout, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__"))
    if side == "orig":
        return
    drop_in(os.path.join(src, "nanochat"))
    if side == "prebuilt":
        with open(os.path.join(src, "nanochat", "prebuilt_batches.py"), "w") as f:
            f.write(PREBUILT)
        path = os.path.join(src, "scripts", "base_train.py")
        with open(path) as f:
            code = f.read()
        if code.count(IMPORT) != 1:
            raise ValueError(f"{path} should import its loaders in one line '{IMPORT}...'; "
                             "this nanochat differs from 92d63d4: update IMPORT")
        with open(path, "w") as f:
            f.write(code.replace(IMPORT, "from nanochat.prebuilt_batches import "))


def side_env(root: str, src: str, python: str) -> dict:
    """The environment a side's scripts run in: its copy first on the path, our repo off it (our
    scripts/ is a package and would shadow nanochat's, a namespace package), and an empty wandb
    module where `python` has none: base_train imports wandb, and with --run=dummy (the default)
    never calls it."""
    path = [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if p and os.path.realpath(p) != os.path.realpath(REPO)]
    if subprocess.run([python, "-c", "import wandb"], capture_output=True).returncode != 0:
        stub = os.path.join(root, "stub")
        os.makedirs(stub, exist_ok=True)
        open(os.path.join(stub, "wandb.py"), "w").close()
        path.append(stub)
    env = dict(os.environ, NANOCHAT_BASE_DIR=os.path.join(root, "base"),
               PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    env.pop("NANOCHAT_DATASET", None)  # the layout's shards are the dataset
    return env


def run_command(python: str, args: list, src: str, env: dict, log: str) -> str:
    """One nanochat script in a side's copy; its output (written to log as it comes, so a run
    stopped from outside leaves it). Raises when it fails."""
    with open(log, "w") as f:
        returncode = subprocess.run([python, *args], cwd=src, env=env, stdout=f,
                                    stderr=subprocess.STDOUT).returncode
    with open(log) as f:
        output = f.read()
    if returncode != 0:
        tail = "\n".join(output.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(args[:2])} exited {returncode} (log {log}):\n{tail}")
    return output


def run_side(side: str, args, extra: list, tokenizer_dir: str | None) -> dict:
    """Copy, shards, tokenizer (trained here, or copied from the side that trained it), training."""
    root = os.path.join(args.out, side)
    shutil.rmtree(root, ignore_errors=True)
    src = os.path.join(root, "nanochat")
    copy_checkout(args.checkout, src, side)
    write_layout(os.path.join(root, "base"), "climbmix")
    env = side_env(root, src, args.python)
    t0 = time.time()
    if tokenizer_dir:
        shutil.copytree(tokenizer_dir, os.path.join(root, "base", "tokenizer"))
    else:
        run_command(args.python, ["-m", "scripts.tok_train", "--max-chars=3000000"], src, env,
            os.path.join(root, "tok_train.log"))
    t1 = time.time()
    flags = [f"--depth={args.depth}", f"--max-seq-len={args.T}",
             f"--device-batch-size={args.B}", f"--total-batch-size={args.B * args.T}",
             f"--num-iterations={args.steps}", f"--warmup-steps={max(1, args.steps // 10)}",
             # no evaluation, sampling or checkpoint along the way (one checkpoint at the end)
             "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--save-every=-1"]
    launch = (["-c", WITH_BACKEND, args.compile_backend] if args.compile_backend
              else ["-m", "scripts.base_train"])
    log = run_command(args.python, [*launch, *flags, *extra], src, env,
              os.path.join(root, "base_train.log"))
    steps = [(int(step), float(dt)) for step, dt in STEP.findall(log)]
    dts = np.array([dt for step, dt in steps if step >= 10])  # (0-9: compilation, warm-up)
    if dts.size == 0:
        raise RuntimeError(f"{side}: no step line after step 9 in {root}/base_train.log")
    loss = [line for line in log.splitlines() if STEP.match(line)][-1]
    result = {"steps": dts.size, "median": float(np.median(dts)),
              "p90": float(np.percentile(dts, 90)), "last": loss,
              "tokenizer": os.path.join(root, "base", "tokenizer")}
    print(f"  {side}: tokenizer {t1 - t0:.0f} s, base_train {time.time() - t1:.0f} s, "
          f"median dt {result['median']:.2f} ms over {dts.size} steps", flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_train_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True,
                        help="a karpathy/nanochat checkout (left unchanged: it is copied)")
    parser.add_argument("--python", default=sys.executable,
                        help="a Python with nanochat's dependencies (wandb may be missing)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per side")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--B", type=int, default=32, help="device batch size (rows)")
    parser.add_argument("--T", type=int, default=2048, help="sequence length")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_train_step"),
                        help="where the copies and their logs go (default: %(default)s)")
    parser.add_argument("--sides", default=",".join(SIDES), help="default: %(default)s")
    parser.add_argument("--compile-backend",
                        help="run base_train's torch.compile calls with this backend (eager: "
                             "where Triton cannot build, for want of a C compiler)")
    args, extra = parser.parse_known_args(argv)
    args.out, args.checkout = os.path.abspath(args.out), os.path.abspath(args.checkout)
    sides = args.sides.split(",")
    if not set(sides) <= set(SIDES):
        parser.error(f"--sides takes some of {','.join(SIDES)}, got {args.sides!r}")
    if not os.path.isfile(os.path.join(args.checkout, "scripts", "base_train.py")):
        parser.error(f"{args.checkout} is not a nanochat checkout (no scripts/base_train.py)")
    if args.steps <= 10:
        parser.error(f"--steps must be over 10 (the first 10 are not measured), got {args.steps}")
    print(f"bench_train_step: depth={args.depth} B={args.B} T={args.T} steps={args.steps} "
          f"sides={args.sides} compile_backend={args.compile_backend} base_train extra={extra} "
          f"python={args.python} out={args.out}", flush=True)
    results, failed, tokenizer_dir = {}, [], None
    for side in sides:
        try:
            results[side] = run_side(side, args, extra, tokenizer_dir)
        except (RuntimeError, ValueError) as e:  # (the other sides still run and report)
            print(f"  {side} FAILED: {e}", flush=True)
            failed.append(side)
            continue
        tokenizer_dir = tokenizer_dir or results[side]["tokenizer"]  # (same shards, same one)
    base = results.get("prebuilt", {}).get("median")
    print("\n| side | steps | median dt ms | p90 dt ms | / prebuilt |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for side, r in results.items():
        ratio = f"{r['median'] / base:.3f}" if base else "-"
        print(f"| {side} | {r['steps']} | {r['median']:.2f} | {r['p90']:.2f} | {ratio} |")
    for side, r in results.items():
        print(f"{side}: {r['last']}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    run(main, "bench_train_step stopped; it changes only its copies of the checkout, under --out: "
              "rerun it (it copies afresh)")
