"""Measured peak GPU memory beside tools/memory.py's estimate, for single-GPU configurations.

    python3 bench/memory_check.py [--steps 8] [--only NAME,...] [--out DIR] [--runs DIR] [--budget S]
                                  [--estimate-only]
    python3 bench/memory_check.py --from-runs DIR [--labels NAME,...] [--out DIR]

On the GPU machine (one device call; .whl carried for the packages it lacks, see bench/common.sh):

    source bench/common.sh && python3 bench/memory_check.py --out "$OUT"

Each configuration trains Llama-3-8B layer shapes (flavor 8B_L8, or 8B_L2) on the built-in corpus for
``--steps`` steps, bf16, sdpa, local batch 1, in this process (one after the other, memory released in
between), with metrics logged every step. Reported per configuration:
- measured: torch.cuda.max_memory_allocated over the whole run (read before each of the trainer's per-log
  resets of the peak statistics), and the largest ``memory_gib`` of metrics.jsonl (the peak active bytes of
  each logging window, what the trainer reports);
- estimate: the largest per-rank peak of tools.memory for the same config, and the moment it is at;
- ratio = estimate / measured allocated.
The table is printed and written to <out>/memory_check.md and .json (two files: the device returns at most 8),
rewritten after every configuration, so that a call stopped at its time limit still returns the rows done; a
configuration that would start after ``--budget`` seconds is skipped and named. The run folders go under
``--runs`` and stay on the machine. ``--estimate-only`` prints the estimates without training (no GPU needed).

``--from-runs DIR`` trains nothing: for every single-GPU run folder under DIR (its config.toml and
metrics.jsonl, e.g. bench/run.py's runs) it sets the largest logged ``memory_gib`` (the peak
active bytes of each logging window, the first step's included) beside the estimate for that run's config, and
writes <out>/memory_runs.md and .json (runs that peaked under 1 GiB, the debug model's, are left out). So every
benchmark run is also a memory check, at no device time. ``--labels`` names the run folders to read, in order
(the runs of the calling script's call: DIR may still hold an earlier call's on the same machine); one with no
config.toml or metrics.jsonl (skipped, or stopped before its first log) is a row ``no result``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GIB = 1024**3
COMMON = ["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "1",
          "--training.mixed_precision_param", "bfloat16", "--model.attn", "sdpa", "--metrics.log_freq", "1",
          "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-4"]
CONFIGS: dict[str, list[str]] = {
    "8B_L8 seq4096 AC none": ["--model.flavor", "8B_L8", "--training.seq_len", "4096"],
    "8B_L8 seq8192 AC none": ["--model.flavor", "8B_L8", "--training.seq_len", "8192"],
    "8B_L8 seq8192 AC full": ["--model.flavor", "8B_L8", "--training.seq_len", "8192",
                              "--activation_checkpoint.mode", "full"],
    "8B_L8 seq8192 AC op": ["--model.flavor", "8B_L8", "--training.seq_len", "8192",
                            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option",
                            "op"],
    "8B_L8 seq8192 AC every 2": ["--model.flavor", "8B_L8", "--training.seq_len", "8192",
                                 "--activation_checkpoint.mode", "selective",
                                 "--activation_checkpoint.selective_option", "2"],
    "8B_L2 seq8192 AC none": ["--model.flavor", "8B_L2", "--training.seq_len", "8192"],
    "8B_L8 seq8192 AC op, FSDP on 1 GPU": ["--model.flavor", "8B_L8", "--training.seq_len", "8192",
                                           "--activation_checkpoint.mode", "selective",
                                           "--parallelism.fsdp_single_rank"],
    "8B_L8 seq8192 AC op, fused loss 2048": ["--model.flavor", "8B_L8", "--training.seq_len", "8192",
                                             "--activation_checkpoint.mode", "selective",
                                             "--training.loss_chunk_tokens", "2048"],
    # compiled (the blocks and the loss): the formulas of their own in tools/memory.py
    "8B_L8 seq8192 AC none, compile": ["--model.flavor", "8B_L8", "--training.seq_len", "8192", "--compile.enable"],
    "8B_L8 seq8192 AC op, compile": ["--model.flavor", "8B_L8", "--training.seq_len", "8192", "--compile.enable",
                                     "--activation_checkpoint.mode", "selective"],
}


def estimate(argv: list[str]) -> tuple[int, str]:
    """(bytes, moment) of tools.memory's largest per-rank peak for this single-GPU config."""
    from engine.config import parse_args
    from tools import memory

    cfg = parse_args(argv)
    dims = memory.validate_layout(cfg, 1)
    rows = memory.analytic_rows(cfg, dims, memory.model_shape(cfg))
    worst = max(rows, key=lambda r: r.estimate.peak)
    return worst.estimate.peak, worst.estimate.phase


