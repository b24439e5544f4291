"""Scaling experiments: one dimension at a time, one run per value, one CSV and PNG plots.

    python -m tools.sweep --config base.toml --dim parallelism.tp --values 1,2,4 --ngpu 4 \\
        [--launcher local|sbatch] [--nodes N] [--steps N] [--warmup K] [--out folder] [--section.key value ...]
    python -m tools.sweep --collect --out folder      # gather finished runs again (after sbatch)

For each value the tool writes ``<out>/configs/<value>.toml``: the base config with the ``--section.key
value`` overrides, ``--dim`` set to the value, ``parallelism.dp_shard = -1`` (when the dimension is another
parallel degree, so the degrees still multiply to the world size), ``training.steps`` from ``--steps`` and
``job.dump_folder = <out>/<value>``. Every config is validated for the world (``--ngpu`` x ``--nodes``)
before anything runs: a user error is one ``error:`` line and exit status 2. Folders relative to the run's
folder (checkpoint.folder, the profiler's) stay relative, so each run has its own; an absolute one in use is
refused, since every run would share it (and resume the previous run's checkpoint).

Launchers:
- local: ``NGPU=<ngpu> ./run_train.sh --config <out>/configs/<value>.toml`` for each value in turn (its output
  in ``<out>/logs/<value>.log``);
- sbatch: renders ``<out>/sbatch/<value>.sbatch`` (tools/slurm.py; ``--nodes`` x ``--ngpu``) and submits
  it; run ``--collect`` when the jobs are done. ``sbatch`` must be on PATH (checked before anything is written).

Then it reads each run's metrics.jsonl (keys step, loss, tps, tps_per_gpu, tflops, mfu, memory_gib, as
engine/metrics.py writes them), leaves out the records of the first ``--warmup`` steps (default: the first
half, at most 5), and writes ``<out>/sweep.csv`` (one row per run: the medians of tps, tps_per_gpu, tflops and
mfu, the largest memory_gib and the last loss) and ``<out>/tps_per_gpu.png``, ``mfu.png``, ``memory.png``
against the value of the dimension.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from engine.config import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
CSV_FIELDS = ["dim", "value", "status", "world_size", "layout", "steps_measured", "tps", "tps_per_gpu", "tflops",
              "mfu", "memory_gib", "last_loss", "run_folder"]
PLOTS = (("tps_per_gpu", "tokens/s per GPU (median)", "tps_per_gpu.png"),
         ("mfu", "MFU % (median)", "mfu.png"),
         ("memory_gib", "peak memory GiB (max)", "memory.png"))


@dataclass
class Run:
    """One value of the sweep."""

    value: str
    config_path: str
    run_folder: str
    world_size: int
    layout: str
    status: str = "not run"


# --------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------


def run_configs(base: str, dim: str, values: list[str], overrides: list[str], steps: Optional[int], out: str,
                world_size: int, cluster: bool = False) -> list[Run]:
    """Validate one config per value, then write them all; raises ConfigError (naming the field) before anything
    is written. ``cluster``: the runs go to sbatch, so they are validated for the cluster's GPUs (Hopper), not
    this machine. A value whose run folder already holds a run is refused: its metrics would mix with the new
    run's (and its checkpoints would be resumed)."""
    from engine.config import ConfigError, parse_args, set_value, to_toml
    from engine.config.validation import HOPPER, validate
    from engine.data.datasets import check_data_config
    from parallelize.mesh import ParallelDims

    section, _, name = dim.partition(".")
    runs, configs = [], []
    for value in values:
        if not value or "/" in value or value.startswith("."):
            raise ConfigError(f"--values: {value!r} cannot name a run folder; give plain values such as 1,2,4")
        cfg = parse_args((["--config", base] if base else []) + overrides)
        set_value(cfg, dim, value, from_cli=True)
        if section == "parallelism" and name in DEGREES and name != "dp_shard":
            cfg.parallelism.dp_shard = -1
        if steps is not None:
            cfg.training.steps = steps
            cfg.lr_scheduler.warmup_steps = min(cfg.lr_scheduler.warmup_steps, steps)
        cfg.job.dump_folder = os.path.join(os.path.abspath(out), value)
        _refuse_shared_run_folders(cfg)
        if os.path.isdir(cfg.job.dump_folder) and os.listdir(cfg.job.dump_folder):
            raise ConfigError(f"--out: {cfg.job.dump_folder} holds an earlier run; give another --out, or remove it "
                              "(python -m tools.sweep --collect --out ... reads what is there)")
        try:
            validate(cfg, world_size, HOPPER if cluster else None)
            check_data_config(cfg)
        except ConfigError as e:
            raise ConfigError(f"{dim} = {value}: {e}") from None
        layout = ParallelDims.from_config(cfg.parallelism, world_size).describe()
        _absolute_input_paths(cfg)
        configs.append((value, cfg, layout))
    config_dir = os.path.join(out, "configs")
    os.makedirs(config_dir, exist_ok=True)
    for value, cfg, layout in configs:
        path = os.path.join(config_dir, f"{value}.toml")
        with open(path, "w") as f:
            f.write(to_toml(cfg))
        runs.append(Run(value, path, cfg.job.dump_folder, world_size, layout))
    return runs


