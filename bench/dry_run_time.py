"""Wall time of dry runs (DRY_RUN=1, the fake process group: no GPU), against the design's bar: a dry run of
llama3_405b.toml at 16,384 ranks in under a minute on the development CPU (docs/scale.md). Prints, never
asserts (tests/test_dry_run.py checks what the dry runs print).

    python bench/dry_run_time.py                 # the shipped configs at their scale (docs/scale.md's table)
    python bench/dry_run_time.py --run 8:train_configs/debug_model.toml     # any NGPU:CONFIG[:override ...]

Each run is the whole command a user types (``./run_train.sh``), so interpreter start and imports count.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAR_SECONDS = 60.0
"""The design's bar for llama3_405b.toml at 16,384 ranks."""

SHIPPED = [
    "16384:train_configs/llama3_405b.toml",
    "16384:train_configs/llama3_405b.toml:--parallelism.pp 16 --training.local_batch_size 16",
    "256:train_configs/llama3_70b.toml",
    "8:train_configs/llama3_8b.toml",
]


def parse_run(spec: str) -> tuple[int, str, list[str]]:
    """``NGPU:CONFIG[:OVERRIDES]`` -> (ngpu, config, override arguments)."""
    parts = spec.split(":", 2)
    if len(parts) < 2 or not parts[0].isdigit() or int(parts[0]) < 1:
        raise ValueError(f"--run: {spec!r} is not NGPU:CONFIG[:OVERRIDES], e.g. 8:train_configs/llama3_8b.toml")
    return int(parts[0]), parts[1], shlex.split(parts[2]) if len(parts) == 3 else []


def time_dry_run(ngpu: int, config: str, overrides: list[str]) -> tuple[float, int, str]:
    """(seconds, exit status, last output line) of one dry run."""
    env = dict(os.environ, DRY_RUN="1", NGPU=str(ngpu))
    env.setdefault("PYTHON", sys.executable)  # run_train.sh's interpreter: this one, unless PYTHON names another
    start = time.perf_counter()
    proc = subprocess.run(["./run_train.sh", "--config", config, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return seconds, proc.returncode, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", help="NGPU:CONFIG[:OVERRIDES] (repeatable; default: the shipped "
                    "configs at their scale)")
    args = ap.parse_args(argv)
    try:
        runs = [parse_run(s) for s in (args.run or SHIPPED)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'ranks':>6}  {'seconds':>7}  command")
    failed = 0
    for ngpu, config, overrides in runs:
        seconds, rc, last = time_dry_run(ngpu, config, overrides)
        command = " ".join([f"DRY_RUN=1 NGPU={ngpu} ./run_train.sh --config {config}", *overrides])
        note = "" if rc == 0 else f"   FAILED (exit {rc}): {last}"
        if rc == 0 and ngpu == 16384 and config.endswith("llama3_405b.toml") and not overrides:
            note = f"   ({'under' if seconds < BAR_SECONDS else 'OVER'} the {BAR_SECONDS:.0f} s bar)"
        print(f"{ngpu:>6}  {seconds:>7.1f}  {command}{note}", flush=True)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
