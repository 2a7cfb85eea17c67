#!/usr/bin/env bash
# Pretraining that starts while ClimbMix-400B streams in from the hub: only the tokenizer's 8 shards are
# fetched up front; the training loaders fetch every other shard just before they read it (stream=True)
# and keep the shards on disk within a budget. Training does not wait for the dataset (../speedrun.sh
# waits for all 240 shards, ~24 GB, before its loader check), and the disk never holds all of it.
#
#     bash scripts/speedrun.sh                                      # 8 GPUs, everything under ~/.cache/nanochat
#     NPROC=4 NANOCHAT_BASE_DIR=/data/nanochat bash scripts/speedrun.sh
#
# Needs a GPU box and a network. The same recipe offline on a laptop, against a local server, in a few
# seconds: python -m scripts.demo (its step 6); what the link rate does to it: python -m scripts.bench_streaming
set -euo pipefail
cd "$(dirname "$0")/.."

# Everything goes under here: base_data_climbmix/ (shards, and the stream's .stream/), tokenizer/,
# base_checkpoints/
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
mkdir -p "$NANOCHAT_BASE_DIR"
NPROC="${NPROC:-8}"  # GPUs on this node: one training process each

# -----------------------------------------------------------------------------
# Set-up: .venv with the package; the default (CUDA) torch wheel on a GPU box.
NANOCHAT_TORCH="${NANOCHAT_TORCH:-torch}" bash scripts/setup.sh
. .venv/bin/activate

# -----------------------------------------------------------------------------
# Tokenizer: each shard holds ~250M characters, so 8 shards ~= 2B characters, what tok_train reads. The
# val shard (shard_06542) comes with them. The streaming loaders read these 9 from disk and never evict
# them: they evict only shards they fetched themselves.
python -m nanochat.dataset -n 8
python -m scripts.tok_train --max-chars=2000000000 --vocab-size=65536
python -m scripts.tok_eval

# -----------------------------------------------------------------------------
# Pretraining, with the shards streaming in. The loaders read three environment variables (so this
# works unchanged for nanochat's own base_train with our modules copied in; see the README):
#   NANOCHAT_STREAM=1             fetch each shard in the background before it is read, prefetch_shards=2
#                                 ahead, through the downloader (its retries, time bounds and checks). The
#                                 ranks of a node read the same shard at a time (each its own row groups);
#                                 a per-file lock makes one of them download it.
#   NANOCHAT_STREAM_SHARDS=240    the train split: shards 0..239 (~24 GB). Their footers are read first (one
#                                 Range request each, kept in .stream/catalog.json). Keep it the same when
#                                 resuming: the loader state names the files.
#   NANOCHAT_CACHE_LIMIT=20GB     the shards on disk stay under 20 GB: 240 shards do not fit, so shards are
#                                 evicted, never the val shard or one a rank still reads, packs, fetched
#                                 ahead or buffers documents of (those few are copied to .stream/kept first,
#                                 then the shard may go). The least it may be: (2 + 2 + 1) x ~100 MB + the
#                                 9 shards above + a few MB of copies per rank ~= 1.4 GB; less is an error
#                                 at the start.
# Arithmetic: at 8 GPUs a step is 8 x 16 x 2048 = 262,144 tokens, and a shard holds ~250M characters / ~4.8
# per token ~= 52M tokens, so ~200 steps read a shard: 40,000 steps (~10.5B tokens) read ~200 of the 240
# shards (~20 GB; some more, as best-fit packing crops tokens). B=16 as nanochat's d24: the logits alone are
# 16 x 2048 x 65,536 floats = 8.6 GB per GPU. With this tiny model the loaders set the pace, not the GPUs,
# so the link must carry what 8 of them tokenize (a few M tokens/s each: tens of MB/s); `loader wait` in
# the step log stays ~0 while it does.
# The model is our deliberately tiny GPT (scripts/base_train.py: it exercises data, checkpoints and exact
# resume). In a nanochat checkout the same variables go before its own command, e.g.
#   NANOCHAT_STREAM=1 ... torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=24 ...
NANOCHAT_STREAM=1 NANOCHAT_STREAM_SHARDS=240 NANOCHAT_CACHE_LIMIT=20GB \
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_train \
    --B 16 --T 2048 --steps 40000 --eval-every 1000 --save-every 1000 --log-json "$NANOCHAT_BASE_DIR/base_train.json"
# Killed? Run the same line with --resume-from-step S (a saved step): the loaders fetch the shards of the
# documents the state buffered first, then carry on with exactly the batches of the uninterrupted run (with
# another NPROC, base_train merges the saved loader states for the new number of ranks).

DATA_DIR="$NANOCHAT_BASE_DIR/base_data_climbmix"
echo "trained on shards streamed into $DATA_DIR (it holds $(du -sh "$DATA_DIR" | cut -f1) now)"
echo "losses and val bpb: $NANOCHAT_BASE_DIR/base_train.json, checkpoints: $NANOCHAT_BASE_DIR/base_checkpoints"
