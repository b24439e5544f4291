"""Summarize a run's metrics.jsonl: median tps, TFLOP/s, MFU and the peak memory after warm-up (and the peak
reserved memory over the whole run, its first steps included).

    python bench/summarize.py RUN_DIR_OR_JSONL [--skip N] [--steps S]

N: warm-up steps left out (default 5). S: the steps the run was asked for; a run whose last logged step is
short of it (killed by a time limit, out of memory) is marked partial. A run with nothing to summarize (no
metrics.jsonl: skipped, or stopped before its first log; or no logged step after the warm-up) prints
``no result`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


class NoResult(Exception):
    """A run with nothing to summarize; the message says why."""


def summarize(path: str, skip: int = 5, steps: int | None = None) -> dict:
    if os.path.isdir(path) or not path.endswith(".jsonl"):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise NoResult("no metrics.jsonl: skipped, or stopped before its first log")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steady = [r for r in rows if r["step"] > skip and r.get("tps") is not None]
    if not steady:
        raise NoResult(f"no logged steps after the first {skip}")

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "steps": f"{steady[0]['step']}-{steady[-1]['step']}",
        "tps_per_gpu": median("tps_per_gpu"),
        "tflops": median("tflops"),
        "mfu": median("mfu"),
        "peak_memory_gib": max(r["memory_gib"] for r in steady),
        "peak_reserved_gib": max((r.get("memory_reserved_gib") or 0) for r in steady),
        "run_peak_reserved_gib": max((r.get("memory_reserved_gib") or 0) for r in rows),
        "last_loss": steady[-1]["loss"],
        "partial": steps is not None and rows[-1]["step"] < steps,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="the steps asked for: fewer logged = partial")
    args = p.parse_args(argv)
    try:
        s = summarize(args.path, args.skip, args.steps)
    except NoResult as e:
        print(f"{args.path}: no result ({e})")
        return 1
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    print(
        f"{args.path}: steps {s['steps']}  median tps/gpu {fmt(s['tps_per_gpu'], ',.0f')}  "
        f"TFLOP/s {fmt(s['tflops'], '.1f')}  MFU {fmt(s['mfu'], '.1f')}%  peak memory "
        f"{s['peak_memory_gib']:.1f} GiB (reserved {s['peak_reserved_gib']:.1f}; whole run "
        f"{s['run_peak_reserved_gib']:.1f})  last loss {s['last_loss']:.3f}{'  PARTIAL (stopped early)' if s['partial'] else ''}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