# Path fields relative to the run's own folder (job.dump_folder is made absolute above), not to the caller's.
RUN_RELATIVE_FIELDS = ("job.dump_folder", "checkpoint.folder", "profiling.save_traces_folder",
                       "profiling.save_memory_snapshot_folder")


def _refuse_shared_run_folders(cfg) -> None:
    """An absolute checkpoint or profiler folder (in use) would be one folder for every run of the sweep: each run
    would resume the previous run's last checkpoint (and have nothing left to train), or mix its traces into the
    previous run's. Raises ConfigError naming the field and the fix."""
    from engine.config import ConfigError

    in_use = {"checkpoint.folder": cfg.checkpoint.enable,
              "profiling.save_traces_folder": cfg.profiling.enable_profiling,
              "profiling.save_memory_snapshot_folder": cfg.profiling.enable_memory_snapshot}
    for key, used in in_use.items():
        section, name = key.split(".")
        folder = getattr(getattr(cfg, section), name)
        if used and os.path.isabs(folder):
            raise ConfigError(f"{key}: '{folder}' is absolute, so every run of the sweep would share it (a run would "
                              f"resume or overwrite the previous run's); give a folder relative to the run folder, "
                              f"such as {getattr(type(getattr(cfg, section))(), name)!r} (the default), which each "
                              f"run keeps in <out>/<value>/")


def _absolute_input_paths(cfg) -> None:
    """Make the relative input paths of ``cfg`` (its path fields but RUN_RELATIVE_FIELDS) absolute, as validated
    here: its runs start elsewhere (in the checkout, or on a cluster's node), where they would name other files or
    none."""
    from engine.config import PATH_FIELDS

    for key in sorted(PATH_FIELDS.difference(RUN_RELATIVE_FIELDS)):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and not os.path.isabs(value) and os.path.exists(value):
            setattr(getattr(cfg, section), name, os.path.abspath(value))


# --------------------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------------------


def launch_local(run: Run, ngpu: int, out: str) -> None:
    """``NGPU=ngpu ./run_train.sh --config ...``; the output goes to <out>/logs/<value>.log."""
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    log = os.path.join(out, "logs", f"{run.value}.log")
    env = dict(os.environ, NGPU=str(ngpu), PYTHON=os.environ.get("PYTHON", sys.executable))
    env.pop("DRY_RUN", None)
    with open(log, "w") as f:
        proc = subprocess.run([os.path.join(ROOT, "run_train.sh"), "--config", os.path.abspath(run.config_path)],
                              cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    run.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}, see {log})"
    print(f"  {run.value}: {run.status}", flush=True)


