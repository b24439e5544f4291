"""Checkpoints: stop and go bit-exact, kill -9 inside saves, resharding resume, async save, SIGTERM, bad input.

Runs train the debug model with short sequences, as whole Trainer.train runs on ranks forked from the test
harness's forkserver (tests/parallel_harness.py), and through ./run_train.sh (torchrun on gloo) where the
launcher itself is under test: SIGTERM forwarding, bad checkpoints (tests/test_launch.py kills launchers).
Faults are injected with TESSERA_FAULT_AT=<step>:<point> (engine/faults.py), which kills the process
with SIGKILL at that point of the save of that step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
import torch
import torch.multiprocessing as mp

from engine.checkpoint.files import (CHECKSUM_DIR, CHECKSUM_KEY, COMMIT_FILE, file_checksum, inspect_checkpoint,
                                     list_steps, read_full, verify_checksums, write_commit_marker)
from engine.checkpoint.resume import find_resume_point, plan_resume
from engine.config import ConfigError, parse_args
from engine.data.loader import build_dataloader
from engine.data.tokenizer import build_tokenizer
from engine.optim import lr_factor
from engine.plot import read_metrics
from tests.parallel_harness import run_jobs, train_job

ROOT = Path(__file__).resolve().parents[1]
BASE = [  # the 2-layer debug model: saves, loads and reshards every kind of tensor the 6-layer one has
    "--model.flavor", "debugmodel_L2",
    "--training.steps", "20", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--debug.deterministic",
    "--checkpoint.enable", "--checkpoint.interval", "10",
    "--metrics.no-plots",  # drawn where they are checked (test_train, test_metrics): a second per run here
]
# Multi-rank runs step the optimizer per tensor, as tests/parallel_harness.py's do: the first foreach step on
# DTensors propagates shardings for seconds per rank on 2 cores, and DCP's optimizer state dict takes a step to
# initialize the state, at every save and load. The state saved and loaded is the same for either kernel.
FOR_LOOP = ["--optimizer.implementation", "for-loop"]
FSDP2_TP2 = ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", *FOR_LOOP]


class Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str = ""


def train(dump: Path, *args: str, ngpu: int = 1, fault: str = "", check: bool = True, launcher: str = "harness"):
    """Train ``BASE + args`` on ``ngpu`` ranks into ``dump``; TESSERA_FAULT_AT=``fault`` when given. The run goes
    through ``./run_train.sh`` (torchrun for several ranks) with ``launcher="run_train.sh"``; by default its
    ranks are forked from the test harness's preloaded forkserver (the same Trainer.train, seconds faster per
    launch). A run killed by a signal returns that signal as a negative return code, like subprocess."""
    argv = [*BASE, "--job.dump_folder", str(dump), *args]
    if launcher == "run_train.sh":
        env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable}
        env.pop("TESSERA_FAULT_AT", None)
        if fault:
            env["TESSERA_FAULT_AT"] = fault
        proc = subprocess.run(["./run_train.sh", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        run = Run(proc.returncode, proc.stdout, proc.stderr)
    else:
        assert launcher == "harness", launcher
        jobs = str(dump) + ".jobs"
        try:
            run = Run(0, run_jobs(ngpu, train_job, {"run": (argv, {"TESSERA_FAULT_AT": fault})}, jobs)["run"])
        except mp.ProcessExitedException as e:  # killed by a signal: every rank dies at the fault point
            run = Run(e.exit_code, "", str(e))
    if check:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def metrics(dump: Path) -> dict[int, dict]:
    """The run's curve: each step's record, as engine.plot reads resumed runs' appended segments."""
    return {r["step"]: r for r in read_metrics(str(dump / "metrics.jsonl"))}


def curve(dump: Path, steps) -> list[tuple[float, float]]:
    m = metrics(dump)
    return [(m[s]["loss"], m[s]["grad_norm"]) for s in steps]


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its contents."""
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def committed(checkpoint_folder: Path) -> list[int]:
    """The steps of ``checkpoint_folder`` that have a commit marker."""
    return [s for s, _, ok in list_steps(str(checkpoint_folder)) if ok]


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def mismatched(held: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> list[str]:
    """The names of the values this rank holds (DTensors or plain) that differ from ``whole``'s whole tensors."""
    from torch.distributed.tensor import DTensor

    return [key for key, value in held.items()
            if not torch.equal((value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu(), whole[key])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[Path]:
    """20 uninterrupted steps, one process, checkpoints at 10 and 20."""
    dump = tmp_path_factory.mktemp("reference")
    train(dump)
    yield dump
    shutil.rmtree(dump)


# ------------------------------------------------------------------------------------------------------------
# Stop and go
# ------------------------------------------------------------------------------------------------------------


def test_kill_after_step_10_and_resume_is_bit_identical(reference, tmp_path):
    killed = train(tmp_path, fault="10:committed", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert committed(tmp_path / "checkpoint") == [10]
    resumed = train(tmp_path)
    assert "resumed from step 10" in resumed.stdout
    assert "its 5 files matched their checksums" in resumed.stdout, resumed.stdout
    # The resumed run appends to the killed run's metrics.jsonl: one curve, the uninterrupted one.
    assert sorted(metrics(tmp_path)) == list(range(1, 21))
    assert curve(tmp_path, range(1, 21)) == curve(reference, range(1, 21))


def test_sigterm_saves_exits_zero_and_the_resumed_run_continues_the_curve(reference, tmp_path):
    stopped = train(tmp_path, fault="6:sigterm")  # SIGTERM to itself in the middle of step 6
    assert "SIGTERM: checkpoint of step 6 saved; exiting" in stdout_of(stopped)
    assert sorted(metrics(tmp_path)) == list(range(1, 7))
    assert committed(tmp_path / "checkpoint") == [6]
    train(tmp_path)
    assert curve(tmp_path, range(1, 21)) == curve(reference, range(1, 21))


def test_sigterm_after_divergence_saves_nothing_and_exits_3(tmp_path):
    """A SIGTERM in a run whose loss turned nan since its last log does not save the nan weights (a requeued job
    would resume from them): the step is checked as a logged or saved step is, and the run stops diverged."""
    run = train(tmp_path, "--optimizer.lr", "1000", "--metrics.log_freq", "100", "--checkpoint.interval", "100",
                fault="10:sigterm", check=False, launcher="run_train.sh")
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error: optimizer.lr: training diverged by step 10 " in run.stderr, run.stderr[-3000:]
    assert committed(tmp_path / "checkpoint") == [] and "SIGTERM" not in run.stdout


def test_a_run_resumed_at_a_multiple_of_log_freq_logs_the_same_losses(tmp_path):
    """A logged loss is the mean since the previous multiple of metrics.log_freq: the resumed run's first step,
    logged alone for its warm-up, does not shorten the next window, so the logged losses are the uninterrupted
    run's."""
    args = ("--training.steps", "8", "--metrics.log_freq", "2", "--checkpoint.interval", "4")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(full, *args)
    shutil.copytree(full / "checkpoint" / "step-000004", resumed / "checkpoint" / "step-000004")
    train(resumed, *args)
    m_full, m_resumed = metrics(full), metrics(resumed)
    assert sorted(m_full) == [1, 2, 4, 6, 8] and sorted(m_resumed) == [5, 6, 8]
    assert [m_resumed[s]["loss"] for s in (6, 8)] == [m_full[s]["loss"] for s in (6, 8)]
    assert m_resumed[5]["loss"] != m_resumed[6]["loss"]  # step 5 alone, then the window of steps 5 and 6


def test_sigterm_vote_of_several_ranks_overlaps_a_step(tmp_path):
    """With several ranks the stop vote runs in the background during the next step (a CPU all-reduce over
    every rank is slow at scale): both ranks, signalled in step 6, save step 7 together and exit 0."""
    stopped = train(tmp_path, *FOR_LOOP, fault="6:sigterm", ngpu=2)
    assert "SIGTERM: checkpoint of step 7 saved; exiting" in stdout_of(stopped)
    assert sorted(metrics(tmp_path)) == list(range(1, 8))
    assert committed(tmp_path / "checkpoint") == [7]


@pytest.mark.parametrize("ngpu", [1, 2])
def test_sigterm_during_set_up_exits_zero_before_the_first_step(reference, tmp_path, ngpu):
    """A SIGTERM while the run is set up (the model built, the checkpoint loaded: minutes at scale) ends it with
    status 0 before its first step, with nothing new to save, so that the SLURM templates requeue the job (a run
    killed by the signal was not requeued); several ranks agree by a vote. The requeued run goes on as if nothing
    had happened. One rank through run_train.sh (engine.train defers the signal as soon as it has read the config),
    two through the harness (which defers it as engine.train does), for speed."""
    killed = train(tmp_path, *FOR_LOOP, fault="10:committed", ngpu=ngpu, check=False)  # step 10 committed
    assert killed.returncode == -signal.SIGKILL
    records = (tmp_path / "metrics.jsonl").read_text()
    stopped = train(tmp_path, *FOR_LOOP, fault="10:set_up:sigterm", ngpu=ngpu, check=False,
                    launcher="run_train.sh" if ngpu == 1 else "harness")
    assert stopped.returncode == 0, stdout_of(stopped)[-3000:]
    assert "SIGTERM during set-up: nothing trained since step 10, nothing to save; exiting" in stopped.stdout
    assert committed(tmp_path / "checkpoint") == [10] and (tmp_path / "metrics.jsonl").read_text() == records
    train(tmp_path, *FOR_LOOP, ngpu=ngpu)
    if ngpu == 1:
        assert curve(tmp_path, range(1, 21)) == curve(reference, range(1, 21))
    assert committed(tmp_path / "checkpoint") == [10, 20]


def test_sigterm_to_run_train_sh_with_two_ranks(tmp_path):
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable}
    env.pop("TESSERA_FAULT_AT", None)
    args = [*BASE, "--training.steps", "100000", "--checkpoint.interval", "100000", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.Popen(["./run_train.sh", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    jsonl = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what SLURM sends to the batch script
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    done = committed(tmp_path / "checkpoint")
    assert len(done) == 1 and f"SIGTERM: checkpoint of step {done[0]} saved" in out
    again = train(tmp_path, "--training.steps", str(done[0] + 2), ngpu=2)
    assert f"resumed from step {done[0]}" in again.stdout
    assert max(metrics(tmp_path)) == done[0] + 2


def stdout_of(proc) -> str:
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------------------
# kill -9 inside a save
# ------------------------------------------------------------------------------------------------------------

# Where a save is killed (engine/faults.py also lists "begin" and "dcp_data_written"): after the JSON files,
# inside DCP's write, after the data but before DCP's metadata, after DCP finished, just before the marker.
SAVE_POINTS = ["small_files", "dcp_write", "dcp_before_metadata", "dcp_done", "before_commit"]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_kill_inside_a_save_never_leaves_a_loadable_partial(tmp_path, mode):
    points = SAVE_POINTS if mode == "disabled" else ["dcp_write"]  # inside the background writer
    args = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1",
            "--checkpoint.async_mode", mode]
    for point in points:
        dump = tmp_path / point
        killed = train(dump, *args, fault=f"4:{point}", check=False)
        assert killed.returncode == -signal.SIGKILL, (point, stdout_of(killed)[-2000:])
        steps = list_steps(str(dump / "checkpoint"))
        assert [(s, ok) for s, _, ok in steps] in ([(2, True)], [(2, True), (4, False)]), (point, steps)
        cfg = parse_args(["--job.dump_folder", str(dump), *BASE, *args])
        assert find_resume_point(cfg).step == 2, point  # the partial step 4 is never picked
    # A folder that retention let go and a killed run left half deleted goes with the next retention.
    stale = dump / "checkpoint" / "step-000001.removing"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "f").write_text("x")
    # Resume the last one: it starts from step 2, saves 4 and 6 again, and retention (keep 1) drops step 2
    # only once a newer step is complete.
    resumed = train(dump, *args)
    assert "resumed from step 2" in resumed.stdout
    assert [(s, ok) for s, _, ok in list_steps(str(dump / "checkpoint"))] == [(6, True)]
    assert (dump / "checkpoint" / "step-000004.incomplete").is_dir()  # set aside, not loaded, not deleted
    assert not [p for p in os.listdir(dump / "checkpoint") if ".removing" in p]  # deleted before the run ended


def records(dump: Path) -> list[dict]:
    """The training records of metrics.jsonl in the order written (a resumed run's follow the failed run's)."""
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_a_full_disk_is_told_from_other_write_errors(tmp_path, monkeypatch):
    """out_of_space: ENOSPC or EDQUOT anywhere in the exception's chain, their text (a DCP CheckpointException
    carries each rank's failure as text), or under 16 MiB free where the folder is (torch's zip writer reports a
    short write with no errno); any other error with room to spare is not."""
    import errno
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException

    from engine.checkpoint import files

    folder = str(tmp_path / "not" / "made" / "yet")  # its nearest existing parent is asked
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage(2**40, 2**39, 2**39))
    try:
        raise RuntimeError("write failed") from OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    except RuntimeError as e:
        assert files.out_of_space(folder, e)
    assert files.out_of_space(folder, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    from_rank_1 = CheckpointException("save", {1: (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), None)})
    assert files.out_of_space(folder, from_rank_1)
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert not files.out_of_space(folder, short_write)
    assert not files.out_of_space(folder, OSError(errno.EIO, os.strerror(errno.EIO)))
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 4096, 4096))
    assert files.out_of_space(folder, short_write)


