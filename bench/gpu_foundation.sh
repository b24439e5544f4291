#!/usr/bin/env bash
# The profiler and the allocator history on CUDA, in one device call (carry .whl):  bash bench/gpu_foundation.sh
# First Llama-3-8B layer shapes with 8 layers (flavor 8B_L8), seq_len 8192, local batch 1, bf16 autocast, sdpa,
# eager without AC for 20 steps (median tps, TFLOP/s, MFU and peak memory after step 10); then an 8B_L2 run
# with a profiler trace and a memory snapshot of step 10, from which it prints the attention kernels that ran.
#
# The machine has torch but not datasets, tomli_w or torchao: fill .whl/ as bench/README.md says (one version of
# each wheel: two stop the install).
set -uo pipefail
source "$(dirname "$0")/common.sh"

run 8b_l8_bf16_sdpa --model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1

# The CUDA side of [profiling] (8B_L2, seq 2048, 10 steps): a trace of step 10 with CUDA kernels in it, and
# the allocator's history at step 10 (tens of MB: not packed; their sizes and a count are printed).
launching profiled
fresh 8b_l2_profiled  # its log
timeout "$(limit 200)" python3 -m engine.train --config train_configs/debug_model.toml --job.dump_folder "$RUNS/profiled" \
  --model.flavor 8B_L2 --training.seq_len 2048 --training.local_batch_size 1 --training.steps 10 \
  --profiling.enable_profiling --profiling.enable_memory_snapshot > "$RUNS/8b_l2_profiled.log" 2>&1 \
  || { echo "8b_l2_profiled: failed"; tail -n 5 "$RUNS/8b_l2_profiled.log"; }
ls -la "$RUNS/profiled/profile_traces/iteration_10" "$RUNS/profiled/memory_snapshot/iteration_10"
python3 - "$RUNS/profiled/profile_traces/iteration_10/rank0_trace.json" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
kernels = [e for e in events if e.get("cat") == "kernel"]
print(f"trace of step 10: {len(events)} events, {len(kernels)} CUDA kernels")
# Which attention kernels sdpa = auto ran (flash, cuDNN or efficient), by name and total time.
attn = {}
for e in kernels:
    if any(w in e["name"].lower() for w in ("flash", "fmha", "cudnn", "attention", "attn", "sdpa")):
        attn[e["name"][:100]] = attn.get(e["name"][:100], 0) + e.get("dur", 0)
for name, us in sorted(attn.items(), key=lambda kv: -kv[1]):
    print(f"  attention kernel {us / 1e3:8.2f} ms  {name}")
PY
python3 bench/memory_check.py --from-runs "$RUNS" --labels "$(launched)" --out "$RUNS"   # peaks beside the estimate
pack gpu_foundation
