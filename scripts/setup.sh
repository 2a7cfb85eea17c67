#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the package and its test tools.
# The CPU build of torch is installed first, so that pip never pulls a multi-GB CUDA build on a
# CPU-only machine; on a GPU box, set NANOCHAT_TORCH to the torch you want (e.g. "torch").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${NANOCHAT_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[dev]"
