"""Evaluation: a no-grad forward gives the single-process loss on every layout, through the pipeline too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import run_jobs

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model.flavor", "debugmodel_L2",  # 2 layers: depth adds nothing here
        "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.global_batch_size", "4",
        "--lr_scheduler.warmup_steps", "1", "--debug.deterministic", "--data.num_shards", "2",
        "--metrics.no-plots"]


def evaluate_job(world_size: int, rank: int, argv: list[str]) -> float:
    """On every rank: build the Trainer for ``argv`` and evaluate (no gradients) the first two batches of every
    data-parallel rank; the loss, the same on every rank."""
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.distributed import init_distributed
    from engine.trainer import Trainer

    cfg = parse_args(argv)
    trainer = Trainer(cfg, init_distributed(), validate(cfg, world_size))
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
        # flex attention's mask covers the whole sequence on the stage whose input is a sequence-parallel slice
        "pp2_tp2_flex": ["--parallelism.pp", "2", "--parallelism.tp", "2", "--model.attn", "flex"],
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


def test_validation_is_logged_at_every_step_it_runs(tmp_path):
    """Validation every step, logs every 3: each result is in metrics.jsonl at its own step (none lost between
    logs), as records of their own that the readers of metrics.jsonl keep apart from the training records."""
    proc = subprocess.run(["./run_train.sh", *BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                           "--metrics.log_freq", "3", "--validation.enable", "--validation.freq", "1",
                           "--validation.steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in records] == [(1, True), (1, False), (2, False), (3, True), (3, False),
                                                           (4, True), (4, False)]
    val = {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
    assert sorted(val) == [1, 2, 3, 4] and val[4] < val[1]  # the same batches each time: the model learned
    for step in (1, 2, 3, 4):
        assert f"validation: step {step}  loss: {val[step]:.4f}" in proc.stdout
    assert "warning" not in proc.stdout

    # The readers of metrics.jsonl: the training records only, the last one's loss the run's last loss.
    from engine.plot import read_metrics
    from tools.sweep import summarize_run

    train = [r for r in records if "loss" in r]
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == train
    assert summarize_run(str(tmp_path), warmup=0)["last_loss"] == train[-1]["loss"]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from summarize import tessera_run
    finally:
        sys.path.remove(str(ROOT / "bench"))
    summary = tessera_run(str(tmp_path), skip=0, steps=4)
    assert summary["steps"] == "1-4" and summary["last_loss"] == train[-1]["loss"] and not summary["partial"]


def test_validation_data_smaller_than_validation_steps_is_one_warning(tmp_path, capsys):
    """A validation set that holds fewer than validation.steps batches would be read again (the loader loops over
    its epochs): one warning line at start-up says how many batches it holds; that many give no warning."""
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.distributed import init_distributed
    from engine.trainer import Trainer

    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": f"Validation document {i} of a small set, read once."}) + "\n"
                            for i in range(12)))

    def warning(steps: int) -> str:
        cfg = parse_args([*BASE, "--data.num_shards", "1", "--job.dump_folder", str(tmp_path / f"run{steps}"),
                          "--validation.enable", "--validation.freq", "1", "--validation.path", str(data),
                          "--validation.steps", str(steps)])
        Trainer(cfg, init_distributed(), validate(cfg, 1)).metrics.close()
        return "\n".join(line for line in capsys.readouterr().out.splitlines() if line.startswith("warning"))

    line = warning(20)
    match = re.fullmatch(r"warning: validation\.steps: 20 batches per validation, but the validation data, "
                         r"validation\.path = '.*val\.jsonl' \(1 json file\), holds only (\d+) whole batch(es)? per "
                         r"data-parallel rank, so it is read again from its start and validation_loss counts those "
                         r"documents twice; set validation\.steps to at most \1, or give more validation data", line)
    assert match, line
    fit = int(match.group(1))
    assert 0 < fit < 20
    assert warning(fit) == ""
    assert warning(fit + 1) != ""


def validation_timeouts_job(world_size: int, rank: int, dump: str) -> dict:
    """Two FSDP ranks validate at steps 2 and 4: the collective timeouts each validation runs under, and after."""
    from engine.config import parse_args
    from engine.config.validation import validate
    from engine.distributed import collective_timeouts, init_distributed
    from engine.trainer import Trainer

    cfg = parse_args([*BASE, "--training.local_batch_size", "2", "--parallelism.dp_shard", "2", "--job.dump_folder",
                      dump, "--training.steps", "4", "--validation.enable", "--validation.freq", "2",
                      "--validation.steps", "1", "--comm.init_timeout_seconds", "77",
                      "--comm.train_timeout_seconds", "33"])
    trainer = Trainer(cfg, init_distributed(cfg), validate(cfg, world_size))
    seen, validate_once = [], trainer._validate

    def spy() -> float:
        seen.append(sorted(set(collective_timeouts())))
        return validate_once()

    trainer._validate = spy
    trainer.train()
    return {"validations": seen, "after": sorted(set(collective_timeouts()))}


def test_the_first_validation_has_the_set_up_timeout(tmp_path):
    """The first validation compiles the no-grad forward anew (with PP the last stage waits for every stage's
    compile): it runs under comm.init_timeout_seconds, though step 1 has set comm.train_timeout_seconds; the
    later ones, and the steps after it, under the training's."""
    result = run_jobs(2, validation_timeouts_job, {"run": (str(tmp_path / "run"),)}, str(tmp_path))["run"]
    assert result == {"validations": [[77.0], [33.0]], "after": [33.0]}