@pytest.mark.parametrize("mode, ngpu", [("disabled", 1), ("async", 2)])
def test_a_disk_that_fills_during_a_save_is_one_error_line_and_loses_nothing(tmp_path, mode, ngpu):
    """A save that finds the disk full (ENOSPC inside DCP's write, once the data files are written; in the
    background writer for an async save): exit status 2 and one error: line naming checkpoint.folder and the last
    committed step, no traceback; the step's incomplete folder removed (its space free again), the committed
    checkpoint kept. The same command run again resumes from it and trains the lost steps with the same losses."""
    dump = tmp_path / "run"
    args = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_mode", mode,
            *(FOR_LOOP if ngpu > 1 else [])]
    run = train(dump, *args, ngpu=ngpu, fault="4:dcp_data_written:enospc", check=False, launcher="run_train.sh")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint.folder: no space left on the device of {dump / 'checkpoint'} "
                                "while saving step 4"), errors
    assert "its incomplete folder is removed and the last committed checkpoint is step 2" in errors[0], errors
    assert committed(dump / "checkpoint") == [2] and not (dump / "checkpoint" / "step-000004").exists()
    first = records(dump)
    train(dump, *args, ngpu=ngpu, launcher="run_train.sh")
    again = records(dump)[len(first):]
    assert [r["step"] for r in again] == [3, 4, 5, 6]
    lost = [(r["loss"], r["grad_norm"]) for r in first if r["step"] >= 3]
    assert len(lost) >= 2 and [(r["loss"], r["grad_norm"]) for r in again][:len(lost)] == lost
    assert committed(dump / "checkpoint") == [2, 4, 6]


def test_retention_deletes_in_the_background_and_never_waits_for_it(tmp_path, monkeypatch):
    """keep_latest_k renames what it lets go at once and one background thread deletes it: a commit never waits
    for the deletion, not even for the one an earlier commit started (a slow shared filesystem)."""
    import threading

    import engine.checkpoint.checkpointer
    from engine.checkpoint.checkpointer import Checkpointer
    from engine.checkpoint.files import write_commit_marker

    cfg = parse_args([*BASE, "--job.dump_folder", str(tmp_path), "--checkpoint.keep_latest_k", "1"])
    ckpt = Checkpointer(cfg, [], None, None, dict, 1, None, torch.device("cpu"), None, "")
    root = tmp_path / "checkpoint"
    gate, rmtree = threading.Event(), shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):  # a deletion that takes until the test lets it go
        if str(path).endswith(".removing"):
            assert gate.wait(60)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(engine.checkpoint.checkpointer.shutil, "rmtree", slow_rmtree)

    def commit(step, train_state='{"step": 0}'):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "data").write_bytes(b"x" * 10)
        (folder / "train_state.json").write_text(train_state)
        write_commit_marker(str(folder), step)
        done = threading.Thread(target=ckpt._retention)
        done.start()
        done.join(timeout=10)
        assert not done.is_alive(), f"the commit of step {step} waited for a deletion"

    commit(1)
    commit(2)
    commit(3)  # step 1 is still being deleted
    assert sorted(os.listdir(root)) == ["step-000001.removing", "step-000002.removing", "step-000003"]
    gate.set()
    ckpt.wait_purge()
    assert sorted(os.listdir(root)) == ["step-000003"]
    # A step whose train_state.json cannot be read (as on a filesystem's hiccup) is neither counted nor removed: taken
    # for a full checkpoint, a model-only save would push the last full one out.
    commit(4, train_state="{")
    assert sorted(os.listdir(root)) == ["step-000003", "step-000004"]
    commit(5, train_state='{"step": 5, "model_only": true}')
    assert sorted(os.listdir(root)) == ["step-000003", "step-000004", "step-000005"]
    commit(6)
    ckpt.wait_purge()
    assert sorted(os.listdir(root)) == ["step-000004", "step-000005", "step-000006"]


def test_rollback_and_retention_keep_the_run_resumable(tmp_path):
    """Going back to step 2 (checkpoint.load_step) with keep_latest_k 1: the new step 4 is kept, the old step 4
    and step 6 are set aside (not deleted, not resumed from); killed there, a plain resume takes the new step 4.
    A last model-only save never pushes the last full checkpoint out of keep_latest_k."""
    args = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.last_save_hf"]
    train(tmp_path, *args)
    root = tmp_path / "checkpoint"
    assert sorted(os.listdir(root)) == ["step-000002", "step-000004", "step-000006", "step-000006-hf"]
    killed = train(tmp_path, *args, "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", "1",
                   fault="4:committed", check=False)
    assert killed.returncode == -signal.SIGKILL
    # The abandoned continuation's export goes aside with its checkpoint: it would pass for this run's. (Step 2,
    # let go by keep_latest_k, may still be being deleted in the background when the kill came.)
    assert sorted(p for p in os.listdir(root) if ".removing" not in p) == [
        "step-000004", "step-000004.replaced", "step-000006-hf.abandoned", "step-000006.abandoned"]
    resumed = train(tmp_path, *args, "--checkpoint.keep_latest_k", "1")
    assert "resumed from step 4" in resumed.stdout and "Hugging Face folder of" in resumed.stdout
    assert sorted(os.listdir(root)) == ["step-000004.replaced", "step-000006", "step-000006-hf",
                                        "step-000006-hf.abandoned", "step-000006.abandoned"]
    # One metrics.jsonl, appended by each run (1-6, 3-4, 5-6): read as one curve of the last segments.
    assert [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == \
        [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert sorted(metrics(tmp_path)) == [1, 2, 3, 4, 5, 6] and not list(tmp_path.glob("metrics.*.jsonl"))
    # Back to the step before the last: the new last step replaces the old one, and its export is written anew.
    short = tmp_path / "short"
    args = ["--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.last_save_hf"]
    train(short, *args)
    again = train(short, *args, "--checkpoint.load_step", "2")
    assert "already exists" not in again.stdout and "Hugging Face folder of" in again.stdout
    assert "holds the model only" not in again.stdout  # step 4 is whole: passed over by choice (load_step)
    assert sorted(os.listdir(short / "checkpoint")) == ["step-000002", "step-000004", "step-000004-hf",
                                                        "step-000004-hf.replaced", "step-000004.replaced"]

    other = tmp_path / "model_only"
    args = ["--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1",
            "--checkpoint.last_save_model_only"]
    train(other, *args)
    assert [(s, ok) for s, _, ok in list_steps(str(other / "checkpoint"))] == [(2, True), (4, True)]
    # Started again, the run ends at once: its last save (of the model only) is at training.steps.
    records = (other / "metrics.jsonl").read_text()
    again = train(other, *args)
    assert "resumed at step 4: training.steps = 4 is reached, nothing to train" in again.stdout, again.stdout
    assert sorted(os.listdir(other / "checkpoint")) == ["step-000002", "step-000004"]
    assert (other / "metrics.jsonl").read_text() == records
    longer = train(other, *args[:-1], "--training.steps", "6")
    assert "resumed from step 2" in longer.stdout

    # Back to step 2 with a last save of the model only at step 3: that commit sets the old step 4 aside too.
    back = tmp_path / "back"
    train(back, "--training.steps", "4", "--checkpoint.interval", "2")
    train(back, "--training.steps", "3", "--checkpoint.interval", "2", "--checkpoint.load_step", "2",
          "--checkpoint.last_save_model_only")
    assert sorted(os.listdir(back / "checkpoint")) == ["step-000002", "step-000003", "step-000004.abandoned"]


def test_a_rollback_sets_the_other_continuation_aside_before_its_first_commit(tmp_path):
    """Back to step 2 with checkpoints every 6 steps: the old step 4, between the step gone back to and the first
    new commit, is set aside too (keep_latest_k 2 then keeps 2 and the new 6, not 4 and 6). Killed after the set-aside
    and before the new step's marker, a plain resume goes on from step 2, not from the continuation given up."""
    train(tmp_path, "--training.steps", "6", "--checkpoint.interval", "2")
    root = tmp_path / "checkpoint"
    args = ["--training.steps", "6", "--checkpoint.interval", "6", "--checkpoint.keep_latest_k", "2"]
    killed = train(tmp_path, *args, "--checkpoint.load_step", "2", fault="6:before_commit", check=False)
    assert killed.returncode == -signal.SIGKILL
    assert [(s, ok) for s, _, ok in list_steps(str(root))] == [(2, True), (6, False)]
    assert sorted(os.listdir(root)) == ["step-000002", "step-000004.abandoned", "step-000006", "step-000006.replaced"]
    resumed = train(tmp_path, *args)
    assert "resumed from step 2" in resumed.stdout, resumed.stdout
    assert [(s, ok) for s, _, ok in list_steps(str(root))] == [(2, True), (6, True)]
    assert "step-000004.abandoned" in os.listdir(root)


def test_resume_takes_the_new_peak_lr_and_schedule_length(tmp_path):
    """Only the step comes from the checkpoint: a resumed run with a lower optimizer.lr and more training.steps
    updates with that lr on that schedule from its first step (the divergence error's advice relies on it)."""
    train(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    first = parse_args(["--config", str(tmp_path / "config.toml")])
    # A checkpoint saved before checkpoints held their run's settings (nor checksums): the lr alone is named.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "checkpoint", old / "checkpoint")
    state_file = old / "checkpoint" / "step-000004" / "train_state.json"
    state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items() if k != "settings"}))
    _recommit(state_file.parent)
    marker = json.loads((state_file.parent / COMMIT_FILE).read_text())
    del marker[CHECKSUM_KEY]
    (state_file.parent / COMMIT_FILE).write_text(json.dumps(marker))
    resumed = train(old, "--training.steps", "5", "--optimizer.lr", "1e-5")
    assert (f"checkpoint: optimizer.lr 1e-05 (the checkpoint's run used {first.optimizer.lr:g}): the schedule goes on "
            "from step 4 with the new peak" in resumed.stdout), resumed.stdout
    assert "; saved without checksums, so its bytes were not checked" in resumed.stdout, resumed.stdout
    resumed = train(tmp_path, "--training.steps", "10", "--optimizer.lr", "1e-5", "--debug.seed", "7",
                    "--checkpoint.interval", "3")
    assert "resumed from step 4" in resumed.stdout
    # Named: what changes the resumed run's updates (not the seed, whose initial weights are the checkpoint's, nor
    # the checkpoint interval).
    assert (f"checkpoint: settings changed since step 4 was saved: training.steps 4 -> 10, optimizer.lr "
            f"{first.optimizer.lr:g} -> 1e-05; the run goes on from step 4 with the new values (the lr schedule "
            "too)\n" in resumed.stdout), resumed.stdout
    cfg = parse_args(["--config", str(tmp_path / "config.toml")])  # the resumed run's resolved config
    assert cfg.training.steps == 10 and cfg.optimizer.lr == 1e-5
    # The first run's is kept beside it, named for the step the new settings start at.
    assert parse_args(["--config", str(tmp_path / "config.before-step-5.toml")]) == first
    assert sorted(p.name for p in tmp_path.glob("config*.toml")) == ["config.before-step-5.toml", "config.toml"]
    m = metrics(tmp_path)
    for step in range(5, 11):
        assert m[step]["lr"] == pytest.approx(1e-5 * lr_factor(step, 10, cfg.lr_scheduler), rel=1e-9), step


