# Shared set-up of the GPU bench scripts (sourced, not run): installs the carried wheels of .whl/ (packages
# the device machine lacks) into /tmp/site, puts the repository on PYTHONPATH, prints the GPU and torch,
# and defines run LABEL ARGS...: a 20-step debug-config run with ARGS, logged every 5 steps (the log is the
# step's one host sync; the reference trainer logs so too) and summarized over the windows after step 10.
#
# The device returns at most 8 files from its $OUT, so the run folders and logs stay on the machine, under
# RUNS (default /tmp/tessera_bench/<script>), and `pack NAME` puts them into ONE tarball, $RET/NAME.tar.gz (plots left
# out); RET is the device's $OUT (/tmp/tessera_bench_out elsewhere), where summaries go too.
#
# One deadline for the whole script: BUDGET seconds (default 570) from START (the script's start); `limit N`
# gives min(N, the seconds left), the time limit of each launch, so that the summary and the tarball always
# come back inside the device call's 10 minutes.
START=${START:-$SECONDS}
BUDGET=${BUDGET:-570}
limit() { local left=$((BUDGET - (SECONDS - START))); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# Every run imports these (datasets: the data loader; tomli_w: the config dump; torchao: float8): fail now, in
# seconds, rather than in every run after its start-up.
python3 -c "import datasets, tomli_w, torchao" \
  || { echo "error: the carried wheels are missing or broken: bash bench/prepare_device.sh on the development" \
            "machine, then carry .whl"; exit 2; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
RET=${OUT:-/tmp/tessera_bench_out}
RUNS=${RUNS:-/tmp/tessera_bench/$(basename "$0" .sh)}
mkdir -p "$RET" "$RUNS"
# RUNS outlives the call: a second call on the same warm machine finds the first one's folders there (`pack`
# returns them too, an interrupted call's included). So every launch first clears its own label (`fresh`), and
# a run skipped or failed now reads as no result, not as an earlier call's; LAUNCHED names this call's runs, the
# only ones `memory_check.py --from-runs --labels` tabulates.
LAUNCHED=""
fresh() {  # LABEL: forget what an earlier call left of LABEL under RUNS (its folder, log and summaries)
  rm -rf "${RUNS:?}/${1:?}" "$RUNS/$1".*
}
launching() {  # LABEL: fresh, and LABEL is one of this call's runs
  fresh "$1"
  LAUNCHED+=" $1"
}
launched() {  # this call's runs, comma-separated (memory_check.py --labels)
  echo $LAUNCHED | tr ' ' ,
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

run() {  # LABEL ARGS...
  local label=$1 seconds; shift
  fresh "$label"
  seconds=$(limit "${RUN_LIMIT:-300}")
  if (( seconds < 60 )); then echo "=== skip $label (budget: ${seconds} s left)"; return; fi
  launching "$label"
  timeout "$seconds" python3 -m engine.train --config train_configs/debug_model.toml --job.dump_folder "$RUNS/$label" \
    --training.steps 20 --metrics.log_freq 5 --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-4 "$@" \
    > "$RUNS/$label.log" 2>&1
  local rc=$?
  tail -n 3 "$RUNS/$label.log"
  if [ $rc = 0 ]; then python3 bench/summarize.py "$RUNS/$label" --skip 10 --steps 20; else echo "$label: exit $rc"; fi
}

pack() {  # NAME: every run folder and log under RUNS (plots, traces, checkpoint data left out) as $RET/NAME.tar.gz
  tar czf "$RET/$1.tar.gz" --exclude "*.png" --exclude "*trace*.json*" --exclude "*.pickle" --exclude "*.distcp" \
    -C "$RUNS" . \
    && echo "packed $(find "$RUNS" -type f | wc -l) files of $RUNS into $RET/$1.tar.gz ($(du -h "$RET/$1.tar.gz" | cut -f1))"
}