def launch_sbatch(run: Run, nodes: int, ngpu: int, out: str, job_name: str) -> None:
    """Render the multi-node sbatch script for this run and submit it."""
    from tools.slurm import JobSpec, render

    folder = os.path.join(out, "sbatch")
    os.makedirs(folder, exist_ok=True)
    script = os.path.join(folder, f"{run.value}.sbatch")
    spec = JobSpec(nodes=nodes, gpus_per_node=ngpu, config=os.path.abspath(run.config_path),
                   job_name=f"{job_name}-{run.value}", dump_folder=os.path.abspath(run.run_folder), workdir=ROOT,
                   fixed=True)
    with open(script, "w") as f:
        f.write(render(spec))
    try:
        proc = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True)
    except OSError as e:  # gone since main checked PATH
        proc = subprocess.CompletedProcess(e.filename, 1, "", e.strerror or str(e))
    if proc.returncode == 0:
        run.status = f"submitted (job {proc.stdout.strip()})"
    else:
        run.status = f"sbatch failed: {' '.join(proc.stderr.split())}"
    print(f"  {run.value}: {run.status}", flush=True)


# --------------------------------------------------------------------------------------------------------
# Gathering
# --------------------------------------------------------------------------------------------------------


def _median(records: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def summarize_run(run_folder: str, warmup: Optional[int]) -> dict:
    """Medians of one run's metrics after warm-up; {} when it has no metrics."""
    from engine.plot import MetricsFileError, read_metrics

    try:
        records = read_metrics(os.path.join(run_folder, "metrics.jsonl"))
    except MetricsFileError:
        return {}
    last_step = records[-1]["step"]
    skip = min(5, last_step // 2) if warmup is None else warmup
    steady = [r for r in records if r["step"] > skip] or records[-1:]
    memory = [r["memory_gib"] for r in steady if isinstance(r.get("memory_gib"), (int, float))]
    return {
        "steps_measured": f"{steady[0]['step']}-{steady[-1]['step']}",
        "tps": _median(steady, "tps"),
        "tps_per_gpu": _median(steady, "tps_per_gpu"),
        "tflops": _median(steady, "tflops"),
        "mfu": _median(steady, "mfu"),
        "memory_gib": max(memory) if memory else None,
        "last_loss": steady[-1].get("loss"),
    }


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})


