#!/usr/bin/env bash
# Launch Tessera training.
#   ./run_train.sh [--config FILE] [--section.key value | --section.key=value ...]
# Environment:
#   NGPU      processes on this node (default 1; on a CPU-only machine they use gloo)
#   LOG_RANK  comma-separated ranks whose output is shown (default 0)
#   PYTHON    the interpreter (default: python3 from PATH, e.g. the activated virtual environment)
#   DRY_RUN=1 build for NGPU simulated ranks on the fake backend and meta device, print the mesh and the
#             per-rank memory, train nothing (engine/tools/dry_run.py)
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

if [ "${DRY_RUN:-0}" = 1 ]; then
  # Dry run: the real build path for NGPU simulated ranks in this one process (fake process group, meta
  # device): validation, mesh, parallel plan, per-rank memory table. GPU_MEMORY_GIB: memory per GPU (80).
  WORLD_SIZE=$NGPU exec "$PYTHON" -m engine.tools.dry_run "${args[@]}"
fi

if [ "$NGPU" = 1 ]; then
  # One process: no launcher needed, and user errors print exactly one line.
  exec "$PYTHON" -m engine.train "${args[@]}"
fi

# Several processes: check the configuration once, quietly, so that a user error prints one line and
# no launcher traceback; then launch.
WORLD_SIZE=$NGPU TESSERA_CHECK_ONLY=1 "$PYTHON" -m engine.train "${args[@]}"
# SIGTERM (SLURM preemption, or a user's kill) goes straight to the training processes, which save a
# checkpoint at the next step boundary and exit 0 (checkpoint.enable); torchrun then exits 0 too. (torchrun
# itself, signalled, would stop its workers after a grace period and exit non-zero.) engine.launch is torchrun
# that ends quietly when the processes stop on a user error (they have printed its line).
# One OpenMP thread per process unless set: torchrun's own default, without its banner about it.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m engine.launch \
  --nproc_per_node="$NGPU" --rdzv_backend=c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
  -m engine.train "${args[@]}" &
launcher=$!
interrupted=0
trap 'interrupted=1; pkill -TERM -P "$launcher" || true' TERM
status=0
wait "$launcher" || status=$?
if [ "$interrupted" = 1 ]; then  # the signal interrupted wait: wait for the workers' own exit status
  status=0
  wait "$launcher" || status=$?
fi
exit "$status"
