"""Tessera's runs beside the reference trainer's: median tokens/s after warm-up, peak memory, last loss, and the
ratios Tessera / reference.

    python3 bench/summarize.py RUNS [--only NAME,...] [--json FILE] [--csv FILE] [--memory-above RATIO]
    python3 bench/summarize.py RUN_FOLDER... [--skip N] [--steps N]

RUNS is bench/run.py's folder: tessera/NAME/metrics.jsonl for each configuration and reference/anchor_REF.log
for each reference run, paired as bench/matrix.toml says. A RUN_FOLDER (or its metrics.jsonl) is one Tessera
run alone, without a reference.

Both trainers log every few steps; each logged tps is the mean since the previous log. The medians take the
lines after --skip steps (default: the matrix's warm-up), on both sides. Memory is the peak *reserved* by the
caching allocator (what the reference logs) over those lines, and over the whole run (`whole`, the first
step's compilation included); Tessera's peak *active* memory is shown too. A run whose last logged step is
short of --steps is partial and gets no ratio; a configuration without metrics is "no result".

Exit status: 0, or 1 when no run has a result; with --memory-above, 0 when some run's memory ratio (after
warm-up or whole run) is above RATIO and 1 when none is.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import statistics
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
MATRIX = os.path.join(HERE, "matrix.toml")

# One set of keys for both trainers' summaries; a row of the table holds Tessera's under these names and the
# reference's under ref_<name>.
RUN_KEYS = ("steps", "tps", "tflops", "mfu", "active_gib", "reserved_gib", "run_reserved_gib", "last_loss",
            "partial")
CSV_COLUMNS = ("date", "time", "machine", "torch", "config", "reference", "steps", "tps", "tflops", "mfu",
               "active_gib", "reserved_gib", "run_reserved_gib", "last_loss", "ref_tps", "ref_mfu",
               "ref_reserved_gib", "ref_run_reserved_gib", "ref_last_loss", "tps_ratio", "memory_ratio",
               "run_memory_ratio", "estimate_gib", "note")
CSV_DIGITS = {"tps": 0, "tflops": 1, "mfu": 1, "active_gib": 2, "reserved_gib": 2, "run_reserved_gib": 2,
              "last_loss": 4, "ref_tps": 0, "ref_mfu": 1, "ref_reserved_gib": 2, "ref_run_reserved_gib": 2,
              "ref_last_loss": 4, "tps_ratio": 3, "memory_ratio": 3, "run_memory_ratio": 3, "estimate_gib": 2}


class NoResult(Exception):
    """A run with nothing to summarize; the message says why."""


def load_matrix(path: str = MATRIX) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _summary(rows: list[dict], skip: int, steps: int | None) -> dict:
    """The common summary of logged lines (dicts with step, tps, ... in RUN_KEYS' units)."""
    steady = [r for r in rows if r["step"] > skip and r.get("tps") is not None]
    if not steady:
        raise NoResult(f"no logged steps after the first {skip}")

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key, lines):
        values = [r[key] for r in lines if r.get(key) is not None]
        return max(values) if values else None

    return {
        "steps": f"{steady[0]['step']}-{steady[-1]['step']}",
        "tps": median("tps"),
        "tflops": median("tflops"),
        "mfu": median("mfu"),
        "active_gib": peak("active_gib", steady),
        "reserved_gib": peak("reserved_gib", steady),
        "run_reserved_gib": peak("reserved_gib", rows),
        "last_loss": steady[-1].get("loss"),
        "partial": steps is not None and rows[-1]["step"] < steps,
    }