def plot(rows: list[dict], dim: str, out: str) -> list[str]:
    """One PNG per metric against the dimension's value (categorical when the values are not numbers)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [str(r["value"]) for r in rows]
    try:
        xs = [float(v) for v in labels]
    except ValueError:
        xs = list(range(len(labels)))
    paths = []
    for key, ylabel, filename in PLOTS:
        fig = Figure(figsize=(5.5, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        points = [(x, r[key]) for x, r in zip(xs, rows) if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel(dim)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{ylabel} vs {dim}", fontsize="medium")
        fig.tight_layout()
        path = os.path.join(out, filename)
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def collect(out: str, warmup: Optional[int]) -> tuple[list[dict], list[str]]:
    """Gather the runs listed in <out>/sweep.json into <out>/sweep.csv and the plots."""
    with open(os.path.join(out, "sweep.json")) as f:
        meta = json.load(f)
    rows = []
    for run in meta["runs"]:
        row = {"dim": meta["dim"], **{k: run[k] for k in ("value", "status", "world_size", "layout", "run_folder")}}
        summary = summarize_run(run["run_folder"], warmup)
        if not run["status"].startswith(("failed", "sbatch failed")):
            row["status"] = "ok" if summary else "no metrics"
        row.update(summary)
        rows.append(row)
    write_csv(rows, os.path.join(out, "sweep.csv"))
    return rows, plot(rows, meta["dim"], out)


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m tools.sweep", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False,
                       epilog="Other --section.key value arguments override the base config for every run.")
    p.add_argument("--config", default="", help="base TOML (default: the built-in defaults)")
    p.add_argument("--dim", help="the config key to sweep, e.g. parallelism.tp")
    p.add_argument("--values", help="comma-separated values of --dim, e.g. 1,2,4")
    p.add_argument("--ngpu", type=int, default=1, help="GPUs (processes) per node of every run")
    p.add_argument("--nodes", type=int, default=1, help="nodes per run (sbatch)")
    p.add_argument("--launcher", choices=("local", "sbatch"), default="local")
    p.add_argument("--steps", type=int, default=None, help="training.steps of every run")
    p.add_argument("--warmup", type=int, default=None,
                   help="leave out the records of steps <= this (default: the first half, at most 5)")
    p.add_argument("--out", default="outputs/sweep", help="folder for configs, runs, CSV and plots")
    p.add_argument("--job-name", default="sweep", help="sbatch job name prefix")
    p.add_argument("--collect", action="store_true", help="only gather the runs of --out into the CSV and plots")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from engine.config import ConfigError

    args, overrides = _parser().parse_known_args(argv)
    out = args.out
    try:
        if args.collect:
            if not os.path.isfile(os.path.join(out, "sweep.json")):
                raise ConfigError(f"--out: {out} holds no sweep (sweep.json); run a sweep first")
            rows, paths = collect(out, args.warmup)
            _report(rows, paths, out)
            return 0
        if not args.dim or not args.values:
            raise ConfigError("--dim and --values are required, e.g. --dim parallelism.tp --values 1,2,4")
        if args.ngpu < 1 or args.nodes < 1:
            raise ConfigError("--ngpu and --nodes must be >= 1")
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
        if args.launcher == "local" and args.nodes != 1:
            raise ConfigError("--nodes: the local launcher runs on this machine only; use --launcher sbatch")
        if args.launcher == "sbatch" and shutil.which("sbatch") is None:
            raise ConfigError("--launcher: sbatch is not on PATH (no SLURM client here); run the sweep on the "
                              "cluster's login node, or use --launcher local")
        values = [v.strip() for v in args.values.split(",") if v.strip()]
        if len(set(values)) != len(values):
            raise ConfigError(f"--values: {args.values!r} repeats a value")
        runs = run_configs(args.config, args.dim, values, overrides, args.steps, out, args.ngpu * args.nodes,
                           cluster=args.launcher == "sbatch")
    except ValueError as e:  # ConfigError is one
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2

    print(f"sweep of {args.dim} over {', '.join(values)} on {args.nodes} x {args.ngpu} GPU(s) ({args.launcher}):",
          flush=True)
    for run in runs:
        if args.launcher == "local":
            launch_local(run, args.ngpu, out)
        else:
            launch_sbatch(run, args.nodes, args.ngpu, out, args.job_name)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"dim": args.dim, "runs": [vars(r) for r in runs]}, f, indent=1)
    if args.launcher == "sbatch":
        print(f"submitted; when the jobs are done: python -m tools.sweep --collect --out {out}")
        return 0
    rows, paths = collect(out, args.warmup)
    _report(rows, paths, out)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _report(rows: list[dict], paths: list[str], out: str) -> None:
    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    print(f"{'value':>8}  {'status':<10}  {'tps/gpu':>10}  {'tflops':>8}  {'mfu %':>6}  {'mem GiB':>8}  layout")
    for r in rows:
        print(f"{r['value']:>8}  {r['status'][:10]:<10}  {fmt(r.get('tps_per_gpu'), ',.0f'):>10}  "
              f"{fmt(r.get('tflops'), '.3f'):>8}  {fmt(r.get('mfu'), '.2f'):>6}  {fmt(r.get('memory_gib'), '.2f'):>8}  "
              f"{r['layout']}")
    print(f"csv: {os.path.join(out, 'sweep.csv')}")
    print(f"plots: {', '.join(paths)}")


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
