#!/usr/bin/env bash
# A session's ONE device call (bench/README.md): Tessera against the reference trainer (torchtitan 0.2.2,
# ../shared/bench/anchor) on one Hopper GPU, at most 10 minutes, the most needed runs first (issue 6, acceptance 1
# and 2; issue 2: 7; issue 3: 4; issue 4: 3; issue 7: 2). Both trainers train Llama-3-8B layer shapes with 8
# layers (flavor 8B_L8, 2.8B parameters), seq_len 8192, local batch 1, AdamW, with the expandable-segments
# allocator; each run prints its median tps, TFLOP/s, MFU (bf16 peak, 989 TFLOP/s, for float8 too, as the
# reference counts it) and peak memory after warm-up, then one table gives Tessera / reference for each pair.
# Order: the two acceptance pairs (reference bf16 and Tessera bf16, reference float8 and Tessera float8, all
# compiled with per-op AC), bench/cuda_cp_check.py (ring attention's CUDA kernels), eager (issue 2's 8B_L8
# run at seq 8192 in bf16 with sdpa), FSDP2 on the one rank (issue 3), no AC, full AC.
#
# Once, on this machine (it fills .anchor/ and .whl/, both git-ignored): bash bench/prepare_device.sh
# Device call (carry .anchor and .whl):
#   ANCHOR_LOGS=$OUT bash bench/perf_vs_reference.sh
#
# Environment:
#   ONLY     Tessera configurations to run, in this order (default: the first six below)
#   ANCHOR   reference configurations (default: those ONLY's runs are compared with among bf16_compile and
#            fp8_compile; also: eager noac_compile)
#   STEPS    steps of every run, both trainers (default 25). Both log every 5 steps (a logged tps is the mean
#            since the previous log, and the log is the step's one host sync: logging every step would drain
#            the GPU's queue every step, which the reference does not do) and both take medians over the
#            lines after step 10 (steps 11-15, 16-20, 21-25). A run that stopped before STEPS is marked
#            partial and gets no ratio.
#   BUDGET   seconds for the whole script (default 570): a run whose estimate no longer fits is skipped, so
#            that the summary always comes back; the summary ends with the ONLY/ANCHOR/CP_CHECK line that
#            runs what was skipped (the next session lent a GPU starts there).
#   CP_CHECK 1 (default): run bench/cuda_cp_check.py after the two pairs; 0: not.
#   LEVERS=1 also run bench/hopper_levers.py (microbenchmarks of the speed levers) if time is left.
#   AUTO_MEMORY 1 (default): when bf16_compile_ac_op's (or fp8_compile_ac_op's) peak reserved memory is above its
#            reference run's (after warm-up, or over the whole run: the first step's compilation included), run
#            right after the two pairs bf16_noautotune (the fix to try; in the table beside the others); if its
#            memory holds, fp8_noautotune (so that this one call has both pairs with the fix, as acceptance
#            asks), else bf16_snapshot (where the memory comes from); 0: none of these.
# Comes back under $OUT: the reference's logs (ANCHOR_LOGS), summary.txt and tessera_runs.tar.gz (every
# Tessera run's log and metrics.jsonl; the run folders themselves stay on the machine, under /tmp, and an earlier
# call's on the same machine come back in the tarball too). The summary ends with the logged peak memory of each
# run this call launched beside the memory estimate (bench/memory_check.py --from-runs): every run here is also a
# check of the estimate. Each run first clears its folder and log (and each reference run its log), so that one
# skipped for the budget or failed before its first log reads "no result" in the table, not an earlier call's.
set -uo pipefail
START=$SECONDS
ONLY=${ONLY:-"bf16_compile_ac_op fp8_compile_ac_op eager_ac_op fsdp1_compile_ac_op noac_compile fullac_compile"}
STEPS=${STEPS:-25}
BUDGET=${BUDGET:-570}
CP_CHECK=${CP_CHECK:-1}
AUTO_MEMORY=${AUTO_MEMORY:-1}
AUTO_RAN=""  # Tessera runs AUTO_MEMORY added, compared with the reference in the table too
SKIPPED=""  # Tessera configurations the budget left out
SKIPPED_REF=""  # reference configurations likewise

