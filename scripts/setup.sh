#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the package and its test tools.
#
# torch is pinned in the same pip resolve as everything else, so that no other requirement can swap
# it for another build while pip backtracks. By default that is the CPU build of torch 2.13
# (`torch==2.13.0+cpu`: ~1.7 GB of .venv, Ray's 0.24 GB for the tests included, instead of ~6.2 GB
# with a CUDA build), found among pip's own sources or on PyTorch's CPU index when that answers. On
# a GPU box, set NANOCHAT_TORCH to the torch you want (e.g. NANOCHAT_TORCH=torch). The torch asked
# for is written to .venv/nanochat-torch, and the set-up fails if the installed one is not it
# (tests/test_setup.py checks it again).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# (macOS has no +cpu build: its torch wheels are CPU-only already)
[ "$(uname -s)" = Darwin ] && CPU_TORCH=torch==2.13.0 || CPU_TORCH=torch==2.13.0+cpu
TORCH=${NANOCHAT_TORCH:-$CPU_TORCH}
CPU_INDEX=https://download.pytorch.org/whl/cpu
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
extra=()
# a local version (+cpu) lives on PyTorch's index, not PyPI: ask it only if it answers in 5 s, since
# pip retries an unreachable index for minutes
if [[ "$TORCH" == *+cpu* ]] && python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/', timeout=5)" 2>/dev/null; then
    extra=(--extra-index-url "$CPU_INDEX")
fi
# (${extra[@]+...}: an empty array under set -u, in the bash 3.2 of macOS too)
python -m pip install -q ${extra[@]+"${extra[@]}"} -e ".[dev]" "$TORCH"
echo "$TORCH" > .venv/nanochat-torch
python -m scripts.check_torch .venv/nanochat-torch
