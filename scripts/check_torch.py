"""
Is the torch in this environment the one scripts/setup.sh asked for? Exits 1, naming both, if not.

    python -m scripts.check_torch .venv/nanochat-torch

The file holds the requirement setup.sh installed (`torch==2.13.0+cpu` by default). A pin to a
`+cpu` build also needs a torch with no CUDA: pip once swapped it for a 5.9 GB CUDA build while it
resolved other packages.
"""

import argparse
import sys

import torch
from packaging.requirements import Requirement

from nanochat.data.base.cli import run


def mismatch(requirement: str) -> str | None:
    """What is wrong with the installed torch for this requirement, or None when it is the one."""
    wanted = Requirement(requirement)
    have = torch.__version__
    if wanted.name != "torch":
        return f"expected a requirement on torch, got {requirement!r}"
    if not wanted.specifier.contains(have, prereleases=True):
        return f"setup asked for {requirement} but .venv has torch {have}"
    if "+cpu" in str(wanted.specifier) and torch.version.cuda is not None:
        cuda = torch.version.cuda
        return f"setup asked for {requirement} but .venv's torch {have} is built for CUDA {cuda}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.check_torch",
                                     description="Exit 1 unless the installed torch is the one "
                                                 "scripts/setup.sh asked for.")
    parser.add_argument("chosen", help="the file setup.sh wrote its torch requirement to "
                                       "(.venv/nanochat-torch)")
    args = parser.parse_args(argv)
    with open(args.chosen) as f:
        requirement = f.read().strip()
    problem = mismatch(requirement)
    if problem:
        sys.exit(f"{problem}: remove .venv and rerun bash scripts/setup.sh")
    cuda = torch.version.cuda
    print(f"torch {torch.__version__} (cuda: {cuda}) is the one setup asked for: {requirement}")
    return 0


if __name__ == "__main__":
    run(main, "check_torch stopped; it only reads: rerun it")
