#!/usr/bin/env bash
# The CUDA paths of the parallel techniques, in one device call (carry .whl):  bash bench/gpu_parallel.sh
#  1. FSDP and TP: 2 processes sharing the GPU over gloo (NCCL refuses two ranks on one GPU), debug model in
#     fp32, FSDP 2 and TP 2, loss curves printed beside the single-rank CUDA run's (TP 2 reads the same batches
#     and must match it; FSDP 2's ranks read their own shards of the data), TP 2 with the vocabulary-parallel
#     fused loss (must match too), and CP 2 with cp_rotate = allgather (same batches as one rank: its curve must
#     match too); FSDP 2 also saves asynchronously (the checkpoint votes on CUDA).
#     Then FSDP on one rank with CPU offload (parameters, gradients and AdamW in host memory, the process group
#     cuda:nccl,cpu:gloo): its curve must match the single-rank one. "Match": the same logged steps, every one
#     of the run's, each loss within CURVE_RTOL (default 1e-3) of the one-rank run's, relative; FSDP 2's curve
#     is printed, not compared (other data), but it must log every step too. Each check prints PASS or FAIL;
#     the script exits 1 at its end, after every check ran, if any failed.
#  2. bench/cuda_cp_check.py: ring attention's CUDA kernels (bf16 flash, fp32 matmul, bf16 document-masked)
#     against full SDPA.
# Speed and memory on one GPU (FSDP2 on the one rank included) are bench/run.py's.
#
# Every launch has a time limit (LIMIT seconds, default 150; collectives time out after 60 s), and none goes
# past the script's deadline (BUDGET, bench/common.sh), so that a hang in one check cannot take the device
# call's 10 minutes and with them every result.
set -uo pipefail
source "$(dirname "$0")/common.sh"
CURVE_RTOL=${CURVE_RTOL:-1e-3}
FAILED=""  # the checks that failed

LIMIT=${LIMIT:-150}

# CUDA paths of FSDP2 and TP: gloo over CUDA tensors, two ranks on one GPU.
SMALL_STEPS=8
SMALL=(--training.steps "$SMALL_STEPS" --training.seq_len 256 --training.local_batch_size 4 --metrics.log_freq 1
       --lr_scheduler.warmup_steps 2 --debug.deterministic --training.mixed_precision_param float32
       --comm.init_timeout_seconds 60 --comm.train_timeout_seconds 60)
launching one
timeout "$(limit "$LIMIT")" python3 -m engine.train --config train_configs/debug_model.toml --job.dump_folder "$RUNS/one" "${SMALL[@]}" \
  --training.global_batch_size 8 > "$RUNS/one.log" 2>&1 || tail -n 20 "$RUNS/one.log"
# NAME [steps]: the run in $RUNS/NAME beside the single-rank run's losses, PASS or FAIL, a FAIL added to FAILED
# (steps: only that both logged every step, its data being another)
compare_to_one() {
  python3 - "$RUNS/one" "$RUNS/$1" "$SMALL_STEPS" "$CURVE_RTOL" "${2:-losses}" <<'PY' || FAILED+=" $1"
import json, math, os, sys


def losses(run):  # step -> loss of every logged training step ({} for a run that logged none)
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, f)) if "loss" in r}


one, run = losses(sys.argv[1]), losses(sys.argv[2])
steps, rtol, mode, name = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], os.path.basename(sys.argv[2])
print(name, "losses", [round(run[s], 5) for s in sorted(run)], "one rank", [round(one[s], 5) for s in sorted(one)])
problems = []
for who, got in (("one rank", one), (name, run)):  # every step, else a run that died early compares fine
    missing = sorted(set(range(1, steps + 1)) - set(got))
    if missing:
        problems.append(f"{who} misses steps {missing}")
    if any(not math.isfinite(x) for x in got.values()):
        problems.append(f"{who} logged a loss that is not finite")
if mode == "steps":
    verdict = "every step logged; its curve not compared (its ranks read other data than the one-rank run)"
else:
    worst = max((abs(one[s] - run[s]) / abs(one[s]) for s in set(one) & set(run)), default=math.inf)
    verdict = f"max relative difference {worst:.3g}, at most {rtol:g}"
    if not worst <= rtol:  # nan too
        problems.append(f"max relative difference {worst:.3g}, above {rtol:g}")
print(f"  {'FAIL' if problems else 'PASS'} {name}: {'; '.join(problems) or verdict}")
sys.exit(1 if problems else 0)
PY
}
# FSDP 2 also saves asynchronously at steps 3 and 6 (the commit votes' CUDA path: pinned copies behind events).
for layout in "--parallelism.dp_shard 2 --checkpoint.enable --checkpoint.interval 3 --checkpoint.async_mode async" \
              "--parallelism.tp 2 --training.global_batch_size 8" \
              "--parallelism.tp 2 --training.global_batch_size 8 --training.loss_chunk_tokens 300" \
              "--parallelism.cp 2 --training.global_batch_size 8"; do
  name=$(echo "$layout" | tr -d ' -' | tr '.' '_')
  launching "$name"
  TESSERA_BACKEND=gloo timeout "$(limit "$LIMIT")" python3 -m torch.distributed.run --nproc_per_node 2 --local-ranks-filter 0 -m engine.train \
    --config train_configs/debug_model.toml --job.dump_folder "$RUNS/$name" "${SMALL[@]}" $layout \
    > "$RUNS/$name.log" 2>&1 || tail -n 30 "$RUNS/$name.log"
  case $layout in *dp_shard*) compare_to_one "$name" steps ;; *) compare_to_one "$name" ;; esac
  [ -d "$RUNS/$name/checkpoint" ] && { grep -h "committed" "$RUNS/$name.log"; ls "$RUNS/$name/checkpoint"; }
done
launching fsdp_cpu_offload
timeout "$(limit "$LIMIT")" python3 -m engine.train --config train_configs/debug_model.toml --job.dump_folder "$RUNS/fsdp_cpu_offload" \
  "${SMALL[@]}" --training.global_batch_size 8 --parallelism.fsdp_single_rank --parallelism.fsdp_cpu_offload \
  > "$RUNS/fsdp_cpu_offload.log" 2>&1 || tail -n 30 "$RUNS/fsdp_cpu_offload.log"
compare_to_one fsdp_cpu_offload

timeout "$(limit "$LIMIT")" python3 bench/cuda_cp_check.py \
  || { echo "cuda_cp_check: exit $?"; FAILED+=" cuda_cp_check"; }
pack gpu_parallel
if [ -n "$FAILED" ]; then echo "FAILED:$FAILED"; exit 1; fi
echo "every check passed"
