#!/usr/bin/env bash
# Launch Tessera training.
#   ./run_train.sh [--config FILE] [--section.key value | --section.key=value ...]
# Environment:
#   NGPU      processes on this node (default 1; on a CPU-only machine they use gloo)
#   LOG_RANK  comma-separated ranks whose output is shown (default 0)
#   PYTHON    the interpreter (default: python3 from PATH, e.g. the activated virtual environment)
set -euo pipefail
cd "$(dirname "$0")"

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python3}
DEFAULT_CONFIG=train_configs/debug_model.toml

args=("$@")
has_config=0
for a in "${args[@]+"${args[@]}"}"; do
  case "$a" in --config|--config=*) has_config=1 ;; esac
done
if [ "$has_config" = 0 ]; then
  args=(--config "$DEFAULT_CONFIG" "${args[@]+"${args[@]}"}")
fi

if [ "$NGPU" = 1 ]; then
  # One process: no launcher needed, and user errors print exactly one line.
  exec "$PYTHON" -m engine.train "${args[@]}"
fi

# Several processes: check the configuration once, quietly, so that a user error prints one line and
# no launcher traceback; then launch.
WORLD_SIZE=$NGPU TESSERA_CHECK_ONLY=1 "$PYTHON" -m engine.train "${args[@]}"
exec "$PYTHON" -m torch.distributed.run \
  --nproc_per_node="$NGPU" --rdzv_backend=c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
  -m engine.train "${args[@]}"
