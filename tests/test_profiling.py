"""The [profiling] and [comm] sections: torch.profiler traces of training steps, and collective timeouts."""

import json
import os

import pytest

from engine import train
from engine.config import parse_args
from engine.profiling import StepProfiler
from tests.parallel_harness import run_jobs

SMALL = ["--model.flavor", "debugmodel_L2",  # 2 layers: depth adds nothing here
         "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "1", "--metrics.no-plots"]


def _traced_steps(start_step: int, steps: int, *argv: str) -> dict[str, list[int]]:
    """Training steps start_step + 1 ... start_step + steps by the profiler's action for each."""
    import torch

    cfg = parse_args(["--profiling.enable_profiling", *argv])
    prof = StepProfiler(cfg, 0, start_step, torch.device("cpu"))
    by_action: dict[str, list[int]] = {}
    for n in range(steps):
        by_action.setdefault(prof._action(n).name, []).append(start_step + 1 + n)
    return by_action


def test_trace_windows_end_at_multiples_of_profile_freq():
    fresh = _traced_steps(0, 20, "--profiling.profile_freq", "10", "--profiling.profiler_warmup", "3",
                          "--profiling.profiler_active", "2")
    assert fresh["RECORD_AND_SAVE"] == [10, 20]
    assert fresh["RECORD"] == [9, 19]
    assert fresh["WARMUP"] == [6, 7, 8, 16, 17, 18]
    # A run resumed at step 7 traces the steps an uninterrupted run would.
    resumed = _traced_steps(7, 13, "--profiling.profile_freq", "10", "--profiling.profiler_warmup", "3",
                            "--profiling.profiler_active", "2")
    assert resumed["RECORD_AND_SAVE"] == [10, 20] and resumed["RECORD"] == [9, 19]
    assert resumed["WARMUP"] == [8, 16, 17, 18]


@pytest.mark.parametrize("steps, freq, warmup, active, windows", [
    (6, 3, 1, 2, {"iteration_3": 2, "iteration_6": 2}),
    # every step traced: the last window is not overwritten by the empty one torch closes at the run's end
    (2, 1, 0, 1, {"iteration_1": 1, "iteration_2": 1}),
    # the run ends in a window's warm-up: no trace of the shutdown alone
    (5, 3, 1, 1, {"iteration_3": 1}),
    # the run ends inside a recording window: the steps it recorded are kept, under the last one (steps 4
    # and 5, and the marker torch opened for the step that never came)
    (5, 3, 0, 3, {"iteration_3": 3, "iteration_5": 3}),
])
def test_profiled_run_writes_one_trace_per_window(tmp_path, capsys, monkeypatch, steps, freq, warmup, active,
                                                  windows):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dump = tmp_path / "run"
    rc = train.main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", str(steps),
                     "--profiling.enable_profiling", "--profiling.profile_freq", str(freq),
                     "--profiling.profiler_warmup", str(warmup), "--profiling.profiler_active", str(active)])
    assert rc == 0, capsys.readouterr().err
    traces = dump / "profile_traces"
    assert sorted(os.listdir(traces)) == sorted(windows)
    for window, recorded in windows.items():
        with open(traces / window / "rank0_trace.json") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name") for e in events}
        steps_traced = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
        assert len(steps_traced) == recorded, (window, steps_traced)
        assert {"aten::mm", "aten::addmm"} & names, window  # the model's matmuls were recorded


def test_sigterm_names_the_trace_of_its_last_step(tmp_path, capsys, monkeypatch):
    """A preemption signal at step 3 ends the run after that step: the window of steps 2-3 is iteration_3."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TESSERA_FAULT_AT", "3:sigterm")
    dump = tmp_path / "run"
    rc = train.main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "6", "--checkpoint.enable",
                     "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup",
                     "1", "--profiling.profiler_active", "2"])
    assert rc == 0, capsys.readouterr().err
    assert "SIGTERM: checkpoint of step 3 saved" in capsys.readouterr().out
    assert os.listdir(dump / "profile_traces") == ["iteration_3"]


def test_profiling_that_would_trace_no_step_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc = train.main(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.steps", "6",
                     "--profiling.enable_profiling"])  # profile_freq 10 by default
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error: profiling.profile_freq: 10 exceeds training.steps = 6"), err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------
# comm: 2 gloo ranks
# ----------------------------------------------------------------------------------------------------------------


def timeout_job(world_size: int, rank: int, dump: str) -> dict:
    """The timeouts of every process group after the trainer is built (the mesh's groups among them), while a
    checkpoint commits, and after its first steps."""
    import engine.checkpoint.checkpointer
    from engine.config.validation import validate
    from engine.distributed import collective_timeouts, init_distributed
    from engine.trainer import Trainer

    cfg = parse_args(["--config", "train_configs/debug_model.toml", "--job.dump_folder", dump, *SMALL,
                      "--training.steps", "3", "--parallelism.dp_shard", "2", "--comm.init_timeout_seconds", "77",
                      "--comm.train_timeout_seconds", "33", "--comm.checkpoint_timeout_seconds", "55",
                      "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"])
    committing, write_commit_marker = [], engine.checkpoint.checkpointer.write_commit_marker

    def spy(*args, **kwargs):  # rank 0, between the commit's barriers
        committing.append(collective_timeouts())
        return write_commit_marker(*args, **kwargs)

    engine.checkpoint.checkpointer.write_commit_marker = spy
    trainer = Trainer(cfg, init_distributed(cfg), validate(cfg, 2))
    built = collective_timeouts()
    trainer.train()
    return {"built": built, "committing": committing, "trained": collective_timeouts()}


def test_collective_timeouts_follow_the_comm_section(tmp_path):
    result = run_jobs(2, timeout_job, {"run": (str(tmp_path / "run"),)}, str(tmp_path))["run"]
    # the default group, the mesh's dp_shard group and its flattenings (at least two groups), and the async
    # checkpoint writer's gloo group, which keeps the checkpoint timeout throughout
    assert len(result["built"]) >= 3
    assert sorted(set(result["built"])) == [55.0, 77.0]
    assert len(result["committing"]) == 2  # steps 2 and 3: every group waits as long as the checkpoint may take
    assert all(set(timeouts) == {55.0} for timeouts in result["committing"])
    assert sorted(set(result["trained"])) == [33.0, 55.0]
