"""Evaluation: a no-grad forward gives the single-process loss on every layout, through the pipeline too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import run_jobs

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "4", "--training.global_batch_size", "4",
        "--lr_scheduler.warmup_steps", "1", "--debug.deterministic", "--data.num_shards", "2"]


def evaluate_job(world_size: int, rank: int, argv: list[str]) -> float:
    """On every rank: build the Trainer for ``argv`` and evaluate (no gradients) the first two batches of every
    data-parallel rank; the loss, the same on every rank."""
    from engine.config import parse_args, validate
    from engine.distributed import init_distributed
    from engine.trainer import Trainer

    cfg = parse_args(argv)
    validate(cfg, world_size)
    trainer = Trainer(cfg, init_distributed())
    batches = iter(trainer.dataloader)
    loss = float(trainer.evaluate([next(batches) for _ in range(2)]))
    trainer.metrics.close()
    return loss


LAYOUTS = {
    2: {
        "pp2_dualpipev": ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV"],
        # the last stage computes the loss from its hidden state (the output projection fused with the loss)
        "pp2_fused_loss": ["--parallelism.pp", "2", "--training.loss_chunk_tokens", "24"],
    },
    4: {
        "pp2_tp2": ["--parallelism.pp", "2", "--parallelism.tp", "2"],
        "fsdp2_cp2": ["--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--training.local_batch_size", "2"],
    },
}


def test_evaluation_matches_the_single_process_on_every_layout(tmp_path):
    def jobs(layouts):
        return {name: ([*BASE, *args, "--job.dump_folder", str(tmp_path / name)],) for name, args in layouts.items()}

    reference = run_jobs(1, evaluate_job, jobs({"single": []}), str(tmp_path))["single"]
    assert 5 < reference < 12  # an untrained model: about ln(vocab)
    for world, layouts in LAYOUTS.items():
        for name, loss in run_jobs(world, evaluate_job, jobs(layouts), str(tmp_path)).items():
            assert loss == pytest.approx(reference, rel=1e-5), name  # the same samples


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
