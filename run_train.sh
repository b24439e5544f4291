#!/usr/bin/env bash
# Launch Tessera training.
#   ./run_train.sh [--config FILE] [--section.key value | --section.key=value ...]
# Runs in the caller's directory: relative paths (--config, --data.path, --job.dump_folder, ...) are the caller's.
# Environment:
#   NGPU             processes on this node (default 1; on a CPU-only machine they use gloo)
#   LOG_RANK         comma-separated ranks whose output is shown (default 0)
#   CONFIG_FILE      the TOML file when no --config is given (default train_configs/debug_model.toml of this
#                    checkout)
#   PYTHON           the interpreter (default: python3 from PATH, e.g. the activated virtual environment)
#   TESSERA_BACKEND  the process-group backend instead of nccl (CUDA) / gloo (CPU): gloo or nccl
#   DRY_RUN=1        build for NGPU simulated ranks on the fake backend and meta device, print the mesh and the
#                    per-rank memory, train nothing (tools/dry_run.py); GPU_MEMORY_GIB: memory per GPU (80)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")" && pwd)
# This checkout's packages, whatever the current directory; PYTHONSAFEPATH: a folder of the caller's named like
# one of them (engine, models, ...) does not shadow it.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}

fail() {  # a user error: one line, status 2
  echo "error: $1" >&2
  exit 2
}

case "$DRY_RUN" in
  0|1) ;;
  *) fail "DRY_RUN: expected 0 or 1, got '$DRY_RUN'" ;;
esac
command -v "$PYTHON" > /dev/null || fail "PYTHON: '$PYTHON' is not a program here; give the Python of the \
environment Tessera is installed in, e.g. PYTHON=.venv/bin/python"

args=("$@")
has_config=0
for a in "${args[@]+"${args[@]}"}"; do
  case "$a" in
    --config|--config=*) has_config=1 ;;
    --help|-h)  # the options, once, from this one process
      exec "$PYTHON" -m engine.train --help ;;
  esac
done
# The interpreter must be the one Tessera is installed for (most often the virtual environment is not active).
problem=$("$PYTHON" -c 'import importlib.util, sys
if sys.version_info < (3, 10): print("is Python %d.%d; Tessera needs 3.10 or newer" % sys.version_info[:2])
elif importlib.util.find_spec("torch") is None: print("has no torch installed")' 2>&1) || problem="does not start"
where=$(command -v "$PYTHON")
[ "$where" = "$PYTHON" ] && where="" || where=" ($where)"
[ -z "$problem" ] || fail "PYTHON: '$PYTHON'$where $problem; activate the virtual environment \
Tessera is installed in (. .venv/bin/activate) or give its interpreter, e.g. PYTHON=.venv/bin/python"
if [ "$has_config" = 0 ]; then
  if [ -n "${CONFIG_FILE:-}" ] && [ ! -f "$CONFIG_FILE" ]; then
    fail "CONFIG_FILE: '$CONFIG_FILE' is not a file; give a TOML file such as $ROOT/train_configs/debug_model.toml"
  fi
  args=(--config "${CONFIG_FILE:-$ROOT/train_configs/debug_model.toml}" "${args[@]+"${args[@]}"}")
fi

if [ "$DRY_RUN" = 1 ]; then
  # Dry run: the real build path for NGPU simulated ranks in this one process (fake process group, meta
  # device): validation, mesh, parallel plan, per-rank memory table. GPU_MEMORY_GIB: memory per GPU (80).
  WORLD_SIZE=$NGPU exec "$PYTHON" -m tools.dry_run "${args[@]}"
fi

# NGPU and LOG_RANK, here, in no time: a positive whole number of processes on this node (a whole cluster's world
# is planned with DRY_RUN=1 or launched with slurm/), and ranks among them.
[[ "$NGPU" =~ ^[0-9]{1,7}$ ]] && [ "$((10#$NGPU))" -ge 1 ] && [ "$((10#$NGPU))" -le 1024 ] ||
  fail "NGPU: expected the number of processes on this node, a whole number from 1 to 1024, got '$NGPU'"
NGPU=$((10#$NGPU))
[[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]] ||
  fail "LOG_RANK: '$LOG_RANK' is not a comma-separated list of ranks in [0, $NGPU) (NGPU = $NGPU), e.g. 0 or 0,1"
for rank in ${LOG_RANK//,/ }; do
  [ "${#rank}" -le 7 ] && [ "$((10#$rank))" -lt "$NGPU" ] ||
    fail "LOG_RANK: rank $rank is not in [0, $NGPU) (NGPU = $NGPU); show one of the ranks this run starts"
done

if [ "$NGPU" = 1 ]; then
  # One process: no launcher needed, and user errors print exactly one line. (A WORLD_SIZE or RANK exported in
  # the caller's shell does not make it a rank of a larger world.)
  WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 exec "$PYTHON" -m engine.train "${args[@]}"
fi

# SIGTERM (SLURM preemption, or a user's kill) goes straight to the training processes, which save a
# checkpoint at the next step boundary and exit 0 (checkpoint.enable); torchrun then exits 0 too. (torchrun
# itself, signalled, would stop its workers after a grace period and exit non-zero.) engine.launch is torchrun
# that ends with the one error: line when the processes stop on a user error.
# One OpenMP thread per process unless set: torchrun's own default, without its banner about it.
# The ranks LOG_RANK shows print the run's log lines (engine.distributed.log_ranks), not rank 0 alone.
# TESSERA_PARENT_PID: the launcher dies with this script, and the training processes with the launcher (a SIGKILL
# to either leaves no process training).
# TESSERA_CHECK_WORLD_SIZE: the launcher first checks the configuration for this world, once, so that a user
# error prints one line before any training process starts.
TESSERA_CHECK_WORLD_SIZE=$NGPU TESSERA_PARENT_PID=$$ TESSERA_LOG_RANKS="$LOG_RANK" \
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m engine.launch \
  --nproc_per_node="$NGPU" --rdzv_backend=c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
  -m engine.train "${args[@]}" &
launcher=$!
interrupted=0
trap 'interrupted=1; pkill -TERM -P "$launcher" || true' TERM
# SIGINT (Ctrl-C reaches the launcher too, in this script's process group; a kill reaches this script alone) is
# passed on to the launcher, which stops the ranks (each exits at once, rank 0 with one line); this script waits.
trap 'interrupted=1; kill -INT "$launcher" 2>/dev/null || true' INT
status=0
wait "$launcher" || status=$?
if [ "$interrupted" = 1 ]; then  # the signal interrupted wait: wait for the workers' own exit status
  status=0
  wait "$launcher" || status=$?
fi
exit "$status"
