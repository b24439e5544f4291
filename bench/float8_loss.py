"""float8 against high precision on the debug model: train the default debug config twice, the same data and
seed, once plain and once with float8, and print both loss curves' ends and the relative gap (the target:
within 1% after 200 steps).

    python bench/float8_loss.py [--steps 200] [--out DIR] [--only plain|float8] [-- EXTRA TRAIN ARGS...]

On a CPU (or a GPU without float8) the float8 run is emulated (float8.emulate) and the plain run is float32;
on an H100 the float8 matmuls are real and the plain run is bf16 (training.mixed_precision_param). Each run is
``python -m engine.train --config train_configs/debug_model.toml --training.steps N`` in its own process;
``--only`` runs one of them (the other's earlier result in --out is reused), so the two can be run in separate
commands. The loss compared is the last logged one (the mean over the last metrics.log_freq steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _float8_args() -> list[str]:
    import torch

    real = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return ["--float8.enable"] + ([] if real else ["--float8.emulate"])


def _run(name: str, out: str, steps: int, extra: list[str]) -> float:
    dump = os.path.join(out, name)
    cmd = [sys.executable, "-m", "engine.train", "--config", "train_configs/debug_model.toml",
           "--training.steps", str(steps), "--job.dump_folder", dump, *extra]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _losses(out: str, name: str) -> list[dict]:
    path = os.path.join(out, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:  # the training records (validation has records of its own, without "loss")
        return [r for r in (json.loads(line) for line in f if line.strip()) if "loss" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="outputs/float8_loss")
    p.add_argument("--only", choices=["plain", "float8"], default=None)
    p.add_argument("extra", nargs="*", help="more training options, after --")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    runs = {"plain": list(args.extra), "float8": [*args.extra, *_float8_args()]}
    for name, extra in runs.items():
        if args.only in (None, name):
            seconds = _run(name, out, args.steps, extra)
            print(f"{name}: {seconds:.0f} s", flush=True)
    plain, f8 = _losses(out, "plain"), _losses(out, "float8")
    if not plain or not f8:
        print("run the other configuration too (--only plain / --only float8) to compare")
        return 0
    assert plain[-1]["step"] == f8[-1]["step"], "the two runs stopped at different steps"
    print(f"{'step':>6} {'plain':>9} {'float8':>9} {'gap':>8}")
    for a, b in zip(plain, f8):
        print(f"{a['step']:>6} {a['loss']:>9.4f} {b['loss']:>9.4f} {(b['loss'] - a['loss']) / a['loss']:>+8.2%}")
    a, b = plain[-1]["loss"], f8[-1]["loss"]
    print(f"after {plain[-1]['step']} steps: plain {a:.4f}, float8 {b:.4f}, relative gap {(b - a) / a:+.3%} "
          f"(float8 args: {' '.join(_float8_args())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