# ------------------------------------------------------------------------------------------------------------
# Resharding
# ------------------------------------------------------------------------------------------------------------

RESHARD = ["--training.steps", "8", "--checkpoint.interval", "4", "--training.global_batch_size", "8",
           "--data.num_shards", "4", *FOR_LOOP]


def probe_trainer(argv: list[str], world_size: int):
    """The Trainer of ``argv`` on this rank of a harness job (which has initialized the process group)."""
    from engine.config.validation import validate
    from engine.distributed import init_distributed
    from engine.trainer import Trainer

    cfg = parse_args(argv)
    return Trainer(cfg, init_distributed(), validate(cfg, world_size))


def resume_probe_job(world_size: int, rank: int, steps: int, argv: list[str]) -> list[dict]:
    """On every rank: build the Trainer for ``argv``, which resumes from the run's newest checkpoint on this
    layout; check that every model and optimizer value this rank holds equals the checkpoint's (read whole),
    and draw the next ``steps`` steps' batches (without training) to record their sample ids. Returns what
    every rank found."""
    import torch.distributed as dist

    trainer = probe_trainer(argv, world_size)
    assert trainer.resume_from is not None, "the probe expects a checkpoint to resume from"
    saved = read_full(trainer.resume_from.folder)
    held = {**trainer.checkpointer.model_state(), **trainer.checkpointer.optimizer_state()[0]}
    batches = iter(trainer.dataloader)
    ids = [[int(i) for _ in range(trainer.grad_accum) for i in next(batches)["sample_ids"]] for _ in range(steps)]
    mine = {"rank": rank, "dp_leader": trainer.dims.is_dp_leader(), "step": trainer.step, "keys": sorted(held),
            "mismatched": mismatched(held, saved), "ids": ids}
    trainer.checkpointer.close()
    trainer.metrics.close()
    everyone = [mine]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
    return everyone


def probe_or_train_job(world_size: int, rank: int, kind: str, *args) -> list[dict] | str:
    """``resume_probe_job`` or the harness's ``train_job``, so that one start of a world's ranks runs both."""
    return (resume_probe_job if kind == "probe" else train_job)(world_size, rank, *args)


def test_resume_fsdp4_checkpoint_on_other_layouts(tmp_path):
    """An FSDP 4 run's step-4 checkpoint, resumed on FSDP 2 x TP 2, PP 2 x FSDP 2, FSDP 2 and one rank: every
    model and optimizer value arrives, the next steps read the same samples, and training on from there gives
    the uninterrupted run's losses and gradient norms (learning rate, optimizer state and data all carried)."""
    saved = tmp_path / "fsdp4"
    train(saved, *RESHARD, ngpu=4)  # 8 steps, checkpoints at 4 and 8
    # The samples the uninterrupted FSDP 4 run reads in steps 5 and 6.
    cfg = parse_args([*BASE, *RESHARD])
    tok = build_tokenizer(cfg)
    loaders = [build_dataloader(cfg, tok, r, 4, num_shards=4) for r in range(4)]
    for loader in loaders:
        for _ in range(4):
            next(loader)
    expected = [sorted(int(i) for loader in loaders for i in next(loader)["sample_ids"]) for _ in range(2)]
    all_keys = sorted(read_full(str(saved / "checkpoint" / "step-000004")))

    layouts = {
        4: {"fsdp2_tp2": FSDP2_TP2, "pp2_fsdp2": ["--parallelism.pp", "2", "--parallelism.dp_shard", "2"]},
        2: {"fsdp2": []},
        1: {"one_rank": []},
    }
    uninterrupted = metrics(saved)
    for world, jobs in layouts.items():
        argv = [*BASE, *RESHARD, "--checkpoint.folder", str(saved / "checkpoint"), "--checkpoint.load_step", "4"]
        probes = {name: ("probe", 2, [*argv, "--job.dump_folder", str(tmp_path / name), *args])
                  for name, args in jobs.items()}
        # Train on: each layout from its own copy of the step-4 checkpoint to step 8.
        trained = {}
        for name, args in jobs.items():
            dump = tmp_path / f"{name}_trained"
            shutil.copytree(saved / "checkpoint" / "step-000004", dump / "checkpoint" / "step-000004")
            trained[f"{name}_trained"] = ("train", [*BASE, *RESHARD, "--job.dump_folder", str(dump), *args], {})
        results = run_jobs(world, probe_or_train_job, {**probes, **trained}, str(tmp_path / f"world{world}"))
        results = {name: results[name] for name in jobs}
        for name in jobs:
            resumed = metrics(tmp_path / f"{name}_trained")
            assert sorted(resumed) == [5, 6, 7, 8], (name, sorted(resumed))
            # Against the uninterrupted run: losses and gradient norms to rounding (another layout sums the gradients
            # in another order), learning rates equal.
            for step in (5, 6, 7, 8):
                assert resumed[step]["lr"] == pytest.approx(uninterrupted[step]["lr"], rel=1e-9), (name, step)
                assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-5), (name, step)
                assert resumed[step]["grad_norm"] == pytest.approx(uninterrupted[step]["grad_norm"], rel=1e-5), \
                    (name, step)
        for name, ranks in results.items():
            assert len(ranks) == world and all(r["step"] == 4 for r in ranks), name
            assert not [r["mismatched"] for r in ranks if r["mismatched"]], name  # model and optimizer equal
            assert sorted({k for r in ranks for k in r["keys"]}) == all_keys, name  # every value held somewhere
            leaders = [r for r in ranks if r["dp_leader"]]
            got = [sorted(i for r in leaders for i in r["ids"][step]) for step in range(2)]
            assert got == expected, name  # the same samples: none repeated, none skipped