def measure(argv: list[str]) -> dict:
    """Train in this process; the run's peak allocated bytes and the largest logged memory_gib."""
    import torch

    from engine import metrics
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.distributed import destroy_distributed, init_distributed
    from engine.trainer import Trainer

    cfg = parse_args(argv)
    device = torch.device("cuda", 0)
    peaks: list[int] = []
    reset = metrics.reset_peak_memory

    def recording_reset(dev):  # the trainer resets the peak at every log: read it first
        peaks.append(torch.cuda.max_memory_allocated(dev))
        reset(dev)

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    metrics.reset_peak_memory = recording_reset
    start = time.perf_counter()
    try:
        trainer = Trainer(cfg, init_distributed(), validate(cfg, 1))
        logged = trainer.train()
        peaks.append(torch.cuda.max_memory_allocated(device))
    finally:
        metrics.reset_peak_memory = reset
        destroy_distributed()  # FSDP on one GPU made a process group of one
    seconds = time.perf_counter() - start
    result = {
        "allocated_gib": max(peaks) / GIB,
        "memory_gib": max(r["memory_gib"] for r in logged),
        "reserved_gib": max((r.get("memory_reserved_gib") or 0) for r in logged),
        "tps": logged[-1].get("tps"),
        "seconds": seconds,
    }
    del trainer, logged
    gc.collect()
    torch.cuda.empty_cache()
    return result


