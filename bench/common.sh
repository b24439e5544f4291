# Shared set-up of the GPU bench scripts (sourced, not run): installs the carried wheels of .whl/ (packages
# the device machine lacks) into /tmp/site, puts the repository on PYTHONPATH, prints the GPU and torch,
# and defines run LABEL ARGS...: a 20-step debug-config run with ARGS, summarized after 5 warm-up steps.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
  tail -n 3 "$OUT/$label.log"
  [ $rc = 0 ] && python3 bench/summarize.py "$OUT/$label" --skip 5 || echo "$label: exit $rc"
}
