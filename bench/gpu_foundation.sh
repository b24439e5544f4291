#!/usr/bin/env bash
# The foundation's GPU check, in one device call on the H100 machine (issue 2, acceptance 7):
# Llama-3-8B layer shapes with 8 layers (flavor 8B_L8), seq_len 8192, local batch 1, bf16 autocast, sdpa,
# 20 steps; prints median tps, TFLOP/s, MFU and peak memory after 5 warm-up steps.
#
#   device run (carry .whl):  bash bench/gpu_foundation.sh
#
# The machine has torch but not datasets/tomli_w: put their wheels in .whl/ first (README of the device tool):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl datasets dill multiprocess tomli_w
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tessera_bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

run() {  # LABEL ARGS...
  local label=$1; shift
  python3 -m engine.train --config train_configs/debug_model.toml --job.dump_folder "$OUT/$label" \
    --training.steps 20 --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-4 "$@" \
    > "$OUT/$label.log" 2>&1
  local rc=$?
  tail -n 4 "$OUT/$label.log"
  [ $rc = 0 ] && python3 bench/summarize.py "$OUT/$label" --skip 5 || echo "$label: exit $rc"
}

run 8b_l8_bf16_sdpa --model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1
