"""Evaluation: a no-grad forward gives the single-process loss on every layout, through the pipeline too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "4", "--training.global_batch_size", "4",
        "--lr_scheduler.warmup_steps", "1", "--debug.deterministic", "--data.num_shards", "2"]


def evaluate(tmp: Path, name: str, nproc: int, *args: str) -> float:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "tests/eval_probe.py", str(out), *BASE, "--job.dump_folder", str(tmp / name), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
               "--rdzv_endpoint=localhost:0", *cmd[1:]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TESSERA_FAULT_AT"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["loss"]


LAYOUTS = {
    "pp2_dualpipev": (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV"]),
    "pp2_tp2": (4, ["--parallelism.pp", "2", "--parallelism.tp", "2"]),
    "fsdp2_cp2": (4, ["--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--training.local_batch_size", "2"]),
}


def test_evaluation_matches_the_single_process_on_every_layout(tmp_path):
    reference = evaluate(tmp_path, "single", 1)
    assert 5 < reference < 12  # an untrained model: about ln(vocab)
    for name, (nproc, args) in LAYOUTS.items():
        assert evaluate(tmp_path, name, nproc, *args) == pytest.approx(reference, rel=1e-5), name  # same samples


def test_validation_during_training_is_logged(tmp_path):
    proc = subprocess.run(["./run_train.sh", *BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                           "--metrics.log_freq", "2", "--validation.enable", "--validation.freq", "2",
                           "--validation.steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
    assert sorted(val) == [2, 4] and val[4] < val[2]  # the same batches each time: the model learned
    assert "validation: step 4" in proc.stdout
