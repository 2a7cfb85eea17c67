#!/usr/bin/env bash
# The checks that need a GPU, in one run from the repo root of a machine that has one:
#
#   bash scripts/gpu_checks.sh NANOCHAT_CHECKOUT WHEEL_DIR
#
# NANOCHAT_CHECKOUT: a karpathy/nanochat checkout (92d63d4; copied, never changed). WHEEL_DIR:
# wheels nanochat needs and the machine lacks (rustbpe), installed into /tmp/site. Our package is
# not installed: the repo root on PYTHONPATH is how `nanochat` imports. Steps: our CUDA tests,
# scripts.bench_step on the GPU, scripts.bench_train_step (nanochat's base_train, three loaders),
# then ours against prebuilt batches with the rank pinned to 1, 4, 8 and all its cores (taskset),
# and scripts.bench_cores' tokens/s table by cores.
# Each step has a timeout, and a failed step does not stop the next; the exit codes come last.
# Environment: PYTHON (default python3); OUT (a folder: each step's log goes to $OUT/<step>.log);
# BENCH_STEP_ARGS, TRAIN_STEP_ARGS, CORES_STEP_ARGS (override the steps' short settings).
set -u
checkout=${1:?usage: bash scripts/gpu_checks.sh NANOCHAT_CHECKOUT WHEEL_DIR}
wheels=${2:?usage: bash scripts/gpu_checks.sh NANOCHAT_CHECKOUT WHEEL_DIR}
checkout=$(cd "$checkout" && pwd) || exit 2  # (absolute: the training runs in copies elsewhere)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || echo "nvidia-smi: none"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'available:', torch.cuda.is_available())"
# (a wheel for another Python is refused: where rustbpe is installed already, that is fine)
if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl \
        || echo "pip install of $wheels failed; going on with the rustbpe $PY has, if any"
else  # no pip: a wheel is a zip of what goes into site-packages
    for wheel in "$wheels"/*.whl; do "$PY" -m zipfile -e "$wheel" /tmp/site; done
fi
export PYTHONPATH=/tmp/site:$PWD

codes=""
step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log it, keep its exit code
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name (timeout ${limit}s): $*"
    local t0=$SECONDS
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
        rc=${PIPESTATUS[0]}
    else
        timeout -k 10 "$limit" "$@" 2>&1
        rc=$?
    fi
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    codes="$codes $name=$rc"
    last_rc=$rc
}

# 0. torch.compile (nanochat's base_train uses it) needs a C compiler and Python's headers for
#    Triton: without them, step 3 compiles with the eager backend (slower steps, the same ratios)
step compile_probe 60 "$PY" -c "import torch; d = 'cuda' if torch.cuda.is_available() else 'cpu'
f = torch.compile(lambda x: (2 * x).sin()); print('torch.compile works on', d, f(torch.ones(8,
device=d)).sum().item())"
backend=""
if [ "$last_rc" != 0 ]; then
    echo "torch.compile failed: step 3 runs base_train with --compile-backend eager"
    backend="--compile-backend eager"
fi

# 1. our tests that take a device: the CUDA-marked ones and the doc recipe that uses device="cuda"
#    (-p no:cacheprovider: nothing written into the repo)
step cuda_tests 60 "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_dataloader.py::test_cuda_batches_match_cpu \
    tests/data/fetch/test_own_shards.py::test_the_recipe_for_your_own_shards_runs_as_written

# 2. the modelled step, every loader yielding on the GPU (without one: refused in a line, exit 2)
step bench_step 210 "$PY" -m scripts.bench_step --device cuda \
    ${BENCH_STEP_ARGS:---pg 30,100 --rounds 1 --steps 30}

# 3. nanochat's own training step at depth 4 with its loader, ours, and prebuilt batches
step bench_train_step 240 "$PY" -m scripts.bench_train_step --checkout "$checkout" \
    --python "$PY" --out /tmp/bench_train_step $backend ${TRAIN_STEP_ARGS:---steps 100}
if [ -n "${OUT:-}" ]; then  # nanochat's own logs, in one file (few files come back from $OUT)
    for log in /tmp/bench_train_step/*/*.log; do
        [ -e "$log" ] && { echo "===== $log"; cat "$log"; } >>"$OUT/train_logs.txt"
    done
fi

# 4. the same step, ours against prebuilt, with the rank pinned to 1, 4, 8 and all of its cores: the
#    loader sizes its tokenizing processes to what it is given (cores less one for the trainer)
all=$(nproc)
for cores in 1 4 8 "$all"; do
    [ "$cores" -gt "$all" ] && continue
    step "train_step_cores_$cores" 200 taskset -c "0-$((cores - 1))" \
        "$PY" -m scripts.bench_train_step \
        --checkout "$checkout" --python "$PY" --out "/tmp/bench_train_step_$cores" \
        --sides ours,prebuilt $backend ${TRAIN_STEP_ARGS:---steps 60}
done

# 5. tokens/s by cores, a consumer that does nothing: the loader against the tokenizer alone
step bench_cores 450 "$PY" -m scripts.bench_cores ${CORES_STEP_ARGS:---cores 1,4,8,$all --rounds 2}

echo "exit codes:$codes"