def tessera_run(path: str, skip: int, steps: int | None = None) -> dict:
    """Summary of a Tessera run folder (or its metrics.jsonl)."""
    if os.path.isdir(path) or not path.endswith(".jsonl"):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise NoResult("no metrics.jsonl: skipped, or stopped before its first log")
    with open(path) as f:
        logged = [json.loads(line) for line in f if line.strip()]
    rows = [{"step": r["step"], "tps": r.get("tps_per_gpu", r.get("tps")), "tflops": r.get("tflops"),
             "mfu": r.get("mfu"), "active_gib": r.get("memory_gib"), "reserved_gib": r.get("memory_reserved_gib"),
             "loss": r.get("loss")} for r in logged]
    return _summary(rows, skip, steps)


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan's log line: "step: 15  loss:  6.1  grad_norm: 2.5  memory: 43.72GiB(31.27%)  tps: 30,172  tflops:
# 508.18  mfu: 51.38%" (its validation lines say "validate step:" and are not training steps).
STEP = re.compile(r"(?<!validate )step:\s*(\d+)\s")
FIELDS = {"loss": r"loss:\s*([\d.]+)", "reserved_gib": r"memory:\s*([\d.]+)\s*GiB", "tps": r"tps:\s*([\d,]+)",
          "tflops": r"tflops:\s*([\d,.]+)", "mfu": r"mfu:\s*([\d.]+)%"}


def reference_run(path: str, skip: int, steps: int | None = None) -> dict:
    """Summary of a reference log (anchor_REF.log), in the same keys as tessera_run's (no active memory)."""
    if not os.path.isfile(path):
        raise NoResult("no log: not run in this call")
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            m = STEP.search(line)
            if not m or "tps:" not in line:
                continue
            row = {"step": int(m.group(1))}
            for key, pattern in FIELDS.items():
                found = re.search(pattern, line)
                if found:
                    row[key] = float(found.group(1).replace(",", ""))
            rows.append(row)
    if not rows:
        raise NoResult("no logged step")
    return _summary(rows, skip, steps)


def compare(runs: str, name: str, matrix: dict, skip: int, steps: int | None) -> dict:
    """One row: configuration NAME of bench/run.py's folder RUNS beside its reference run."""
    config = matrix.get("config", {}).get(name, {})
    row = {"config": name, "reference": config.get("reference", "")}
    try:
        t = tessera_run(os.path.join(runs, "tessera", name), skip, steps)
    except (NoResult, OSError, KeyError, ValueError) as e:  # a truncated line too
        row["note"] = f"no result ({e})"
        return row
    row.update(t)
    notes = ["partial: stopped early"] if t["partial"] else []
    if row["reference"]:
        try:
            a = reference_run(os.path.join(runs, "reference", f"anchor_{row['reference']}.log"), skip, steps)
            row.update({f"ref_{k}": v for k, v in a.items() if k != "active_gib"})
            if a["partial"]:
                notes.append("reference partial: stopped early")
            elif not t["partial"]:  # a ratio only between two complete runs
                row["tps_ratio"] = _ratio(t["tps"], a["tps"])
                row["memory_ratio"] = _ratio(t["reserved_gib"], a["reserved_gib"])
                row["run_memory_ratio"] = _ratio(t["run_reserved_gib"], a["run_reserved_gib"])
        except (NoResult, OSError, ValueError) as e:
            notes.append(f"reference: {e}")
    row["note"] = "; ".join(notes)
    return row


def _ratio(a, b):
    return a / b if a and b else None


def memory_above(row: dict, bound: float) -> bool:
    """Whether the row's reserved memory is above ``bound`` times the reference's (after warm-up or whole run)."""
    return max(row.get("memory_ratio") or 0, row.get("run_memory_ratio") or 0) > bound


def _fmt(v, spec, unit=""):
    return "-" if v is None else format(v, spec) + unit