L8=(--model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1)
declare -A TESSERA=(
  [bf16_compile_ac_op]="--compile.enable --activation_checkpoint.mode selective"
  [fp8_compile_ac_op]="--compile.enable --activation_checkpoint.mode selective --float8.enable"
  [eager_ac_op]="--activation_checkpoint.mode selective"
  [fsdp1_compile_ac_op]="--compile.enable --activation_checkpoint.mode selective --parallelism.fsdp_single_rank"
  [noac_compile]="--compile.enable"
  [fullac_compile]="--compile.enable --activation_checkpoint.mode full"
  # Not in the default ONLY (a later call): per-op AC keeping every other matmul, as the reference's per-op
  # policy does (Tessera's keeps them all: less recompute; at these shapes the peak is at the end of backward,
  # parameters, gradients and AdamW, so the estimate gives both policies the same peak):
  [bf16_compile_ac_alt]="--compile.enable --activation_checkpoint.mode selective --activation_checkpoint.op_matmuls alternate"
  [fp8_compile_ac_alt]="--compile.enable --activation_checkpoint.mode selective --activation_checkpoint.op_matmuls alternate --float8.enable"
  # The compute on fp32 weights under autocast (the default before 2026-11-26), beside the split bf16 weights
  # that bf16_compile_ac_op and fp8_compile_ac_op now run on:
  [bf16_autocast]="--compile.enable --activation_checkpoint.mode selective --training.no-bf16_weights"
  [fp8_autocast]="--compile.enable --activation_checkpoint.mode selective --float8.enable --training.no-bf16_weights"
  # A diagnosis, not a figure (recording the allocator's history slows the steps): bf16_compile_ac_op with a
  # memory snapshot every 5 steps, and bench/snapshot_summary.py on the first one (step 5) says which code made the
  # allocator reserve memory beyond the live tensors (the 2026-11-26 bf16 runs held 45.46 GiB reserved for
  # 41.73 GiB active):
  [bf16_snapshot]="--compile.enable --activation_checkpoint.mode selective --profiling.enable_memory_snapshot --profiling.profile_freq 5"
  # and bf16_compile_ac_op with every compiled elementwise and reduction kernel on one launch configuration (the
  # blocks' and the loss's too, not only the optimizer update's): no clones of written tensors at the first step:
  [bf16_noautotune]="--compile.enable --activation_checkpoint.mode selective --compile.no-autotune"
  [fp8_noautotune]="--compile.enable --activation_checkpoint.mode selective --float8.enable --compile.no-autotune"
  # and the speed levers, measured beside bf16_compile_ac_op:
  [fused_loss]="--compile.enable --activation_checkpoint.mode selective --training.loss_chunk_tokens 2048"
  [cudnn_sdpa]="--compile.enable --activation_checkpoint.mode selective --model.sdpa_backend cudnn"
  [fused_loss_cudnn]="--compile.enable --activation_checkpoint.mode selective --training.loss_chunk_tokens 2048 --model.sdpa_backend cudnn"
)
declare -A REFERENCE=(
  [bf16_compile]="--compile.enable"
  [fp8_compile]="--compile.enable --model.converters quantize.linear.float8"
  [eager]=""
  [noac_compile]="--compile.enable --activation_checkpoint.mode none"
)
# Each Tessera run and the reference run it is compared with (compare_reference.py's --pairs).
declare -A PAIR=(
  [bf16_compile_ac_op]=bf16_compile [fp8_compile_ac_op]=fp8_compile [eager_ac_op]=eager
  [fsdp1_compile_ac_op]=bf16_compile
  [noac_compile]=noac_compile [bf16_compile_ac_alt]=bf16_compile [fp8_compile_ac_alt]=fp8_compile
  [fused_loss]=bf16_compile [cudnn_sdpa]=bf16_compile [fused_loss_cudnn]=bf16_compile
  [bf16_autocast]=bf16_compile [fp8_autocast]=fp8_compile [bf16_noautotune]=bf16_compile
  [fp8_noautotune]=fp8_compile
)
for label in $ONLY; do  # before the set-up: a typo costs no device time
  [ -n "${TESSERA[$label]+set}" ] || { echo "ONLY: unknown configuration '$label'; choose from: ${!TESSERA[*]}"; exit 2; }
done
for label in ${ANCHOR:-}; do
  [ -n "${REFERENCE[$label]+set}" ] || { echo "ANCHOR: unknown configuration '$label'; choose from: ${!REFERENCE[*]}"; exit 2; }