def from_runs(folder: str, labels: list[str] | None = None) -> list[dict]:
    """The estimate beside the logged peak for every single-GPU run folder under ``folder`` (``labels``: those
    folders only, one named but missing its files a row with an error)."""
    from engine.config import parse_args

    rows = []
    for name in sorted(os.listdir(folder)) if labels is None else labels:
        run = os.path.join(folder, name)
        cfg_path, jsonl = os.path.join(run, "config.toml"), os.path.join(run, "metrics.jsonl")
        if not (os.path.isfile(cfg_path) and os.path.isfile(jsonl)):
            if labels is not None:
                rows.append({"name": name, "error": "no result (no config.toml or metrics.jsonl: skipped, or "
                                                    "stopped before its first log)"})
            continue
        with open(jsonl) as f:
            logged = [json.loads(line) for line in f if line.strip()]
        peaks = [r["memory_gib"] for r in logged if r.get("memory_gib")]
        if peaks and max(peaks) < 1:
            continue  # the debug model: the allocator's and kernels' fixed overheads are most of it
        row = {"name": name}
        try:
            cfg = parse_args(["--config", cfg_path])
            p = cfg.parallelism
            gpus = {round(r["tps"] / r["tps_per_gpu"]) for r in logged if r.get("tps") and r.get("tps_per_gpu")}
            if p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp != 1 or gpus - {1}:
                continue  # a multi-rank run (dp_shard = -1 took the ranks left): not a single-GPU figure
            est, moment = estimate(["--config", cfg_path])
            row.update(estimate_gib=est / GIB, moment=moment, float8=cfg.float8.enable)
        except (ValueError, OSError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
        if peaks:
            row.update(memory_gib=max(peaks), steps=logged[-1]["step"],
                       reserved_gib=max((r.get("memory_reserved_gib") or 0) for r in logged))
            if "estimate_gib" in row:
                row["ratio"] = row["estimate_gib"] / row["memory_gib"]
        rows.append(row)
    return rows


def write_runs_table(rows: list[dict], out: str) -> None:
    lines = ["| run | estimate GiB (moment) | logged peak active GiB | reserved GiB | estimate / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        note = "; float8 (the estimate counts bf16 activations)" if r.get("float8") else ""
        if "ratio" in r:
            lines.append(f"| {r['name']}{note} | {r['estimate_gib']:.2f} ({r['moment']}) | {r['memory_gib']:.2f} | "
                         f"{r['reserved_gib']:.2f} | {r['ratio']:.3f} |")
        else:
            lines.append(f"| {r['name']} | {r.get('error', 'no logged memory')} | | | |")
    table = "\n".join(lines)
    print(table)
    within = [r for r in rows if "ratio" in r and not r.get("float8") and abs(r["ratio"] - 1) <= 0.10]
    measured = [r for r in rows if "ratio" in r and not r.get("float8")]  # not a run with no result
    print(f"{len(within)} of {len(measured)} bf16 runs within 10% of the logged peak")
    with open(os.path.join(out, "memory_runs.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "memory_runs.json"), "w") as f:
        json.dump(rows, f, indent=1)


def write_table(results: list[dict], out: str, final: bool) -> None:
    lines = ["| configuration | estimate GiB (moment) | max allocated GiB | metrics memory_gib | reserved GiB | "
             "estimate / allocated |", "|---|---|---|---|---|---|"]
    for r in results:
        if "allocated_gib" in r:
            lines.append(f"| {r['name']} | {r['estimate_gib']:.2f} ({r['moment']}) | {r['allocated_gib']:.2f} | "
                         f"{r['memory_gib']:.2f} | {r['reserved_gib']:.2f} | {r['ratio']:.3f} |")
        else:
            lines.append(f"| {r['name']} | {r['estimate_gib']:.2f} ({r['moment']}) | {r.get('error', 'not run')} "
                         f"| | | |")
    table = "\n".join(lines)
    if final:
        print(table)
    with open(os.path.join(out, "memory_check.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "memory_check.json"), "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated names (default: all); see CONFIGS")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/tessera_bench_out"),
                   help="where memory_check.md and memory_check.json go")
    p.add_argument("--runs", default="/tmp/tessera_bench/memory_check", help="where the run folders go")
    p.add_argument("--estimate-only", action="store_true", help="print the estimates; train nothing")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole check (a device call has 600): a configuration is skipped once less "
                        "than a minute is left")
    p.add_argument("--from-runs", default="", metavar="DIR",
                   help="train nothing: the estimate beside the logged peak of every single-GPU run under DIR")
    p.add_argument("--labels", default=None, metavar="NAME,...",
                   help="with --from-runs: these run folders of DIR only (default: every one)")
    a = p.parse_args(argv)
    if a.from_runs:
        os.makedirs(a.out, exist_ok=True)
        labels = None if a.labels is None else [n for n in a.labels.split(",") if n]
        write_runs_table(from_runs(a.from_runs, labels), a.out)
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: --only: unknown configuration(s) {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    if not a.estimate_only:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device; run this on the GPU machine (or pass --estimate-only)", file=sys.stderr)
            return 2
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)

    results, start = [], time.perf_counter()
    for name in names:
        argv_run = COMMON + CONFIGS[name] + ["--training.steps", str(a.steps),
                                             "--job.dump_folder", os.path.join(a.runs, name.replace(" ", "_")
                                                                               .replace(",", ""))]
        est, moment = estimate(argv_run)
        row = {"name": name, "estimate_gib": est / GIB, "moment": moment}
        if a.estimate_only:
            pass
        elif time.perf_counter() - start + 60 > a.budget:  # about a minute per configuration
            row["error"] = f"skipped: past --budget {a.budget:.0f} s"
        else:
            try:
                row.update(measure(argv_run))
                row["ratio"] = row["estimate_gib"] / row["allocated_gib"]
            except Exception as e:  # an OOM or a failure of one config must not hide the others
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)
        write_table(results, a.out, final=False)  # what is done so far comes back even if the call is cut
    write_table(results, a.out, final=True)
    within = [r for r in results if "ratio" in r and abs(r["ratio"] - 1) <= 0.10]
    if not a.estimate_only:
        print(f"{len(within)} of {len(results)} configurations within 10% of the measured peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