def table(rows: list[dict]) -> list[str]:
    header = (f"{'configuration':<22} {'tps':>8} {'TFLOP/s':>7} {'MFU':>6} {'active':>7} {'reserved':>8} "
              f"{'loss':>6} | {'reference':<13} {'tps':>8} {'reserved':>8} | {'tps ratio':>9} {'mem ratio':>9} "
              f"{'whole run':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if "tps" not in r:
            lines.append(f"{r['config']:<22} {r['note']}")
            continue
        lines.append(
            f"{r['config']:<22} {_fmt(r['tps'], ',.0f'):>8} {_fmt(r['tflops'], '.0f'):>7} "
            f"{_fmt(r['mfu'], '.1f', '%'):>6} {_fmt(r['active_gib'], '.2f', 'G'):>7} "
            f"{_fmt(r['reserved_gib'], '.2f', 'G'):>8} {_fmt(r['last_loss'], '.3f'):>6} | "
            f"{r['reference'] or '-':<13} {_fmt(r.get('ref_tps'), ',.0f'):>8} "
            f"{_fmt(r.get('ref_reserved_gib'), '.2f', 'G'):>8} | {_fmt(r.get('tps_ratio'), '.3f'):>9} "
            f"{_fmt(r.get('memory_ratio'), '.3f'):>9} {_fmt(r.get('run_memory_ratio'), '.3f'):>9}"
            + (f"  {r['note']}" if r.get("note") else ""))
    return lines


def csv_cells(row: dict, when: datetime.datetime, machine: str, torch_version: str) -> dict:
    """ROW as a CSV row: rounded figures, blanks for what is missing; WHEN: its last log (UTC)."""
    cells = {k: "" if row.get(k) is None else f"{row[k]:.{CSV_DIGITS[k]}f}" if k in CSV_DIGITS else row[k]
             for k in CSV_COLUMNS}
    return cells | {"date": when.strftime("%Y-%m-%d"), "time": when.strftime("%H:%M"), "machine": machine,
                    "torch": torch_version}


def write_csv(rows: list[dict], path: str, machine: str, torch_version: str, runs: str) -> None:
    """A row per run, appended (the header first if the file is new), dated by its metrics file (now if none)."""
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        out = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            out.writeheader()
        for r in rows:
            metrics = os.path.join(runs, "tessera", r["config"], "metrics.jsonl")
            stamp = os.path.getmtime(metrics) if os.path.exists(metrics) else datetime.datetime.now().timestamp()
            out.writerow(csv_cells(r, datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc), machine,
                                   torch_version))


def estimates(runs: str) -> dict[str, float]:
    """bench/memory_check.py --from-runs' estimate for each run, where the runner wrote it."""
    path = os.path.join(runs, "memory_runs.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["name"]: r["estimate_gib"] for r in json.load(f) if "estimate_gib" in r}


def _run_names(runs: str, matrix: dict) -> list[str]:
    """Every run folder under RUNS/tessera, in the matrix's order (others after, by name)."""
    order = list(matrix["config"])
    names = [d for d in os.listdir(os.path.join(runs, "tessera")) if os.path.isdir(os.path.join(runs, "tessera", d))]
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", metavar="RUNS_OR_RUN_FOLDER")
    p.add_argument("--only", default="", help="configurations, comma-separated (default: every run in RUNS)")
    p.add_argument("--matrix", default=MATRIX)
    p.add_argument("--skip", type=int, default=None, help="warm-up steps left out (default: the matrix's)")
    p.add_argument("--steps", type=int, default=None, help="steps asked for (default: the matrix's for RUNS)")
    p.add_argument("--json", default="", metavar="FILE")
    p.add_argument("--csv", default="", metavar="FILE", help="append a row per run")
    p.add_argument("--machine", default="", help="the GPU's name, for the CSV")
    p.add_argument("--torch", default="", help="torch's version, for the CSV")
    p.add_argument("--memory-above", type=float, default=None, metavar="RATIO")
    args = p.parse_args(argv)
    matrix = load_matrix(args.matrix)
    settings = matrix["settings"]
    skip = settings["warmup_steps_skipped"] if args.skip is None else args.skip
    rows = []
    for path in args.paths:
        if os.path.isdir(os.path.join(path, "tessera")):  # bench/run.py's folder
            steps = settings["steps"] if args.steps is None else args.steps
            names = [n for n in args.only.split(",") if n] or _run_names(path, matrix)
            found = estimates(path)
            here = [compare(path, name, matrix, skip, steps) | {"estimate_gib": found.get(name)} for name in names]
            if args.csv:
                write_csv(here, args.csv, args.machine, args.torch, path)
            rows += here
        else:  # one run folder, no reference
            row = {"config": os.path.basename(os.path.normpath(path)).removesuffix(".jsonl"), "reference": ""}
            try:
                row.update(tessera_run(path, skip, args.steps))
                row["note"] = "partial: stopped early" if row["partial"] else ""
            except (NoResult, OSError, KeyError, ValueError) as e:
                row["note"] = f"no result ({e})"
            rows.append(row)
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.memory_above is not None:
        return 0 if any(memory_above(r, args.memory_above) for r in rows) else 1
    return 0 if any("tps" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