done
source "$(dirname "$0")/common.sh"                # cd to the repo, carried wheels, GPU and torch; RET, RUNS
export ANCHOR_LOGS=${ANCHOR_LOGS:-$RET}
export PYTORCH_ALLOC_CONF="expandable_segments:True"   # as the reference kit runs
compared_with() {  # LABELS...: the reference runs (bf16 and float8 compiled) these Tessera runs pair with, once each
  local refs="" label
  for label; do
    case "${PAIR[$label]:-}" in
      bf16_compile|fp8_compile) [[ " $refs " == *" ${PAIR[$label]} "* ]] || refs+=" ${PAIR[$label]}" ;;
    esac
  done
  echo "${refs# }"
}
# Default: the reference runs ONLY's runs are compared with (eager and no-AC: the kit's README has them).
[ -n "${ANCHOR+set}" ] || ANCHOR=$(compared_with $ONLY)
# The table lists every run of ONLY: run now, or "no result" (skipped, or its reference run skipped), never what
# an earlier call on this machine left under RUNS. Other labels' folders stay there (and in the tarball).
for label in $ONLY; do fresh "$label"; done

# Seconds a run is expected to take on a fresh machine (start, cold compile, steps), to keep inside BUDGET.
estimate() { case $1 in eager*) echo 45 ;; *) echo 100 ;; esac; }
fits() { (( SECONDS - START + $1 <= BUDGET )); }

tessera() {  # LABEL: one Tessera run, summarized after 10 warm-up steps
  local label=$1 est; est=$(estimate "$label")
  fresh "$label"  # skipped or failed, it has no result: not the one an earlier call left here
  if ! fits "$est"; then SKIPPED+=" $label"; echo "=== skip Tessera $label (budget)"; return; fi
  launching "$label"
  echo "=== Tessera $label: ${TESSERA[$label]}"
  # shellcheck disable=SC2086
  timeout $((BUDGET - (SECONDS - START))) python3 -m engine.train --config train_configs/debug_model.toml \
    --job.dump_folder "$RUNS/$label" "${L8[@]}" --training.steps "$STEPS" --metrics.log_freq 5 \
    --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-4 ${TESSERA[$label]} > "$RUNS/$label.log" 2>&1
  local rc=$?
  tail -n 2 "$RUNS/$label.log"
  if [ $rc = 0 ]; then python3 bench/summarize.py "$RUNS/$label" --skip 10; else echo "Tessera $label: exit $rc"; fi
  local snapshot  # the run's first memory snapshot, if it wrote any (bf16_snapshot)
  snapshot=$(ls "$RUNS/$label"/memory_snapshot/iteration_*/rank0_memory_snapshot.pickle 2>/dev/null \
             | sort -V | head -n 1)
  [ -n "$snapshot" ] && python3 bench/snapshot_summary.py "$snapshot" | tee "$RUNS/$label.snapshot_summary.txt"
  return 0
}

reference() {  # LABEL: one reference run (its script prints its last logged steps)
  local label=$1
  rm -f "$ANCHOR_LOGS/anchor_$label.log"  # an earlier call's: skipped or failed, this one has none
  if ! fits 130; then SKIPPED_REF+=" $label"; echo "=== skip reference $label (budget)"; return; fi
  timeout $((BUDGET - (SECONDS - START))) bash .anchor/run_anchor.sh \
    "$label|${REFERENCE[$label]} --training.steps $STEPS"
}

[ -f .anchor/run_anchor.sh ] \
  || { echo "no .anchor/: bash bench/prepare_device.sh on the development machine, then carry .anchor"; }

cp_check() {  # ring attention's CUDA kernels against full SDPA (issue 4), about half a minute
  if ! fits 45; then CP_CHECK=skipped; echo "=== skip cuda_cp_check.py (budget)"; return; fi
  echo "=== bench/cuda_cp_check.py"
  fresh cuda_cp_check
  timeout "$(limit 90)" python3 bench/cuda_cp_check.py 2>&1 | tee "$RUNS/cuda_cp_check.log"
  CP_CHECK=done
}

compare() {  # ARGS...: compare_reference.py on this call's runs, medians over the windows after step 10
  python3 bench/compare_reference.py --tessera "$RUNS" --anchor "$ANCHOR_LOGS" --skip 10 --anchor-skip 10 \
    --steps "$STEPS" "$@"
}

ran_now() {  # LABEL: launched by this call, and logged (no earlier call's result counts)
  [[ " $LAUNCHED " == *" $1 "* ]] && [ -f "$RUNS/$1/metrics.jsonl" ]
}

memory_above_reference() {  # LABEL (run by this call): peak reserved (steps 11 on, or whole run) above reference's
  ran_now "$1" && compare --labels "$1" --pairs "$1=${PAIR[$1]}" --memory-above 1.0 > /dev/null
}

