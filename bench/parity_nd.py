"""Loss parity of big N-D layouts with a single process, on gloo CPU ranks (too heavy for CI).

    python bench/parity_nd.py            # 4-D: PP 2 x FSDP 2 x CP 2 x TP 2 (16 ranks)
    python bench/parity_nd.py --5d       # 5-D: PP 2 x DP_REPLICATE 2 x FSDP 2 x CP 2 x TP 2 (32 ranks)

Prints each layout's losses and gradient norms beside the single-process run's and the largest relative
difference; exits non-zero when it exceeds 1e-5 (the tolerance of tests/test_parallel.py).
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.parallel_harness import global_batches, run_layout, run_world  # noqa: E402

STEPS, GLOBAL = 5, 8
FOUR_D = ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--parallelism.tp", "2",
          "--training.local_batch_size", "4", "--parallelism.pp_schedule", "Interleaved1F1B"]
FIVE_D = ["--parallelism.pp", "2", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
          "--parallelism.cp", "2", "--parallelism.tp", "2", "--training.local_batch_size", "2"]


def main() -> int:
    five = "--5d" in sys.argv
    name, world, args = ("5d", 32, FIVE_D) if five else ("4d", 16, FOUR_D)
    batches = global_batches(GLOBAL, STEPS)
    out = tempfile.mkdtemp(prefix=f"tessera_{name}_")
    ref = run_layout(["--training.local_batch_size", str(GLOBAL)], 1, 0, batches, os.path.join(out, "ref"))
    result = run_world(world, {name: args}, {name: batches}, out)[name]
    if "error" in result:
        print(result["error"])
        return 1
    worst = 0.0
    for key in ("losses", "grad_norms"):
        rel = max(abs(a - b) / abs(b) for a, b in zip(result[key], ref[key]))
        worst = max(worst, rel)
        print(f"{name} {key}: {[round(x, 6) for x in result[key]]}")
        print(f"single {key}: {[round(x, 6) for x in ref[key]]}   max relative difference {rel:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
