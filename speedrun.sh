#!/usr/bin/env bash
# The data side of the nanochat speedrun on a GPU box: ClimbMix-400B shards, a 65536-token BPE
# tokenizer, and a check that the best-fit loader streams packed batches to the GPU.
#
#     bash speedrun.sh                                   # everything under ~/.cache/nanochat
#     NANOCHAT_BASE_DIR=/data/nanochat bash speedrun.sh  # or on a bigger disk
#
# Needs ~25GB of disk (240 + 1 shards of ~100MB) and a network. To try the same stages offline
# on a laptop in a few seconds: python -m scripts.demo
set -euo pipefail
cd "$(dirname "$0")"

# Everything nanochat writes goes under here: base_data_climbmix/ (shards), tokenizer/
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
mkdir -p "$NANOCHAT_BASE_DIR"

# -----------------------------------------------------------------------------
# Set-up: .venv with the package. On a GPU box take the default (CUDA) torch wheel instead of
# the CPU one that setup.sh installs otherwise.
NANOCHAT_TORCH="${NANOCHAT_TORCH:-torch}" bash scripts/setup.sh
. .venv/bin/activate

# -----------------------------------------------------------------------------
# Tokenizer data first: each shard holds ~250M characters (~100MB of zstd parquet), so
# 8 shards ~= 2B characters, what tok_train reads by default. The val shard comes with it.
python -m nanochat.dataset -n 8

# Pretraining data in the background while the tokenizer trains. The d20 model has 561M
# parameters; Chinchilla says 20 tokens per parameter: 561M * 20 ~= 11.2B tokens. At ~4.8
# characters per token that is ~54B characters, and at ~250M characters per shard ~216 shards.
# Round up to 240 for safety (~24GB). Shards 0-7 are already there and are skipped.
python -m nanochat.dataset -n 240 &
DATASET_DOWNLOAD_PID=$!
# if a stage below fails, do not leave the download running on its own
trap 'kill "$DATASET_DOWNLOAD_PID" 2>/dev/null || true' EXIT

# -----------------------------------------------------------------------------
# Tokenizer: 2^16 tokens trained on the first 2B characters (a few minutes on a multi-core node),
# then its compression on train and val (~4.8 bytes/token expected; GPT-2's and GPT-4's for comparison)
python -m scripts.tok_train --max-chars=2000000000 --vocab-size=65536
python -m scripts.tok_eval

# -----------------------------------------------------------------------------
# Wait for the pretraining shards; a failed shard fails the run (rerun this script to resume:
# finished shards are skipped and partial ones continue where they stopped).
if ! wait "$DATASET_DOWNLOAD_PID"; then
    echo "error: the download of 240 shards failed; rerun: python -m nanochat.dataset -n 240" >&2
    exit 1
fi
trap - EXIT

# -----------------------------------------------------------------------------
# Loader check: stream 20 batches of 32 rows x 2048 tokens (~1.3M tokens, a few row groups) of
# BOS-aligned best-fit rows onto the GPU and print what they look like.
python - <<'EOF'
import time
import torch
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.tokenizer import get_tokenizer

tokenizer = get_tokenizer()
bos = tokenizer.get_bos_token_id()
device = "cuda" if torch.cuda.is_available() else "cpu"
B, T, num_batches = 32, 2048, 20
loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer, B, T, "train", device=device)
t0, docs, bos_rows = time.perf_counter(), 0, 0
for step, (inputs, targets, state_dict) in enumerate(loader):
    docs += int((inputs == bos).sum())
    bos_rows += int((inputs[:, 0] == bos).sum())
    if step + 1 == num_batches:
        break
seconds = time.perf_counter() - t0
rows = B * num_batches
print(f"device={device} {num_batches} batches of {B}x{T}: {rows * T / seconds:,.0f} tokens/s, "
      f"{100 * bos_rows / rows:.0f}% rows start with BOS, {docs / rows:.2f} documents per row")
print(f"loader stats: {getattr(loader, 'stats', None)}")
print(f"state_dict: {state_dict}")
loader.close()
EOF
# For throughput in detail (tokenize vs pack vs copy), the loader benchmark:
# python -m scripts.bench_dataloader --data-dir "$NANOCHAT_BASE_DIR/base_data_climbmix" --tokenizer-dir "$NANOCHAT_BASE_DIR/tokenizer"

echo "data ready: $(ls "$NANOCHAT_BASE_DIR/base_data_climbmix"/*.parquet | wc -l) shards in $NANOCHAT_BASE_DIR/base_data_climbmix, tokenizer in $NANOCHAT_BASE_DIR/tokenizer"
