"""Plot a run's metrics.jsonl to PNG files.

    python -m engine.plot RUN_DIR_OR_JSONL [--out DIR]

Writes ``loss.png`` (loss, with the validation loss where the run validated, grad norm and learning rate vs
step) and ``throughput.png`` (tokens/s per GPU, MFU when known, peak memory vs step) and prints their paths.
Uses matplotlib's Agg canvas directly, so no display and no global backend change are needed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.config import ArgumentParser


class MetricsFileError(ValueError):
    """The metrics file is missing, empty or not valid JSONL; the message names the file (and line)."""


def is_validation_record(rec: dict) -> bool:
    """A validation result (engine.metrics.MetricsLogger.log_validation): step, validation_loss, validation_s and
    time, without the training record's ``loss``."""
    return "loss" not in rec and "validation_loss" in rec


def read_run_metrics(jsonl_path: str) -> tuple[list[dict], list[dict]]:
    """Read a metrics JSONL file: (the training records, one per logged step, and the validation records, one per
    validation), each sorted by step. A resumed run appends to the file from its checkpoint's step on: a training
    record whose step is not after the record before it (a validation record: one whose step is before it) starts
    a new segment, which replaces every earlier record, of both kinds, from that step on (those of a run that went
    on past its last checkpoint, or of a continuation abandoned for an earlier checkpoint). A training record
    that carries validation_loss (files of older versions) also gives a validation record, at its
    ``validation_step``. A last line without its newline that is not valid JSON is a record whose write was cut
    short (the run crashed, or the disk was full) and is left out. Raises MetricsFileError for a missing, empty
    or corrupt file, or one with no training record."""
    if not os.path.isfile(jsonl_path):
        raise MetricsFileError(f"{jsonl_path}: file not found")
    train: dict[int, dict] = {}
    validation: dict[int, dict] = {}
    previous = None
    try:
        with open(jsonl_path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MetricsFileError(f"{jsonl_path}: cannot read ({e})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):  # torn: the writer stopped mid-record
                break
            raise MetricsFileError(f"{jsonl_path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise MetricsFileError(f"{jsonl_path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise MetricsFileError(f"{jsonl_path}:{lineno}: record has no integer 'step'")
        is_validation = is_validation_record(rec)
        if previous is not None and (step < previous or (step == previous and not is_validation)):
            train = {k: v for k, v in train.items() if k < step}  # a resumed run's first record
            validation = {k: v for k, v in validation.items() if k < step}
        if is_validation:
            validation[step] = rec
        else:
            train[step] = rec
            if "validation_loss" in rec:  # older files: the last validation rode on the next log's record
                at = rec.get("validation_step", step)
                validation[at] = {"step": at, "validation_loss": rec["validation_loss"]}
        previous = step
    if not train:
        raise MetricsFileError(f"{jsonl_path}: no metrics records (empty file)")
    return [train[s] for s in sorted(train)], [validation[s] for s in sorted(validation)]


def read_metrics(jsonl_path: str) -> list[dict]:
    """The training records of a metrics JSONL file, one per logged step, sorted by step (read_run_metrics)."""
    return read_run_metrics(jsonl_path)[0]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it is a number (None / missing skipped)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _panel(ax, series: list[tuple[list[dict], str, str]], ylabel: str, logy: bool = False) -> bool:
    """Draw each (records, key, label) of ``series`` on ``ax``; "no data" where none has a number."""
    drawn = False
    for records, key, label in series:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif logy and all(y > 0 for records, k, _ in series for y in _series(records, k)[1] if math.isfinite(y)):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn and len(series) > 1:
        ax.legend(loc="best", fontsize="small")
    return drawn


def _has(records: list[dict], key: str) -> bool:
    return bool(_series(records, key)[0])


def _save(fig: Figure, path: str) -> str:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_metrics(jsonl_path: str, out_dir: str) -> list[str]:
    """Draw loss.png and throughput.png (and experts.png for a MoE model) from ``jsonl_path`` into ``out_dir``;
    return the PNG paths."""
    records, validation = read_run_metrics(jsonl_path)
    os.makedirs(out_dir, exist_ok=True)
    title = os.path.basename(os.path.dirname(os.path.abspath(jsonl_path))) or jsonl_path
    paths = []

    fig = Figure(figsize=(8, 9))
    axes = fig.subplots(3, 1, sharex=True)
    loss_series = [(records, "loss", "training loss")]
    if _has(validation, "validation_loss"):
        loss_series.append((validation, "validation_loss", "validation loss"))
    _panel(axes[0], loss_series, "loss")
    _panel(axes[1], [(records, "grad_norm", "grad norm")], "grad norm", logy=True)
    _panel(axes[2], [(records, "lr", "lr")], "learning rate")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{title}: loss")
    paths.append(_save(fig, os.path.join(out_dir, "loss.png")))

    panels = [("tps", [("tps_per_gpu", "tokens/s per GPU")], "tokens/s per GPU")]
    if _has(records, "mfu"):
        panels.append(("mfu", [("mfu", "MFU %")], "MFU (%)"))
    panels.append(("mem", [("memory_gib", "peak active / RSS"), ("memory_reserved_gib", "peak reserved")], "memory (GiB)"))
    fig = Figure(figsize=(8, 3 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (_, keys, ylabel) in zip(axes, panels):
        _panel(ax, [(records, key, label) for key, label in keys], ylabel)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{title}: throughput")
    paths.append(_save(fig, os.path.join(out_dir, "throughput.png")))

    if _has(records, "expert_load_max"):  # a Mixture-of-Experts model
        fig = Figure(figsize=(8, 6))
        axes = fig.subplots(2, 1, sharex=True)
        _panel(axes[0], [(records, "expert_load_max", "busiest expert / mean (worst layer)")], "expert load")
        _panel(axes[1], [(records, "moe_aux_loss", "auxiliary loss")], "auxiliary loss")
        axes[-1].set_xlabel("step")
        fig.suptitle(f"{title}: experts")
        paths.append(_save(fig, os.path.join(out_dir, "experts.png")))
    return paths


def plot_run(folder: str) -> list[str]:
    """The end of a training run: draw ``<folder>/metrics.jsonl`` into ``folder`` and print the paths; returns
    them. A file with no records (nothing was left to train) draws nothing. The run's work is done and saved by
    then, so a failure here is one ``warning:`` line, never an error of the run."""
    jsonl = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(jsonl) or os.path.getsize(jsonl) == 0:
        return []
    try:
        paths = plot_metrics(jsonl, folder)
    except Exception as e:  # plots are a by-product: whatever stops them must not fail a finished run
        reason = " ".join(str(e).split()) or type(e).__name__
        print(f"warning: plots not drawn ({reason}); the run itself is complete", flush=True)
        return []
    print(f"plots: {', '.join(paths)}", flush=True)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m engine.plot", description="Plot a Tessera run's metrics.jsonl.")
    parser.add_argument("path", metavar="RUN_DIR_OR_JSONL", help="a run folder (its metrics.jsonl) or a .jsonl file")
    parser.add_argument("--out", default=None, help="output folder (default: the folder of the jsonl)")
    args = parser.parse_args(argv)

    jsonl = os.path.join(args.path, "metrics.jsonl") if os.path.isdir(args.path) else args.path
    out = args.out if args.out is not None else (os.path.dirname(os.path.abspath(jsonl)))
    try:
        paths = plot_metrics(jsonl, out)
    except MetricsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder
        print(f"error: --out: cannot write plots to '{out}' ({e.strerror or e})", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