def test_tied_embeddings_resume_between_one_process_and_pipeline_stages(tmp_path):
    """An output projection tied to the embedding, with the two on different pipeline stages (the last stage holds a
    copy): PP 2 trains one process's curve; one process's step-4 checkpoint resumes on PP 2 under a V schedule
    (rank 0 holds both copies, each loaded with its own optimizer state), and PP 2's on one process. Both go on
    with the uninterrupted losses and gradient norms: the weight and its AdamW moments arrive in both."""
    # Batches of 4 samples in 2 microbatches: the pipelines' (parallelism.pp_microbatches), and one process's by
    # gradient accumulation; gradient norms differ from unsplit batches' by up to 2.4e-5 here, in either case.
    tied = ["--model.flavor", "debugmodel_tied", "--training.steps", "8", "--checkpoint.interval", "4", *FOR_LOOP]
    accumulate = ["--training.local_batch_size", "2", "--training.global_batch_size", "4"]
    pp2 = ["--parallelism.pp", "2", "--training.local_batch_size", "4", "--parallelism.pp_microbatches", "2"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    train(one, *tied, *accumulate)
    train(pp, *tied, *pp2, ngpu=2)
    uninterrupted = metrics(one)
    steps = list(range(1, 9))
    assert sorted(metrics(pp)) == steps
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert metrics(pp)[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-5), (step, key)
    for name, source, args, ngpu in (("one_on_pp2_zbv", one, [*pp2, "--parallelism.pp_schedule", "ZBVZeroBubble"], 2),
                                     ("pp2_on_one", pp, accumulate, 1)):
        dump = tmp_path / name
        shutil.copytree(source / "checkpoint" / "step-000004", dump / "checkpoint" / "step-000004")
        train(dump, *tied, *args, ngpu=ngpu)
        resumed = metrics(dump)
        assert sorted(resumed) == [5, 6, 7, 8], (name, sorted(resumed))
        for step in resumed:
            for key in ("loss", "grad_norm"):
                assert resumed[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-5), (name, step, key)


def test_resume_on_one_rank_when_the_batch_is_not_a_multiple_of_the_shards_per_rank(tmp_path):
    """4 data shards read 1 sample a step by each of 2 ranks (2 shards each), saved after step 1 with shards 0
    and 1 a sample ahead of 2 and 3: resumed on one rank reading 2 samples a step, the run reads shards 2 and 3
    next, as the uninterrupted run does, and gives its losses (it used to read 0 and 1 again)."""
    args = ["--training.steps", "3", "--checkpoint.interval", "1", "--data.num_shards", "4", *FOR_LOOP]
    saved = tmp_path / "dp2"
    train(saved, *args, "--training.local_batch_size", "1", ngpu=2)
    resumed = tmp_path / "dp1"
    shutil.copytree(saved / "checkpoint" / "step-000001", resumed / "checkpoint" / "step-000001")
    train(resumed, *args, "--training.local_batch_size", "2")
    whole, again = metrics(saved), metrics(resumed)
    assert sorted(again) == [2, 3]
    for step in (2, 3):
        assert again[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5), step


# ------------------------------------------------------------------------------------------------------------
# Async save
# ------------------------------------------------------------------------------------------------------------


def test_async_save_writes_the_same_contents_while_training_goes_on(reference, tmp_path):
    run = train(tmp_path, "--checkpoint.async_mode", "async")
    out = run.stdout
    staged = out.index("checkpoint: step 10 staged")
    commit_at = out.index("checkpoint: step 10 committed")
    assert "step: 11" in out[staged:commit_at]  # training went on while the checkpoint was written
    assert "in the background over" in out[commit_at:].splitlines()[0]
    for step in (10, 20):
        a = read_full(str(reference / "checkpoint" / f"step-{step:06d}"))
        b = read_full(str(tmp_path / "checkpoint" / f"step-{step:06d}"))
        assert same_tensors(a, b), step
        for extra in ("train_state.json", "dataloader/dp-00000.json", "rng/rank-00000.json"):
            ja = json.loads((reference / "checkpoint" / f"step-{step:06d}" / extra).read_text())
            jb = json.loads((tmp_path / "checkpoint" / f"step-{step:06d}" / extra).read_text())
            assert ja == jb, (step, extra)
    assert curve(tmp_path, range(1, 21)) == curve(reference, range(1, 21))


def test_async_with_pinned_mem_on_cpu_writes_what_a_sync_save_writes(tmp_path):
    """checkpoint.async_mode = "async_with_pinned_mem" on a machine without CUDA (pinned memory needs an
    accelerator: CPU-only torch refuses pin_memory=True, and DCP's pinned stager asserts one) stages without
    pinned memory, as "async" does: the run saves in the background and its checkpoints hold what a synchronous
    save writes."""
    short = ["--training.steps", "4", "--checkpoint.interval", "2"]
    train(tmp_path / "sync", *short)
    out = train(tmp_path / "pinned", *short, "--checkpoint.async_mode", "async_with_pinned_mem").stdout
    assert "checkpoint: step 2 staged" in out and "writing in the background" in out
    for step in (2, 4):
        a, b = (tmp_path / run / "checkpoint" / f"step-{step:06d}" for run in ("sync", "pinned"))
        assert same_tensors(read_full(str(a)), read_full(str(b))), step
        for extra in ("train_state.json", "dataloader/dp-00000.json", "rng/rank-00000.json"):
            assert json.loads((a / extra).read_text()) == json.loads((b / extra).read_text()), (step, extra)
    assert committed(tmp_path / "pinned" / "checkpoint") == [2, 4]
    assert curve(tmp_path / "pinned", range(1, 5)) == curve(tmp_path / "sync", range(1, 5))


def run_saving_script(script: str, folder: Path) -> None:
    """Run ``script`` (it saves into its argument ``folder``, then prints "saved") in a process of its own: what
    it sets (a process group, torch.cuda patched) stays out of the test process."""
    run = subprocess.run([sys.executable, "-c", script, str(folder)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "saved" in run.stdout, run.stderr[-2000:]


ASYNC_ON_ONE_CUDA_RANK = """
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from engine.checkpoint.checkpointer import async_save_group
dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
future = dcp.async_save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(sys.argv[1]),
                        process_group=async_save_group("async"))
future.result()
dist.destroy_process_group()  # as the trainer does: a group left to interpreter exit can abort it (SIGABRT)
print("saved")
"""


def test_async_save_on_one_rank_with_a_process_group_has_a_cpu_backend(tmp_path):
    """fsdp_single_rank on one GPU makes a process group of one whose only backend is NCCL; DCP's async save
    refuses such a default group ("A CPU backend must be enabled"), so the checkpointer gives the writer a gloo
    group on one rank too. A one-rank group with CUDA's backend alone (gloo under CUDA's name: NCCL cannot
    start here) stands in for NCCL's."""
    run_saving_script(ASYNC_ON_ONE_CUDA_RANK, tmp_path / "step")
    assert (tmp_path / "step" / ".metadata").exists()


BACKGROUND_WRITER_ON_CUDA = """
import sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from engine.checkpoint.checkpointer import step_writer
torch.cuda.is_available = lambda: True  # DCP's writer takes its CUDA branch, which this build cannot run
writer = step_writer(sys.argv[1], 1, background=True)
dcp.async_save({"w": torch.arange(4.0)}, storage_writer=writer, async_stager=BlockingAsyncStager(),
               no_dist=True).result()
print("saved")
"""


def test_a_background_save_writes_without_touching_the_gpu(tmp_path):
    """An async save's writer thread copies nothing ahead from the GPU: DCP's copy-ahead loader would use the
    thread's CUDA device (GPU 0 on every rank of a node). With a stager of its own (async_with_pinned_mem), DCP
    keeps the writer's copy-ahead setting; on a machine that says it has CUDA the write must not call into it."""
    run_saving_script(BACKGROUND_WRITER_ON_CUDA, tmp_path / "step")


def test_async_save_on_two_ranks_commits_once_every_rank_has_written(tmp_path):
    """Two ranks vote at each step boundary (during the next step) on whether both have finished writing; the
    commit follows, with the same contents as a synchronous save, and a SIGTERM stop commits the pending save
    before its own."""
    train(tmp_path / "sync", *FOR_LOOP, ngpu=2)
    out = train(tmp_path / "async", *FOR_LOOP, "--checkpoint.async_mode", "async", ngpu=2).stdout
    staged, commit_at = out.index("checkpoint: step 10 staged"), out.index("checkpoint: step 10 committed")
    assert "step: 11" in out[staged:commit_at] and "in the background over" in out[commit_at:].splitlines()[0]
    for step in (10, 20):
        a = read_full(str(tmp_path / "sync" / "checkpoint" / f"step-{step:06d}"))
        b = read_full(str(tmp_path / "async" / "checkpoint" / f"step-{step:06d}"))
        assert same_tensors(a, b), step
        for run in ("sync", "async"):  # each rank's checksums written, folded into the marker
            folder = tmp_path / run / "checkpoint" / f"step-{step:06d}"
            sums = json.loads((folder / COMMIT_FILE).read_text())[CHECKSUM_KEY]
            assert sums == {str(p.relative_to(folder)): file_checksum(str(p)) for p in folder.rglob("*")
                             if p.is_file() and p.name != COMMIT_FILE}
            assert "__1_0.distcp" in sums and not (folder / CHECKSUM_DIR).exists()
    assert curve(tmp_path / "async", range(1, 21)) == curve(tmp_path / "sync", range(1, 21))
    stopped = train(tmp_path / "stopped", *FOR_LOOP, "--checkpoint.async_mode", "async", fault="10:sigterm", ngpu=2)
    assert "SIGTERM: checkpoint of step 11 saved; exiting" in stopped.stdout
    assert committed(tmp_path / "stopped" / "checkpoint") == [10, 11]


# ------------------------------------------------------------------------------------------------------------
# Bad checkpoints
# ------------------------------------------------------------------------------------------------------------


def _recommit(folder: Path) -> None:
    """Rewrite the commit marker's file sizes and checksums (a damaged folder that still looks committed)."""
    marker = json.loads((folder / COMMIT_FILE).read_text())
    marker["files"] = {k: (folder / k).stat().st_size for k in marker["files"] if (folder / k).exists()}
    marker[CHECKSUM_KEY] = {k: file_checksum(str(folder / k)) for k in marker["files"]}
    (folder / COMMIT_FILE).write_text(json.dumps(marker))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _damage(kind: str, folder: Path) -> None:
    if kind == "missing metadata":
        (folder / ".metadata").unlink()
    elif kind == "corrupt metadata":
        size = (folder / ".metadata").stat().st_size
        (folder / ".metadata").write_bytes(b"\x80\x04garbage" + b"\x00" * (size - 9))
    elif kind == "pickled code in metadata":
        import pickle

        (folder / ".metadata").write_bytes(pickle.dumps(_Evil()))
        _recommit(folder)
    elif kind == "dotted global in metadata":  # a name reaching through an allowed module to os.system
        def text(x):
            return b"\x8c" + bytes([len(x)]) + x.encode()

        marker = folder.parent / "PWNED"
        (folder / ".metadata").write_bytes(
            b"\x80\x04" + text("torch.distributed.checkpoint.filesystem") + text("os.system") + b"\x93"
            + text(f"touch {marker}") + b"\x85R."
        )
        _recommit(folder)
    elif kind == "edited train state":
        state = json.loads((folder / "train_state.json").read_text())
        del state["lr_scheduler"]
        state["dp"] = "one"
        (folder / "train_state.json").write_text(json.dumps(state))
        _recommit(folder)
    elif kind == "another flavor":
        state = json.loads((folder / "train_state.json").read_text())
        state["flavor"] = "8B"
        (folder / "train_state.json").write_text(json.dumps(state))
        _recommit(folder)
    elif kind == "other bytes, same size":  # a flipped bit: only the checksum tells
        shard = folder / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif kind == "edited checksums":
        marker = json.loads((folder / COMMIT_FILE).read_text())
        marker[CHECKSUM_KEY]["train_state.json"] = "0"
        (folder / COMMIT_FILE).write_text(json.dumps(marker))
    elif kind == "truncated shard":
        shard = folder / "__0_0.distcp"
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif kind == "no commit marker":
        (folder / COMMIT_FILE).unlink()
    elif kind == "corrupt commit marker":
        (folder / COMMIT_FILE).write_text('{"step": 10, "files": {')
    else:
        raise AssertionError(kind)


BAD = {
    "missing metadata": ".metadata is missing",
    "corrupt metadata": "unreadable or unsafe",
    "pickled code in metadata": "refusing to unpickle",
    "dotted global in metadata": "refusing to unpickle torch.distributed.checkpoint.filesystem.os.system",
    "another flavor": "saved for model llama3/8B, this run is llama3/debugmodel_L2",
    "edited train state": "train_state.json has no valid lr_scheduler.last_epoch, dp (edited or damaged)",
    "truncated shard": "__0_0.distcp has",
    "other bytes, same size": "__0_0.distcp has other bytes than were saved (xxh3 ",
    "edited checksums": f"{{folder}}/{COMMIT_FILE} has no valid xxh3 list (edited or damaged)",
    "no commit marker": "incomplete checkpoint",
    "corrupt commit marker": f"cannot read '{{folder}}/{COMMIT_FILE}' as JSON",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_checkpoint_is_an_error_naming_the_field_and_nothing_is_deleted(reference, tmp_path, kind):
    root = tmp_path / "checkpoint"
    shutil.copytree(reference / "checkpoint" / "step-000010", root / "step-000010")
    _damage(kind, root / "step-000010")
    before = tree(tmp_path)
    cfg = parse_args([*BASE, "--job.dump_folder", str(tmp_path), "--checkpoint.load_step", "10"])
    with pytest.raises(ConfigError, match="checkpoint.load_step") as e:
        plan_resume(cfg)
    assert BAD[kind].format(folder=root / "step-000010") in str(e.value), str(e.value)
    if kind != "another flavor":  # damaged: the advice fits where the folder came from
        assert str(e.value).endswith("; pick another step with checkpoint.load_step"), str(e.value)
        with pytest.raises(ConfigError) as given:  # a folder given by path: initial weights, convert_hf
            field = "checkpoint.initial_load_path"
            verify_checksums(inspect_checkpoint(str(root / "step-000010"), field), field)
        assert str(given.value).endswith("; use another step folder for checkpoint.initial_load_path")
    assert tree(tmp_path) == before


def test_checkpoint_that_does_not_fit_the_model_is_refused_before_anything_is_written(reference, tmp_path, capsys):
    """A checkpoint whose tensors do not fit the configured model (here another vocabulary size), to resume from
    or as initial weights (a Tessera step or a Hugging Face folder): one error line, the run folder untouched."""
    from engine import train as train_main

    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoint" / "step-000010", run / "checkpoint" / "step-000010")
    (run / "config.toml").write_text("# the earlier run's resolved config\n")
    hf = tmp_path / "hf"
    hf.mkdir()
    from models.llama3 import Llama3HFAdapter, llama3_flavors  # the debug model's config.json, with 4 KV heads

    config = Llama3HFAdapter.hf_config(dataclasses.replace(llama3_flavors["debugmodel_L2"], vocab_size=5000))
    (hf / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    cases = [
        ([], f"checkpoint.folder: {run / 'checkpoint' / 'step-000010'} has model.tok_embeddings.weight of shape "),
        (["--checkpoint.load_step", "0", "--checkpoint.initial_load_path", str(run / "checkpoint" / "step-000010")],
         "checkpoint.initial_load_path: "),
        (["--checkpoint.load_step", "0", "--checkpoint.initial_load_path", str(hf)],
         "checkpoint.initial_load_path: config.json has num_key_value_heads 4 but model.flavor debugmodel_L2 has "),
    ]
    for args, message in cases:
        before = tree(tmp_path)
        rc = train_main.main([*BASE, "--job.dump_folder", str(run), "--model.vocab_size", "5000", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), (args, err)
        assert tree(tmp_path) == before, args


def test_a_shard_damaged_after_its_commit_is_one_error_line(reference, tmp_path, capsys):
    """A data file whose bytes changed after the save (its size, which the commit marker checks, unchanged):
    resuming, starting from it and converting it each give one error line naming the field, and no file is
    changed. The checksums written with it name the file before anything is built; saved without them, the damage
    shows when the data is read, after the run has dumped its config (never DCP's per-rank tracebacks, nor
    torch.load's advice to load with weights_only=False)."""
    from engine import train as train_main
    from tools.convert_hf import main as convert

    run = tmp_path / "run"
    step = run / "checkpoint" / "step-000010"
    shutil.copytree(reference / "checkpoint" / "step-000010", step)
    with open(step / "__0_0.distcp", "r+b") as f:
        f.write(b"A" * 300)
    checked = f"{step} is damaged: __0_0.distcp has other bytes than were saved (xxh3 "
    undecodable = f"a data file of '{step}' is damaged (its size is as saved, its bytes are not: "
    for damaged in (checked, undecodable):
        if damaged == undecodable:  # saved without checksums (checkpoint.checksums = false)
            marker = json.loads((step / COMMIT_FILE).read_text())
            del marker[CHECKSUM_KEY]
            (step / COMMIT_FILE).write_text(json.dumps(marker))
        cases = [
            (lambda: train_main.main([*BASE, "--job.dump_folder", str(run)]),
             f"error: checkpoint.folder: {damaged}", "; pick another step with checkpoint.load_step"),
            (lambda: train_main.main([*BASE, "--job.dump_folder", str(tmp_path / "new"),
                                      "--checkpoint.initial_load_path", str(step)]),
             f"error: checkpoint.initial_load_path: {damaged}",
             "; use another step folder for checkpoint.initial_load_path"),
            (lambda: convert(["to-hf", str(step), str(tmp_path / "hf")]), f"error: checkpoint: {damaged}",
             "; use another step folder for checkpoint"),
        ]
        for run_it, start, end in cases:
            before = tree(tmp_path)
            rc = run_it()
            err = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(err) == 1 and err[0].startswith(start) and err[0].endswith(end), err
            assert "weights_only" not in err[0]
            after = tree(tmp_path)
            assert {k: after.get(k) for k in before} == before


def test_the_commit_marker_takes_each_ranks_checksums_and_the_ranks_share_the_check(tmp_path, monkeypatch):
    """Each rank's checksums of its own data files (written beside them once they are) go into the commit marker as
    they are, and the rest are computed there (a rank's that come after the commit are not written); checking,
    each rank reads its share of the files, each file once, the largest dealt first."""
    import engine.checkpoint.files as files

    folder = tmp_path / "step-000001"
    (folder / "rng").mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"a" * 300)
    (folder / "__1_0.distcp").write_bytes(b"b" * 200)
    (folder / "rng" / "rank-00000.json").write_text("{}")
    (folder / "train_state.json").write_text('{"step": 1}')
    files.write_own_checksums(str(folder), 0)
    (folder / CHECKSUM_DIR / "rank-00001.json").write_text(json.dumps({"__1_0.distcp": 12345}))  # as rank 1 said
    sizes = write_commit_marker(str(folder), 1)
    assert not (folder / CHECKSUM_DIR).exists() and sorted(sizes) == sorted(
        ["__0_0.distcp", "__1_0.distcp", "rng/rank-00000.json", "train_state.json"])
    sums = json.loads((folder / COMMIT_FILE).read_text())[CHECKSUM_KEY]
    assert sums == {"__0_0.distcp": file_checksum(str(folder / "__0_0.distcp")), "__1_0.distcp": 12345,
                     "rng/rank-00000.json": file_checksum(str(folder / "rng" / "rank-00000.json")),
                     "train_state.json": file_checksum(str(folder / "train_state.json"))}
    files.write_own_checksums(str(folder), 1)  # too late (rank 0 committed without it): leaves nothing behind
    assert not (folder / CHECKSUM_DIR).exists()
    sums["__1_0.distcp"] = file_checksum(str(folder / "__1_0.distcp"))
    info = files.CheckpointInfo(str(folder), 1, {}, {}, sums, sizes)
    read: list[list[str]] = []

    def sum_of(path: str) -> int:
        read[-1].append(os.path.relpath(path, folder))
        return info.checksums[read[-1][-1]]

    monkeypatch.setattr(files, "file_checksum", sum_of)
    for rank in range(2):
        read.append([])
        files.verify_checksums(info, "checkpoint.folder", rank, 2)
        assert info.verified[0] == 4
    assert read == [["__0_0.distcp", "train_state.json"], ["__1_0.distcp", "rng/rank-00000.json"]]


def test_the_commit_marker_lists_no_file_a_late_rank_is_still_writing(tmp_path, monkeypatch):
    """Rank 0 committing alone (close_alone) while another rank still writes its checksums: the checksums/ folder
    that rank makes again and a writer's temporary file are not listed, so the committed step never reads as
    missing a file that was renamed away."""
    import engine.checkpoint.files as files

    folder = tmp_path / "step-000001"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"a" * 300)
    files.write_own_checksums(str(folder), 0)
    rmtree = shutil.rmtree

    def late_rank(path, ignore_errors=False):
        rmtree(path, ignore_errors=ignore_errors)
        (folder / CHECKSUM_DIR).mkdir()  # rank 1's write_json, halfway
        (folder / CHECKSUM_DIR / "rank-00001.json.tmp4242").write_text("{")
        (folder / "train_state.json.tmp4242").write_text("{")

    monkeypatch.setattr(files.shutil, "rmtree", late_rank)
    sizes = write_commit_marker(str(folder), 1)
    assert sorted(sizes) == ["__0_0.distcp"]
    assert sorted(json.loads((folder / COMMIT_FILE).read_text())[CHECKSUM_KEY]) == ["__0_0.distcp"]


def test_a_data_file_that_cannot_be_read_is_not_called_damaged(tmp_path, monkeypatch):
    """Only bytes that do not decode make a data file "damaged" (a user error: pick another step). An OSError while
    reading (a failing disk, a stale network mount) is an OSError naming the file, with its traceback; anything
    else (a device error, a bug) is DCP's own exception, its traceback kept."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from engine.checkpoint.files import dcp_load

    folder = tmp_path / "step"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    shard = str(folder / "__0_0.distcp")

    def fails_with(error: Exception):
        def read_data(self, *args, **kwargs):
            raise error
        monkeypatch.setattr(FileSystemReader, "read_data", read_data)

    fails_with(OSError(errno.EIO, "Input/output error", shard))
    with pytest.raises(OSError) as e:
        dcp_load({"w": torch.empty(4)}, str(folder), "checkpoint.folder", no_dist=True)
    assert not isinstance(e.value, ConfigError)
    assert e.value.errno == errno.EIO and e.value.strerror == f"checkpoint.folder: cannot read '{shard}': " \
                                                              "Input/output error", e.value
    fails_with(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(CheckpointException, match="CUDA error: an illegal memory access"):
        dcp_load({"w": torch.empty(4)}, str(folder), "checkpoint.folder", no_dist=True)
    monkeypatch.undo()
    with open(shard, "r+b") as f:  # the damage the commit marker cannot see: its size is as saved
        f.write(b"A" * 64)
    with pytest.raises(ConfigError, match=f"^checkpoint.folder: a data file of '{folder}' is damaged "):
        dcp_load({"w": torch.empty(4)}, str(folder), "checkpoint.folder", no_dist=True)


def test_resuming_on_other_data_needs_the_dataloader_excluded(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoint" / "step-000010", run / "checkpoint" / "step-000010")
    data = tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps({"text": f"Another corpus, document {i}. " * 8}) + "\n" for i in range(300)))
    other = ["--data.path", str(data), "--job.dump_folder", str(run)]
    before = tree(tmp_path)
    proc = subprocess.run(["./run_train.sh", *BASE, *other, "--training.steps", "12"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: data.path: the checkpoint of step 10 holds a position in builtin:tessera_docs"
                               f", this run reads local:{data}"), lines[0]
    assert tree(tmp_path) == before
    # Excluded, the data starts from its beginning: steps 11 and 12 see the first batches of the new data.
    out = train(run, *other, "--training.steps", "12", "--checkpoint.exclude_from_loading", "dataloader").stdout
    assert "data position not loaded" in out and sorted(metrics(run)) == [11, 12]
    cfg = parse_args([*BASE, *other])
    loader = build_dataloader(cfg, build_tokenizer(cfg))
    next(loader), next(loader)
    saved = json.loads((run / "checkpoint" / "step-000012" / "dataloader" / "dp-00000.json").read_text())
    assert saved == json.loads(json.dumps(loader.state_dict()))  # where a fresh loader is after 2 batches
    # The step-12 checkpoint holds a position in the new data: the next resume needs no exclusion.
    train(run, *other, "--training.steps", "14")
    assert sorted(metrics(run)) == [11, 12, 13, 14]


def test_resuming_on_data_that_has_shrunk_is_one_error_line(tmp_path, capsys):
    """A map-style local file that lost documents since the checkpoint, which holds a position past the ones left:
    one error line naming data.path and the way out, found among the set-up checks that every rank agrees on
    (before the model is built or anything is written: the run folder is left as it was)."""
    from engine import train as train_main

    data, run = tmp_path / "docs.jsonl", tmp_path / "run"
    docs = [json.dumps({"text": f"Document {i} of a corpus that will shrink. " * 4}) + "\n" for i in range(300)]
    data.write_text("".join(docs))
    local = ["--data.path", str(data), "--data.streaming", "false"]
    train(run, *local, "--training.steps", "10")
    position = json.loads((run / "checkpoint" / "step-000010" / "dataloader" / "dp-00000.json").read_text())
    read = position["shards"]["0"]["docs_in_epoch"]
    assert read > 5, position
    data.write_text("".join(docs[:5]))
    before = tree(tmp_path)
    rc = train_main.main([*BASE, *local, "--job.dump_folder", str(run), "--training.steps", "12"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (f"error: data.path: the checkpoint's data position is record {read} of shard 0 of 1 (epoch 0), "
                      f"past the 5 records that shard of '{data}' (1 json file) now holds: the data changed since "
                      "that checkpoint; resume with the same data, or set checkpoint.exclude_from_loading = "
                      "[\"dataloader\"] to read it from its beginning"), err
    assert tree(tmp_path) == before


def test_data_position_is_loaded_on_another_shard_count_or_names_the_split(reference):
    """load_data_position (a set-up check): a loader of another shard count is rebuilt on the checkpoint's and
    takes its positions; a checkpoint's shards that do not split over this run's data-parallel ranks are a
    ConfigError naming data.num_shards and the way out (unless the data position is excluded)."""
    from types import SimpleNamespace

    from engine.checkpoint import resume

    info = inspect_checkpoint(str(reference / "checkpoint" / "step-000010"), "checkpoint.folder")
    saved = json.loads((reference / "checkpoint" / "step-000010" / "dataloader" / "dp-00000.json").read_text())

    def trainer(args: list[str], dp: int):
        cfg = parse_args([*BASE, *args])
        tok = build_tokenizer(cfg)
        return SimpleNamespace(cfg=cfg, dataloader=build_dataloader(cfg, tok, 0, dp),
                               rebuild=lambda n: build_dataloader(cfg, tok, 0, dp, n))

    def load_data_position(info, t):  # as the trainer does
        t.dataloader = resume.load_data_position(info, t.cfg, t.dataloader, t.rebuild)

    two = trainer(["--data.num_shards", "2"], 1)  # saved with 1 shard: rebuilt with 1
    load_data_position(info, two)
    assert two.dataloader.num_shards == 1 and json.loads(json.dumps(two.dataloader.state_dict())) == saved
    with pytest.raises(ConfigError, match=r"^data\.num_shards: the checkpoint of step 10 holds a data position in 1 "
                                          r"shards, which do not split evenly over 2 data-parallel ranks .*; resume on "
                                          r"a dp degree that divides 1, or set checkpoint\.exclude_from_loading"):
        load_data_position(info, trainer([], 2))
    excluded = trainer(["--checkpoint.exclude_from_loading", "dataloader"], 2)
    load_data_position(info, excluded)
    assert excluded.dataloader.num_shards == 2 and excluded.dataloader.state_dict()["shards"]["0"]["batches"] == 0


def test_resuming_with_the_other_data_streaming_setting_names_it(reference):
    """A map-style dataset (data.streaming = false) is read in a seeded order of its own, a stream in the files'
    order: a position in one means nothing in the other, so resuming across them is refused up front, naming
    data.streaming (unless the data position is excluded)."""
    from engine.checkpoint.resume import check_data_source
    from engine.data.datasets import resolve_source

    info = inspect_checkpoint(str(reference / "checkpoint" / "step-000010"), "checkpoint.folder")
    cfg = parse_args([*BASE, "--data.streaming", "false"])
    with pytest.raises(ConfigError, match=r"^data\.streaming: the checkpoint of step 10 holds a position in the data "
                                          r"read with data\.streaming = true .*exclude_from_loading"):
        check_data_source(info, resolve_source(cfg), cfg)
    check_data_source(info, resolve_source(cfg), parse_args([*BASE, "--data.streaming", "false",
                                                             "--checkpoint.exclude_from_loading", "dataloader"]))
    check_data_source(info, resolve_source(cfg), parse_args(BASE))


def test_resuming_on_another_split_text_column_or_framing_names_it(reference, tmp_path):
    """A data position counts records of one split, and tokens of one text column framed by one BOS/EOS:
    resuming with another data.split, data.text_field, or a tokenizer that frames documents otherwise (here
    without BOS), is refused up front, naming the field. A position saved before these were recorded resumes."""
    from engine.checkpoint.resume import check_data_source
    from engine.data.datasets import resolve_source

    info = inspect_checkpoint(str(reference / "checkpoint" / "step-000010"), "checkpoint.folder")
    assert build_tokenizer(parse_args(BASE)).bos_id == 0
    no_bos = tmp_path / "no_bos"
    no_bos.mkdir()
    shutil.copyfile(build_tokenizer(parse_args(BASE)).path, no_bos / "tokenizer.json")
    (no_bos / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|end_of_text|>"}))
    for args, message in (
        (["--data.split", "train[:50%]", "--data.streaming", "false"],
         r"^data\.split: the checkpoint of step 10 holds a position in builtin:tessera_docs read with data\.split = "
         r"'train', this run has 'train\[:50%\]'; resume with that, or set checkpoint\.exclude_from_loading"),
        (["--data.text_field", "body"], r"^data\.text_field: .* read with data\.text_field = 'text', this run has "
                                        r"'body'; "),
        (["--data.tokenizer", str(no_bos / "tokenizer.json")],
         r"^data\.tokenizer: .* read with a tokenizer whose bos_id is 0, this run has None; "),
    ):
        cfg = parse_args([*BASE, *args])
        with pytest.raises(ConfigError, match=message):
            check_data_source(info, resolve_source(cfg), cfg, build_tokenizer(cfg))
        excluded = parse_args([*BASE, *args, "--checkpoint.exclude_from_loading", "dataloader"])
        check_data_source(info, resolve_source(excluded), excluded, build_tokenizer(excluded))
    # A checkpoint whose data position has no record of these (saved by an earlier Tessera): not refused.
    old = tmp_path / "old"
    shutil.copytree(info.folder, old)
    for path in (old / "dataloader").iterdir():
        state = json.loads(path.read_text())
        for shard in state["shards"].values():
            del shard["reading"]
        path.write_text(json.dumps(state))
    cfg = parse_args([*BASE, "--data.text_field", "body"])
    check_data_source(dataclasses.replace(info, folder=str(old)), resolve_source(cfg), cfg, build_tokenizer(cfg))


def test_bad_checkpoints_through_run_train_sh(reference, tmp_path, capsys):
    """Each bad checkpoint is one error line naming its field, and nothing on disk changes. The first case goes
    through ./run_train.sh (the launcher passes the line and status 2 on); the others through the same entry
    point in this process (a launch each would add seconds and check nothing more)."""
    from engine import train as train_main

    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"  # a folder with files, none of them a save's
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    root = tmp_path / "run" / "checkpoint"
    shutil.copytree(reference / "checkpoint" / "step-000020", root / "step-000020")
    _damage("truncated shard", root / "step-000020")
    cases = [
        (["--job.dump_folder", str(tmp_path / "run")], "checkpoint.folder: ", "__0_0.distcp has"),
        (["--job.dump_folder", str(tmp_path / "fresh"), "--checkpoint.initial_load_path", str(empty)],
         "checkpoint.initial_load_path: ", "is empty"),
        (["--job.dump_folder", str(tmp_path / "fresh"), "--checkpoint.initial_load_path", str(other)],
         "checkpoint.initial_load_path: ", "is not a checkpoint (no COMMITTED.json, no DCP files); give a Tessera step "
                                           "folder (with COMMITTED.json) or a Hugging Face folder (with config.json)"),
        (["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.load_step", "7"],
         "checkpoint.load_step: ", "no checkpoint of step 7"),
        (["--job.dump_folder", str(tmp_path / "fresh"),
          "--checkpoint.initial_load_path", str(reference / "checkpoint")],
         "checkpoint.initial_load_path: ", f"holds step folders, not a checkpoint; give one of them, e.g. the newest "
                                           f"complete one, {reference / 'checkpoint' / 'step-000020'}"),
    ]
    for i, (args, field, message) in enumerate(cases):
        before = tree(tmp_path)
        if i == 0:
            proc = subprocess.run(["./run_train.sh", *BASE, *args], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "PYTHON": sys.executable}, timeout=120)
            returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            returncode = train_main.main([*BASE, *args])
            stdout, stderr = capsys.readouterr()
        lines = stderr.strip().splitlines()
        assert returncode == 2 and len(lines) == 1, stdout[-2000:] + stderr[-2000:]
        assert lines[0].startswith("error: " + field) and message in lines[0], lines[0]
        assert tree(tmp_path) == before


def test_a_run_without_checkpoint_enable_says_it_ignores_the_folders_checkpoints(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoint", run / "checkpoint")
    out = train(run, "--checkpoint.enable", "false", "--training.steps", "2").stdout
    assert (f"checkpoint: checkpoint.enable is off, so the 2 checkpoint(s) in {run / 'checkpoint'} (newest: step 20) "
            "are not resumed from and this run starts at step 0 (add --checkpoint.enable to resume)") in out, out
    assert sorted(metrics(run)) == [1, 2]


def resume_view_job(world_size: int, rank: int, dump: str, hidden_on_rank_1: bool) -> str:
    """plan_resume on every rank; with ``hidden_on_rank_1`` rank 1 sees an empty checkpoint folder (as a node
    would whose checkpoint folder is on its own disk). Returns rank 0's answer or error."""
    import engine.checkpoint.resume

    cfg = parse_args([*BASE, "--job.dump_folder", dump, "--training.steps", "30"])  # not finished: checked
    list_steps = engine.checkpoint.resume.list_steps
    if hidden_on_rank_1 and rank == 1:
        engine.checkpoint.resume.list_steps = lambda root: []
    try:
        info = engine.checkpoint.resume.plan_resume(cfg).checkpoint
    except ValueError as e:  # (a ConfigError on the rank that found it)
        return f"error: {e}"
    finally:
        engine.checkpoint.resume.list_steps = list_steps  # (the next job runs in the same process)
    return f"step {info.step}, {info.verified[0]} files checked"


def test_ranks_that_see_different_checkpoints_stop_before_loading(reference, tmp_path):
    """Every rank finds the same checkpoint, or every rank stops; each checks its share of the files' sizes and
    checksums, and a damaged file in one rank's share stops them all."""
    damaged = tmp_path / "damaged"
    step = damaged / "checkpoint" / "step-000020"
    shutil.copytree(reference / "checkpoint" / "step-000020", step)
    sums = json.loads((step / COMMIT_FILE).read_text())[CHECKSUM_KEY]
    second = sorted(sums, key=lambda rel: (-(step / rel).stat().st_size, rel))[1]  # rank 1's first file
    with open(step / second, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 1]))
    # The sizes are looked at in name order, each file by one rank: the second name is rank 1's.
    truncated = tmp_path / "truncated" / "checkpoint" / "step-000020"
    shutil.copytree(reference / "checkpoint" / "step-000020", truncated)
    name = sorted(sums)[1]
    with open(truncated / name, "r+b") as f:
        f.truncate(3)
    jobs = {"same": (str(reference), False), "split": (str(reference), True), "damaged": (str(damaged), False),
            "truncated": (str(truncated.parent.parent), False)}
    result = run_jobs(2, resume_view_job, jobs, str(tmp_path / "jobs"))
    assert result["same"] == "step 20, 5 files checked"
    assert result["damaged"].startswith(f"error: [rank 1] checkpoint.folder: {step} is damaged: {second} has other "
                                        "bytes than were saved (xxh3 "), result["damaged"]
    assert result["truncated"].startswith(f"error: [rank 1] checkpoint.folder: {truncated} is damaged: {name} has 3 "
                                          "bytes, "), result["truncated"]
    assert result["split"] == (f"error: checkpoint.folder: the ranks see different checkpoints to resume from in "
                               f"{reference / 'checkpoint'} (rank 0 step 20, rank 1 none); put it on a filesystem "
                               "every node shares and sees alike"), result["split"]


def test_a_model_only_checkpoint_is_not_resumed_from(reference, tmp_path):
    info = inspect_checkpoint(str(reference / "checkpoint" / "step-000010"), "checkpoint.folder")
    assert info.step == 10 and not info.model_only
    dump = tmp_path / "export"
    train(dump, "--training.steps", "3", "--checkpoint.interval", "3", "--checkpoint.last_save_model_only",
          "--checkpoint.export_dtype", "bfloat16")
    last = read_full(str(dump / "checkpoint" / "step-000003"))
    assert all(k.startswith("model.") and v.dtype == torch.bfloat16 for k, v in last.items())
    cfg = parse_args([*BASE, "--job.dump_folder", str(dump), "--training.steps", "5"])
    assert find_resume_point(cfg) is None  # model only: a start point (initial_load_path), not a resume point
    run = train(dump, "--training.steps", "4")  # a run there says so when it starts
    assert ("checkpoint: step 3 in " in run.stdout and "holds the model only (no optimizer or data state), so it "
            "is not resumed from and this run starts at step 0" in run.stdout), run.stdout[-2000:]


# ------------------------------------------------------------------------------------------------------------
# Hugging Face in and out, seed checkpoints
# ------------------------------------------------------------------------------------------------------------


def test_hf_export_and_import_start_a_run_from_the_same_weights(reference, tmp_path, monkeypatch):
    """to-hf then from-hf gives back the same weights; from-hf holds one tensor at a time (each fetched tensor is
    handed to DCP in memory whose release is observed), and training from either starts from the same weights."""
    import weakref

    from tools.convert_hf import from_hf, main as convert

    step = reference / "checkpoint" / "step-000020"
    assert convert(["to-hf", str(step), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    converter = sys.modules[from_hf.__module__]
    held, peak, write_tensors = [0], [0], converter.write_tensors

    def observed(folder, shapes, fetch):
        def fetch_observed(name):
            memory = fetch(name).numpy().copy()  # DCP keeps what it is given alive as long as it needs it
            held[0] += 1
            peak[0] = max(peak[0], held[0])
            weakref.finalize(memory, lambda: held.__setitem__(0, held[0] - 1))
            return torch.from_numpy(memory)
        return write_tensors(folder, shapes, fetch_observed)

    monkeypatch.setattr(converter, "write_tensors", observed)
    from_hf(str(tmp_path / "hf"), str(tmp_path / "back"), "debugmodel_L2")
    assert peak[0] <= 2 and held == [0], peak  # the tensor being written and the next one
    # Another flavor than the weights': the error names the command's option, and writes nothing.
    with pytest.raises(ValueError, match=r"^hf_folder: config.json has hidden_size 256 but --flavor 8B has dim 4096"):
        from_hf(str(tmp_path / "hf"), str(tmp_path / "wrong"), "8B")
    with pytest.raises(ValueError, match=r"^--model: unknown model 'nosuch'; known models: llama3"):
        from_hf(str(tmp_path / "hf"), str(tmp_path / "wrong"), "debugmodel_L2", "nosuch")
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match=r"^out: .*afile' already exists and is not an empty folder"):
        from_hf(str(tmp_path / "hf"), str(tmp_path / "afile"), "debugmodel_L2")
    assert not (tmp_path / "wrong").exists() and (tmp_path / "afile").read_text() == "mine"
    model = read_full(str(step), "model.")
    back = read_full(str(tmp_path / "back"), "model.")
    assert same_tensors(model, back)
    # Training from the HF folder starts from exactly the weights of training from the Tessera step.
    one = [*BASE, "--training.steps", "2", "--checkpoint.enable", "false"]
    run_jobs(1, train_job, {
        name: ([*one, "--checkpoint.initial_load_path", str(start), "--job.dump_folder", str(tmp_path / name)],)
        for name, start in (("from_hf", tmp_path / "hf"), ("from_step", step))
    }, str(tmp_path / "jobs"))
    assert curve(tmp_path / "from_hf", [1, 2]) == curve(tmp_path / "from_step", [1, 2])
    assert metrics(tmp_path / "from_hf")[1]["loss"] < metrics(reference)[1]["loss"] - 1  # trained weights


def hf_load_probe_job(world_size: int, rank: int, hf: str, argv: list[str]) -> list[dict]:
    """On every rank: build the Trainer for ``argv`` (initial weights from the Hugging Face folder ``hf``); return
    the names of the model values this rank holds that differ from the whole ``expected.pt`` beside ``hf``, and
    how many bytes loading the folder again into this rank's model parts reads; rank 0 returns every rank's."""
    import torch.distributed as dist

    from engine.hf import load_hf_into

    trainer = probe_trainer(argv, world_size)
    expected = torch.load(os.path.join(os.path.dirname(hf), "expected.pt"))
    held = trainer.checkpointer.model_state()
    wrong = mismatched(held, expected)
    read, _ = load_hf_into(trainer.model_parts, hf, trainer.model_args)
    trainer.checkpointer.close()
    trainer.metrics.close()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"keys": sorted(held), "mismatched": wrong, "read": read})
    return everyone


def test_hf_initial_weights_are_read_in_shards_on_any_layout(reference, tmp_path):
    """A Hugging Face folder given as checkpoint.initial_load_path arrives exactly on FSDP 3 (shards that cut
    through heads, whose wq/wk rows the adapter permutes), FSDP 2 x TP 2 with float8 layers, and PP 2 x FSDP 2;
    each rank reads only the slices it holds: together the ranks read the checkpoint about once, not once each."""
    from tools.convert_hf import main as convert

    step = reference / "checkpoint" / "step-000020"
    hf = tmp_path / "hf"
    assert convert(["to-hf", str(step), str(hf), "--dtype", "float32"]) == 0
    expected = read_full(str(step), "model.")
    torch.save(expected, tmp_path / "expected.pt")
    argv = [*BASE, "--training.steps", "2", "--checkpoint.enable", "false", "--checkpoint.initial_load_path", str(hf),
            "--checkpoint.initial_load_hf", "--training.global_batch_size", "12", *FOR_LOOP]
    layouts = {
        3: {"fsdp3": []},
        4: {"fsdp2_tp2_float8": ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--float8.enable",
                                 "--float8.emulate", "--training.global_batch_size", "8"],
            "pp2_fsdp2": ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--training.global_batch_size", "8"]},
    }
    data_bytes = sum(t.numel() * 4 for t in expected.values())
    for world, jobs in layouts.items():
        results = run_jobs(world, hf_load_probe_job, {
            name: (str(hf), [*argv, "--job.dump_folder", str(tmp_path / name), *args]) for name, args in jobs.items()
        }, str(tmp_path / f"world{world}"))
        for name, ranks in results.items():
            assert sorted({k for r in ranks for k in r["keys"]}) == sorted(expected), name  # every value held
            assert not [r["mismatched"] for r in ranks if r["mismatched"]], name  # and equal to the checkpoint's
            # Together about the checkpoint once (TP ranks both read the small replicated norms; FSDP 3 reads the
            # heads its shard boundaries cut twice); each rank about its share.
            assert data_bytes <= sum(r["read"] for r in ranks) <= 1.05 * data_bytes, name
            assert max(r["read"] for r in ranks) <= 1.1 * data_bytes / world, name


def test_export_reads_the_checkpoint_one_shard_at_a_time(reference, tmp_path, monkeypatch):
    """to-hf and last_save_hf read a step folder one output shard at a time (never the whole model), and write
    the same files as exporting the whole model from memory."""
    import engine.hf
    from engine.hf import export_checkpoint_hf, export_hf, model_args_for

    step, shard = reference / "checkpoint" / "step-000020", 2**20
    model = {k[len("model."):]: v for k, v in read_full(str(step), "model.").items()}
    reads, read_tensors = [], engine.hf.read_tensors
    monkeypatch.setattr(engine.hf, "read_tensors",
                        lambda folder, names, info: reads.append(names) or read_tensors(folder, names, info))
    export_checkpoint_hf(str(step), str(tmp_path / "streamed"), torch.float32, max_shard_bytes=shard)
    args = model_args_for("llama3", "debugmodel_L2", model["tok_embeddings.weight"].shape[0])
    export_hf(model, args, str(tmp_path / "whole"), torch.float32, max_shard_bytes=shard)
    assert tree(tmp_path / "streamed") == tree(tmp_path / "whole")
    files = [f for f in os.listdir(tmp_path / "streamed") if f.endswith(".safetensors")]
    assert len(files) == len(reads) > 5  # one read per shard
    largest = max(v.numel() * 4 for v in model.values())  # the 4096 x 256 embedding: a shard of its own
    assert all(sum(model[k[len("model."):]].numel() * 4 for k in names) <= max(shard, largest) for names in reads)
    assert sorted(k for names in reads for k in names) == sorted(f"model.{k}" for k in model)


def test_ranks_export_together_through_the_files_alone(reference, tmp_path, monkeypatch):
    """last_save_hf on several ranks: each output shard is written by one rank, one rank per node first, and rank
    0 finishes the folder once every shard is there (no collective: the ranks run here as threads that share
    nothing but the files); the folder equals one process's export. An export interrupted after some ranks wrote
    their shards is finished by the next attempt, which writes only the shards still missing."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import engine.hf
    from engine.hf import export_checkpoint_hf, shard_writer

    # 8 ranks on 2 nodes: the shards go to node 0 and node 1 in turn, then to the next rank of each node.
    assert [shard_writer(i, 8, 4) for i in range(10)] == [0, 4, 1, 5, 2, 6, 3, 7, 0, 4]
    assert [shard_writer(i, 4, 1) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    step, shard = str(tmp_path / "step-000020"), 2**20
    shutil.copytree(reference / "checkpoint" / "step-000020", step)  # a copy: its commit marker changes below
    export_checkpoint_hf(step, str(tmp_path / "one"), torch.float32, max_shard_bytes=shard)
    n_shards = sum(f.endswith(".safetensors") for f in os.listdir(tmp_path / "one"))
    assert n_shards > 5
    writers, rank_of = [], threading.local()
    write_shard = engine.hf._write_shard
    monkeypatch.setattr(engine.hf, "_write_shard", lambda path, *a: writers.append(
        (rank_of.rank, os.path.basename(path))) or write_shard(path, *a))

    def export(out: str, ranks: list[int]) -> None:
        def rank_job(rank: int) -> None:
            rank_of.rank = rank
            export_checkpoint_hf(step, out, torch.float32, max_shard_bytes=shard, rank=rank, world_size=4,
                                 node_size=2)
        with ThreadPoolExecutor(len(ranks)) as pool:  # rank 0 first: it waits for the others' shards
            for job in [pool.submit(rank_job, rank) for rank in ranks]:
                job.result()

    export(str(tmp_path / "four"), [0, 1, 2, 3])
    assert tree(tmp_path / "four") == tree(tmp_path / "one")
    names = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".safetensors"))
    assert sorted(writers) == sorted((shard_writer(i, 4, 2), name) for i, name in enumerate(names))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # nothing left aside

    writers.clear()  # ranks 1-3 wrote their shards, then the job ended before rank 0 finished the folder
    export(str(tmp_path / "again"), [1, 2, 3])
    assert not (tmp_path / "again").exists() and len(writers) == n_shards - len(names[::4])
    writers.clear()
    export(str(tmp_path / "again"), [0, 1, 2, 3])
    assert sorted(writers) == [(0, name) for name in names[::4]]  # only rank 0's, the ones still missing
    assert tree(tmp_path / "again") == tree(tmp_path / "one")
    # Shards of an interrupted export of another save of the step (trained again after a rollback) are not used.
    writers.clear()
    export(str(tmp_path / "other"), [1, 2, 3])
    commit = Path(step) / COMMIT_FILE
    commit.write_text(commit.read_text().replace('"time": ', '"time": 1'))
    export(str(tmp_path / "other"), [0, 1, 2, 3])
    assert len(writers) == 2 * n_shards - len(names[::4])


def test_to_hf_copies_the_runs_tokenizer_unless_told_otherwise(reference, tmp_path, capsys):
    """Each checkpoint records the tokenizer its run trained with (from-hf: the Hugging Face folder's), and
    to-hf copies it, with its BOS/EOS ids in config.json, so that the folder is ready for transformers; a
    tokenizer that is gone, or --no-tokenizer, leaves it out with a note."""
    from engine.data.tokenizer import BUILTIN_TOKENIZER, Tokenizer
    from tools.convert_hf import from_hf, main as convert

    step = reference / "checkpoint" / "step-000020"
    assert json.loads((step / "train_state.json").read_text())["tokenizer"] == os.path.abspath(BUILTIN_TOKENIZER)

    def to_hf(source: Path, name: str, *extra: str) -> tuple[set[str], str]:
        assert convert(["to-hf", str(source), str(tmp_path / name), *extra]) == 0
        return set(os.listdir(tmp_path / name)), capsys.readouterr().out.strip()

    files, said = to_hf(step, "hf")
    assert "tokenizer.json" in files and said.endswith(f"tokenizer: the run's {os.path.abspath(BUILTIN_TOKENIZER)}")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == Path(BUILTIN_TOKENIZER).read_bytes()
    config, tokenizer = json.loads((tmp_path / "hf" / "config.json").read_text()), Tokenizer(BUILTIN_TOKENIZER)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    assert "tokenizer.json" not in to_hf(step, "none", "--no-tokenizer")[0]

    from_hf(str(tmp_path / "hf"), str(tmp_path / "back"), "debugmodel_L2")  # records hf/tokenizer.json
    capsys.readouterr()
    assert "tokenizer.json" in to_hf(tmp_path / "back", "again")[0]
    (tmp_path / "hf" / "tokenizer.json").unlink()
    files, said = to_hf(tmp_path / "back", "gone")
    assert "tokenizer.json" not in files and said.endswith("is gone (give --tokenizer FILE)"), said
    # A --tokenizer that is not there is refused naming the option, before anything is written.
    assert convert(["to-hf", str(step), str(tmp_path / "none2"), "--tokenizer", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --tokenizer: tokenizer file '{tmp_path / 'no.json'}' not found"), err
    assert not (tmp_path / "none2").exists()


def test_last_save_hf_writes_the_final_model_for_transformers(tmp_path):
    from engine.hf import load_hf, model_args_for
    from tests.test_hf import load_in_transformers

    dump = tmp_path / "run"
    args = ("--training.steps", "3", "--checkpoint.interval", "3", "--checkpoint.last_save_hf",
            "--checkpoint.export_dtype", "bfloat16")
    out = train(dump, *args, *FSDP2_TP2, ngpu=4).stdout
    hf = dump / "checkpoint" / "step-000003-hf"
    assert "Hugging Face folder of llama3/debugmodel_L2, step 3 (bfloat16) written in" in out, out[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    # Exactly the committed step's weights (saved over FSDP 2 x TP 2), rounded to bfloat16.
    model = read_full(str(dump / "checkpoint" / "step-000003"), "model.")
    model = {k[len("model."):]: v for k, v in model.items()}
    args_hf = model_args_for("llama3", "debugmodel_L2", model["tok_embeddings.weight"].shape[0])
    loaded = load_hf(str(hf), args_hf, model_label="model.flavor debugmodel_L2")
    assert sorted(loaded) == sorted(model)
    assert all(torch.equal(loaded[k], model[k].bfloat16().float()) for k in model)
    hf_model = load_in_transformers(str(hf))
    assert torch.equal(hf_model.lm_head.weight, model["output.weight"].bfloat16().float())
    assert committed(dump / "checkpoint") == [3]  # not a step folder itself
    # Run again (one rank now), it resumes at the last step and leaves the export as it is.
    before = tree(hf)
    again = train(dump, *args, ngpu=1).stdout
    assert "resumed at step 3: training.steps = 3 is reached, nothing to train" in again, again[-2000:]
    assert "already exists; left as it is" in again
    assert tree(hf) == before
    assert sorted(metrics(dump)) == [1, 2, 3]  # the finished run's metrics stay in metrics.jsonl
    # A finished run builds nothing (no model, no checkpoint load) and leaves the run's config.toml as it is; it
    # still writes a missing export.
    config = (dump / "config.toml").read_bytes()
    shutil.rmtree(hf)
    again = train(dump, *args, "--training.seq_len", "64", ngpu=2).stdout
    assert "model llama3/debugmodel" not in again and "resumed from step" not in again, again
    assert "Hugging Face folder of llama3/debugmodel_L2, step 3 (bfloat16) written in" in again
    assert tree(hf) == before and (dump / "config.toml").read_bytes() == config
    again = train(dump, *args, "--training.steps", "2").stdout
    assert "resumed at step 3: training.steps = 2 is reached, nothing to train" in again, again
    assert ("checkpoint.last_save_hf: no Hugging Face folder written: it is made of the step training.steps = 2 "
            "ends at, and the newest checkpoint is of step 3") in again, again
    assert (dump / "config.toml").read_bytes() == config and sorted(metrics(dump)) == [1, 2, 3]


def test_export_describes_the_run_and_names_the_tokenizer_for_transformers(tmp_path):
    """A run at a seq_len beyond its flavor's max_seq_len (debugmodel: 2048) exports config.json with the run's
    context as max_position_embeddings, at the end of the run and by to-hf; a tokenizer file of another name is
    copied as tokenizer.json, which transformers reads."""
    from transformers import AutoTokenizer

    from engine.data.tokenizer import BUILTIN_TOKENIZER
    from tools.convert_hf import main as convert

    dump = tmp_path / "run"
    train(dump, "--training.steps", "1", "--training.seq_len", "4096", "--training.local_batch_size", "1",
          "--checkpoint.interval", "1", "--checkpoint.last_save_hf", "--checkpoint.export_dtype", "float32")
    mine = tmp_path / "tokenizers" / "my_tok.json"
    mine.parent.mkdir()
    shutil.copyfile(BUILTIN_TOKENIZER, mine)
    step = dump / "checkpoint" / "step-000001"
    assert convert(["to-hf", str(step), str(tmp_path / "hf"), "--tokenizer", str(mine)]) == 0
    for hf in (dump / "checkpoint" / "step-000001-hf", tmp_path / "hf"):
        config = json.loads((hf / "config.json").read_text())
        assert config["max_position_embeddings"] == 4096, hf
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tokenizer.json"]
    text = "Return the number of items in a container."
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text)["input_ids"][1:] == \
        build_tokenizer(parse_args([])).encode(text, bos=False, eos=False)


def test_seed_checkpoint_starts_any_layout_from_the_same_weights(tmp_path):
    seed = tmp_path / "seed"
    train(seed, "--checkpoint.create_seed_checkpoint", "--debug.seed", "7")
    folder = seed / "checkpoint" / "step-000000"
    assert inspect_checkpoint(str(folder), "checkpoint").model_only
    # Made again in a folder that holds a trained checkpoint: the initialized weights, not the trained ones.
    again = tmp_path / "again"
    train(again, "--debug.seed", "7", "--training.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "1")
    train(again, "--checkpoint.create_seed_checkpoint", "--debug.seed", "7", "--checkpoint.enable")
    assert same_tensors(read_full(str(again / "checkpoint" / "step-000000")), read_full(str(folder)))
    # Made on PP 2 x FSDP 2 x TP 2 (each rank writing its shards): the same weights.
    train(tmp_path / "seed8", "--checkpoint.create_seed_checkpoint", "--debug.seed", "7", "--parallelism.pp", "2",
          "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--training.global_batch_size", "8", ngpu=8)
    one, eight = read_full(str(folder)), read_full(str(tmp_path / "seed8" / "checkpoint" / "step-000000"))
    assert same_tensors(one, eight)
    one = [*BASE, "--training.steps", "2", "--checkpoint.enable", "false"]
    printed = run_jobs(2, train_job, {  # FSDP 2: both runs in one pair of ranks
        "seeded": ([*one, "--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / "seeded")],),
        "direct": ([*one, "--debug.seed", "7", "--job.dump_folder", str(tmp_path / "direct")],),
    }, str(tmp_path / "jobs"))
    assert curve(tmp_path / "seeded", [1, 2]) == curve(tmp_path / "direct", [1, 2])
    files = len(json.loads((folder / "COMMITTED.json").read_text())[CHECKSUM_KEY])
    assert re.search(rf"checkpoint: initial weights from {re.escape(str(folder))} \(step 0\) in [0-9.]+s; its "
                     rf"{files} files matched their checksums \(checked in [0-9.]+s\)", printed["seeded"]), printed
