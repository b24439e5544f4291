"""Tessera's runs beside the reference trainer's (torchtitan 0.2.2, ../shared/bench/anchor): median tps,
TFLOP/s, MFU and peak memory after warm-up, and the ratios Tessera / reference.

    python bench/compare_reference.py --tessera DIR --anchor DIR [--labels T_LABEL,...]
        [--pairs T_LABEL=A_LABEL,...] [--skip 10] [--anchor-skip SKIP] [--steps N] [--json FILE]
        [--memory-above RATIO]

DIR for Tessera holds one run folder per label (LABEL/metrics.jsonl, bench/summarize.py's input); DIR for the
reference holds anchor_LABEL.log files (bench/perf_vs_reference.sh and .anchor/run_anchor.sh write them).
The reference logs every 5 steps a line ``step: N loss: .. memory: X GiB(..%) tps: N tflops: N mfu: N%``
with tps averaged since the previous log and memory the peak *reserved* by the caching allocator. Medians
are taken over Tessera's lines after ``--skip`` steps and the reference's after ``--anchor-skip`` (by default
the same: the windows after step 10 on both sides, as bench/perf_vs_reference.sh's protocol has them). A
label of ``--labels`` with no metrics.jsonl (skipped, or stopped before its first log) is a row ``no result``.
With ``--steps`` (the steps both trainers were asked for), a run whose last logged step is short of it
(stopped by a time limit or an error) is marked partial and gets no ratio. Tessera's memory is printed both
ways, peak active and peak reserved; the ratio uses reserved, as the reference reports: after warm-up (the
windows the medians take), and over the whole run (every logged window, the first step's compilation
included). With ``--memory-above RATIO`` the exit status says whether either of a pair's memory ratios is
above RATIO (0) or none is (1): bench/perf_vs_reference.sh asks it whether a pair's memory needs the fix tried.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from summarize import NoResult, summarize  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELDS = {
    "step": r"step:\s*(\d+)",
    "memory_gib": r"memory:\s*([\d.]+)\s*GiB",
    "tps": r"tps:\s*([\d,]+)",
    "tflops": r"tflops:\s*([\d,.]+)",
    "mfu": r"mfu:\s*([\d.]+)%",
}


def parse_anchor_log(path: str) -> list[dict]:
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            if not re.search(r"(?<!validate )step:\s*\d+\s", line) or "tps:" not in line:
                continue  # not a training step's line (torchtitan's validation lines say "validate step:")
            row = {}
            for key, pattern in FIELDS.items():
                m = re.search(pattern, line)
                if m:
                    row[key] = float(m.group(1).replace(",", ""))
            if "step" in row and "tps" in row:
                rows.append(row)
    return rows


def summarize_anchor(path: str, skip: int, steps: int | None = None) -> dict | None:
    if not os.path.exists(path):
        return None
    every = parse_anchor_log(path)
    rows = [r for r in every if r["step"] > skip]
    if not rows:
        return None

    def median(key):
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    return {
        "steps": f"{int(rows[0]['step'])}-{int(rows[-1]['step'])}",
        "tps": median("tps"),
        "tflops": median("tflops"),
        "mfu": median("mfu"),
        "peak_reserved_gib": max(r.get("memory_gib", 0.0) for r in rows),
        "run_peak_reserved_gib": max(r.get("memory_gib", 0.0) for r in every),
        "partial": steps is not None and every[-1]["step"] < steps,
    }


def _fmt(v, f):
    return "-" if v is None else format(v, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tessera", required=True)
    p.add_argument("--anchor", required=True)
    p.add_argument("--labels", default="", help="Tessera labels, comma-separated (default: every run folder)")
    p.add_argument("--pairs", default="", help="TESSERA_LABEL=ANCHOR_LABEL,... (runs compared with each other)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of Tessera's medians")
    p.add_argument("--anchor-skip", type=int, default=None, help="the same for the reference (default: --skip)")
    p.add_argument("--steps", type=int, default=None, help="steps both trainers were asked for (partial runs)")
    p.add_argument("--json", default="")
    p.add_argument("--memory-above", type=float, default=None,
                   help="exit 0 if a pair's memory ratio (after warm-up or whole run) is above this, 1 if none is")
    args = p.parse_args(argv)
    if args.anchor_skip is None:  # both trainers' medians over the same windows
        args.anchor_skip = args.skip
    pairs = dict(kv.split("=", 1) for kv in args.pairs.split(",") if kv)
    labels = [x for x in args.labels.split(",") if x] or sorted(
        d for d in os.listdir(args.tessera) if os.path.exists(os.path.join(args.tessera, d, "metrics.jsonl"))
    )
    results = []
    header = (f"{'Tessera config':<22} {'tps':>8} {'TFLOP/s':>8} {'MFU':>6} {'active':>7} {'reserved':>8} | "
              f"{'reference':<16} {'tps':>8} {'MFU':>6} {'reserved':>8} | {'tps ratio':>9} {'memory ratio':>12} "
              f"{'whole run':>9}")
    print(header)
    print("-" * len(header))
    for label in labels:
        run = os.path.join(args.tessera, label)
        try:
            t = summarize(run, args.skip, args.steps)
        except (NoResult, OSError, KeyError, ValueError) as e:  # a truncated line too
            print(f"{label:<22} no result ({e})")
            results.append({"label": label, "error": str(e)})
            continue
        a_label = pairs.get(label)
        a = (summarize_anchor(os.path.join(args.anchor, f"anchor_{a_label}.log"), args.anchor_skip, args.steps)
             if a_label else None)
        whole = not t["partial"] and not (a and a["partial"])  # a ratio only between two complete runs
        tps_ratio = t["tps_per_gpu"] / a["tps"] if whole and a and t["tps_per_gpu"] and a["tps"] else None
        mem_ratio, run_mem_ratio = (
            (t[key] / a[key] if whole and a and a[key] and t[key] else None)
            for key in ("peak_reserved_gib", "run_peak_reserved_gib"))
        print(f"{label:<22} {_fmt(t['tps_per_gpu'], ',.0f'):>8} {_fmt(t['tflops'], '.0f'):>8} "
              f"{_fmt(t['mfu'], '.1f'):>5}% {t['peak_memory_gib']:>6.1f}G {t['peak_reserved_gib']:>7.1f}G | "
              f"{(a_label or '-') if a else (a_label + ' (none)' if a_label else '-'):<16} "
              f"{_fmt(a['tps'] if a else None, ',.0f'):>8} {_fmt(a['mfu'] if a else None, '.1f'):>5}% "
              f"{_fmt(a['peak_reserved_gib'] if a else None, '.1f'):>7}G | {_fmt(tps_ratio, '.3f'):>9} "
              f"{_fmt(mem_ratio, '.3f'):>12} {_fmt(run_mem_ratio, '.3f'):>9}"
              + (f"  PARTIAL: {'Tessera' if t['partial'] else 'reference'} run stopped early" if not whole else ""))
        results.append({"label": label, "tessera": t, "reference_label": a_label, "reference": a,
                        "tps_ratio": tps_ratio, "memory_ratio": mem_ratio, "run_memory_ratio": run_mem_ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.memory_above is not None:
        return 0 if any(max(r.get("memory_ratio") or 0, r.get("run_memory_ratio") or 0) > args.memory_above
                        for r in results) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