auto_run() {  # LABEL: a Tessera run auto_memory adds (unless ONLY runs it anyway, in its place); in the table if
  [[ " $ONLY " == *" $1 "* ]] && return 0  # it has a reference run to be compared with (not bf16_snapshot)
  tessera "$1"
  [ -f "$RUNS/$1/metrics.jsonl" ] && [ -n "${PAIR[$1]+set}" ] && AUTO_RAN+=" $1"
  return 0
}

auto_memory() {  # a pair's memory above the reference's: the fix to try; then both pairs with it, or the history
  [ "$AUTO_MEMORY" = 1 ] || return 0
  memory_above_reference bf16_compile_ac_op || memory_above_reference fp8_compile_ac_op || return 0
  echo "=== a pair reserves more than its reference run: bf16_noautotune, then fp8_noautotune if its" \
       "memory holds, else bf16_snapshot"
  auto_run bf16_noautotune
  # Its memory holds only if it ran now (ONLY may have it later in its place; no earlier call's result counts).
  if ran_now bf16_noautotune && ! memory_above_reference bf16_noautotune; then
    auto_run fp8_noautotune
  else
    auto_run bf16_snapshot
  fi
}

# Interleaved, so that each pair runs close in time; the acceptance pairs first.
for pair in "bf16_compile bf16_compile_ac_op" "fp8_compile fp8_compile_ac_op" "auto_memory" "- bf16_autocast" \
            "- fp8_autocast" "cp_check" "eager eager_ac_op" \
            "- fsdp1_compile_ac_op" "noac_compile noac_compile" "- fullac_compile" "- bf16_compile_ac_alt" \
            "- fp8_compile_ac_alt" "- fused_loss" "- cudnn_sdpa" "- fused_loss_cudnn" "- bf16_snapshot" \
            "- bf16_noautotune" "- fp8_noautotune"; do
  set -- $pair
  if [ "$1" = cp_check ]; then [ "$CP_CHECK" = 1 ] && cp_check; continue; fi
  if [ "$1" = auto_memory ]; then auto_memory; continue; fi
  [[ " $ANCHOR " == *" $1 "* ]] && [ -f .anchor/run_anchor.sh ] && reference "$1"
  if [[ " $ONLY " == *" $2 "* ]]; then
    if [[ " $SKIPPED_REF " == *" $1 "* ]]; then  # no reference run to compare it with: next time, with its pair
      SKIPPED+=" $2"; echo "=== skip Tessera $2 (its reference run was skipped)"
    else
      tessera "$2"
    fi
  fi
done

if [ "${LEVERS:-0}" = 1 ] && fits 60; then
  timeout $((BUDGET - (SECONDS - START))) python3 bench/hopper_levers.py
fi

{
  echo
  echo "=== Tessera / reference, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(python3 -c 'import torch; print("torch", torch.__version__)')"
  pairs=""; for label in "${!PAIR[@]}"; do pairs+="$label=${PAIR[$label]},"; done
  compare --labels "$(echo $ONLY $AUTO_RAN | tr ' ' ,)" --pairs "$pairs" --json "$RET/summary.json"
  if [ -n "$SKIPPED$SKIPPED_REF" ] || [ "$CP_CHECK" = skipped ]; then
    for ref in $(compared_with $SKIPPED); do  # the reference runs the skipped ones pair with
      [[ " $SKIPPED_REF " == *" $ref "* ]] || SKIPPED_REF+=" $ref"
    done
    echo "skipped for the time budget; the next call runs them with:"
    if [ -n "$SKIPPED$SKIPPED_REF" ]; then  # (ONLY="" runs the default list: name a Tessera run then)
      [ -n "$SKIPPED" ] || SKIPPED=" bf16_compile_ac_op"
      echo "  ONLY=\"${SKIPPED# }\" ANCHOR=\"${SKIPPED_REF# }\" CP_CHECK=$([ "$CP_CHECK" = skipped ] && echo 1 || echo 0)" \
           "ANCHOR_LOGS=\$OUT bash bench/perf_vs_reference.sh"
    else
      echo "  bash -c 'source bench/common.sh && python3 bench/cuda_cp_check.py'"
    fi
  fi
  echo
  echo "=== peak memory of each Tessera run beside tools/memory.py's estimate (issue 7)"
  python3 bench/memory_check.py --from-runs "$RUNS" --labels "$(launched)" --out "$RUNS"   # md/json: in the tarball
  echo "elapsed $((SECONDS - START)) s"
} | tee "$RET/summary.txt"
pack tessera_runs
