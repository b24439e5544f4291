"""Tests for engine.metrics (MetricsLogger, peak FLOP/s, memory) and engine.plot."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from engine.config import Config
from engine.metrics import MetricsLogger, device_memory, peak_flops_for_name, peak_flops_per_device, reset_peak_memory
from engine.plot import main as plot_main
from engine.plot import plot_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def make_cfg(tmp_path, **metrics) -> Config:
    cfg = Config()
    cfg.job.dump_folder = str(tmp_path / "run")
    for k, v in metrics.items():
        setattr(cfg.metrics, k, v)
    return cfg


# ------------------------------------------------------------------------------------------------ peak flops


def test_peak_flops_cpu_is_none_and_override_wins():
    assert peak_flops_per_device(CPU) is None
    assert peak_flops_per_device(CPU, fp8=True) is None
    assert peak_flops_per_device(CPU, override=-1) is None
    assert peak_flops_per_device(CPU, override=123e12) == 123e12
    assert peak_flops_per_device(torch.device("meta"), override=5e12) == 5e12


@pytest.mark.parametrize(
    "name,bf16,fp8",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
        ("NVIDIA H100 PCIe", 756e12, 1513e12),
        ("NVIDIA H100 NVL", 835e12, 1671e12),
        ("NVIDIA H200", 989e12, 1979e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 312e12),  # no fp8: bf16 peak
        ("NVIDIA L40S", 362e12, 733e12),
        ("NVIDIA B200", 2250e12, 4500e12),
    ],
)
def test_peak_flops_table(name, bf16, fp8):
    assert peak_flops_for_name(name) == bf16
    assert peak_flops_for_name(name, fp8=True) == fp8


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 3090", "NVIDIA A10", "NVIDIA L40", "Tesla V100-SXM2-16GB"])
def test_peak_flops_unknown_device(name):
    assert peak_flops_for_name(name) is None


def test_device_memory_cpu():
    mem = device_memory(CPU)
    assert mem["memory_gib"] > 0.01  # a Python process with torch imported has > 10 MiB resident
    assert mem["memory_reserved_gib"] is None
    assert 0 < mem["memory_pct"] < 100
    reset_peak_memory(CPU)  # no-op, must not raise


# ------------------------------------------------------------------------------------------------ logger


def test_log_numbers_and_jsonl(tmp_path, capsys):
    cfg = make_cfg(tmp_path, peak_flops=100e12)
    logger = MetricsLogger(cfg, rank=0, world_size=4, num_flops_per_token=6_000_000, device=CPU)
    # 80,000 global tokens in 2 s -> 40,000 tok/s, 10,000 per GPU; 6e6 * 1e4 = 6e10 FLOP/s = 0.06 TFLOP/s;
    # MFU = 6e10 / 1e14 = 0.06 %
    rec = logger.log(
        step=10, loss=7.5, grad_norm=torch.tensor(1.25), lr=8e-4, tokens=80_000, elapsed=2.0, data_wait=0.5,
        extra={"loss_scale": 1.0, "note": "x"},
    )
    logger.close()
    assert rec["tps"] == pytest.approx(40_000)
    assert rec["tps_per_gpu"] == pytest.approx(10_000)
    assert rec["tflops"] == pytest.approx(0.06)
    assert rec["mfu"] == pytest.approx(0.06)
    assert rec["data_wait_pct"] == pytest.approx(25.0)
    assert rec["grad_norm"] == 1.25 and isinstance(rec["grad_norm"], float)
    assert rec["memory_gib"] > 0 and rec["memory_reserved_gib"] is None

    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    line = out[0]
    for piece in ["step:", "loss:  7.5000", "tps:    40,000", "tps/gpu:    10,000", "tflops:    0.06", "mfu:  0.1%", "data_wait: 25.0%", "GiB"]:
        assert piece in line, (piece, line)
    assert "\x1b" not in line

    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    for key in ["step", "loss", "grad_norm", "lr", "tps", "tps_per_gpu", "tflops", "mfu", "memory_gib",
                "memory_reserved_gib", "data_wait_s", "elapsed_s", "time"]:
        assert key in data, key
    assert data["step"] == 10 and data["loss"] == 7.5 and data["lr"] == 8e-4
    assert data["tps"] == pytest.approx(40_000) and data["mfu"] == pytest.approx(0.06)
    assert data["data_wait_s"] == 0.5 and data["elapsed_s"] == 2.0
    assert data["loss_scale"] == 1.0 and data["note"] == "x"
    assert abs(data["time"] - time.time()) < 60

    # a resumed run appends to the same file
    logger = MetricsLogger(cfg, rank=0, world_size=4, num_flops_per_token=6_000_000, device=CPU)
    logger.log(step=20, loss=7.0, grad_norm=1.0, lr=8e-4, tokens=80_000, elapsed=2.0, data_wait=0.0)
    logger.close()
    steps = [json.loads(l)["step"] for l in path.read_text().splitlines()]
    assert steps == [10, 20]


def test_mfu_unknown_on_cpu(tmp_path, capsys):
    cfg = make_cfg(tmp_path)  # peak_flops = -1 -> table -> None on CPU
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=1000, device=CPU) as logger:
        rec = logger.log(step=1, loss=1.0, grad_norm=0.5, lr=1e-3, tokens=5000, elapsed=0.5, data_wait=0.0)
    assert rec["mfu"] is None
    assert rec["tps"] == pytest.approx(10_000) and rec["tps_per_gpu"] == pytest.approx(10_000)
    assert rec["tflops"] == pytest.approx(1e7 / 1e12)
    assert "mfu:   n/a" in capsys.readouterr().out
    data = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert data["mfu"] is None


def test_non_zero_rank_writes_nothing(tmp_path, capsys):
    cfg = make_cfg(tmp_path, enable_tensorboard=True, enable_wandb=True, wandb_mode="offline")
    logger = MetricsLogger(cfg, rank=1, world_size=2, num_flops_per_token=10, device=CPU)
    rec = logger.log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    logger.close()
    assert rec["tps_per_gpu"] == pytest.approx(50)  # still computed and returned
    assert not os.path.exists(tmp_path / "run")
    assert capsys.readouterr().out == ""


def test_save_for_all_ranks(tmp_path, capsys):
    cfg = make_cfg(tmp_path, save_for_all_ranks=True)
    for rank in (0, 1):
        with MetricsLogger(cfg, rank=rank, world_size=2, num_flops_per_token=10, device=CPU) as logger:
            logger.log(step=1, loss=1.0 + rank, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["metrics.jsonl", "metrics_rank0.jsonl", "metrics_rank1.jsonl"]
    assert json.loads((run / "metrics_rank1.jsonl").read_text())["loss"] == 2.0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1  # only rank 0 prints


def test_tensorboard_event_file(tmp_path, capsys):
    cfg = make_cfg(tmp_path, enable_tensorboard=True, peak_flops=1e12)
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=100, device=CPU) as logger:
        for step in (1, 2):
            logger.log(step=step, loss=3.0 / step, grad_norm=1.0, lr=1e-3, tokens=1000, elapsed=1.0, data_wait=0.1)
    events = glob.glob(str(tmp_path / "run" / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1 and os.path.getsize(events[0]) > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "grad_norm", "lr", "tps", "tps_per_gpu", "tflops", "mfu", "memory_gib"):
        assert tag in tags, tag
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("loss")] == [(1, 3.0), (2, 1.5)]


def no_wandb_login(tmp_path, monkeypatch):
    """wandb with no login, no WANDB_MODE and an unreachable server, its own folders under ``tmp_path``."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))


def run_script(script: str) -> subprocess.CompletedProcess:
    """``script`` in a child process (wandb's service and console hooks never touch the test process)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_wandb_offline(tmp_path, monkeypatch):
    """Offline wandb works with no login and an unreachable server. Run in a child process so wandb's service and
    console hooks never touch the test process, and a hang hits the timeout (its speed is not a test's business)."""
    no_wandb_login(tmp_path, monkeypatch)
    dump = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import torch
        from engine.config import Config
        from engine.metrics import MetricsLogger
        cfg = Config()
        cfg.job.dump_folder = {str(dump)!r}
        cfg.metrics.enable_wandb = True
        cfg.metrics.wandb_mode = "offline"
        cfg.metrics.wandb_project = "tessera-test"
        logger = MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=100, device=torch.device("cpu"))
        for step in (1, 2):
            logger.log(step=step, loss=1.0 / step, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
        logger.close()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = glob.glob(str(dump / "wandb" / "offline-run-*"))
    assert len(runs) == 1, os.listdir(dump)
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert len((dump / "metrics.jsonl").read_text().splitlines()) == 2


WANDB_RUN = """
import sys, torch
from engine.config import Config
from engine.metrics import MetricsLogger
def run(dump, mode, fresh):
    cfg = Config()
    cfg.job.dump_folder = dump
    cfg.metrics.enable_wandb = True
    cfg.metrics.wandb_project = "tessera-test"
    if mode:
        cfg.metrics.wandb_mode = mode
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=100, device=torch.device("cpu"),
                       fresh=fresh) as logger:
        logger.log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
"""


def test_wandb_mode_auto_follows_the_wandb_mode_environment_variable(tmp_path, monkeypatch):
    """WANDB_MODE=offline with metrics.wandb_mode left at its default: an offline run, not wandb's no-login error;
    WANDB_MODE=disabled: no wandb run. A mode set in the config wins over the variable."""
    no_wandb_login(tmp_path, monkeypatch)
    assert Config().metrics.wandb_mode == "auto"
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_script(WANDB_RUN + f"run({str(tmp_path / 'env_offline')!r}, '', True)")
    assert len(glob.glob(str(tmp_path / "env_offline" / "wandb" / "offline-run-*"))) == 1

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_script(WANDB_RUN + f"run({str(tmp_path / 'env_disabled')!r}, '', True)\n"
               f"run({str(tmp_path / 'field_offline')!r}, 'offline', True)")
    assert os.listdir(tmp_path / "env_disabled") == ["metrics.jsonl"]
    assert len(glob.glob(str(tmp_path / "field_offline" / "wandb" / "offline-run-*"))) == 1


def test_a_resumed_run_goes_on_in_the_same_wandb_run(tmp_path, monkeypatch):
    """The run folder keeps its wandb run id: a resumed run logs to the same wandb run (the offline runs share the
    id, so wandb sync joins them); a fresh run in the folder starts a new one."""
    no_wandb_login(tmp_path, monkeypatch)
    dump = tmp_path / "run"
    # The three runs one after the other in one child process (wandb's service starts once).
    printed = run_script(WANDB_RUN + f"""
for fresh in (True, False, True):
    run({str(dump)!r}, 'offline', fresh)
    print('run id:', open({str(dump / "wandb_run_id")!r}).read().strip())
""").stdout
    ids = [line.split()[-1] for line in printed.splitlines() if line.startswith("run id:")]
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2] and all(len(i) == 8 for i in ids), printed
    runs = sorted(glob.glob(str(dump / "wandb" / "offline-run-*")))
    assert len(runs) == 3
    names = [os.path.basename(r) for r in runs]  # offline-run-<time>-<id>[-<n>]
    assert sum(ids[0] in name for name in names) == 2 and sum(ids[2] in name for name in names) == 1


WANDB_RESUME = """
import torch
from engine.config import Config
from engine.metrics import MetricsLogger
def run(dump, steps, fresh, first_step, rewind):
    cfg = Config()
    cfg.job.dump_folder = dump
    cfg.metrics.enable_wandb = True
    cfg.metrics.wandb_mode = "offline"
    cfg.metrics.wandb_project = "tessera-test"
    cfg.metrics.wandb_rewind = rewind
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=100, device=torch.device("cpu"),
                       fresh=fresh, first_step=first_step) as logger:
        moment = logger._wandb_run.settings.resume_from
        print("resume_from:", None if moment is None else (moment.run, moment.value))
        for step in steps:
            logger.log(step=step, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
"""


def test_a_run_resumed_behind_the_wandb_run_warns_or_rewinds_it(tmp_path, monkeypatch):
    """A run logged steps 1-6 and was killed after its step-3 checkpoint: the resumed run trains 4-6 again, which
    wandb (steps only go up) would drop without a word. It says so, naming the steps; with metrics.wandb_rewind
    the wandb run is rewound to step 3 (wandb.init(resume_from="<id>?_step=3")) and nothing is dropped."""
    no_wandb_login(tmp_path, monkeypatch)
    dump = str(tmp_path / "run")
    # The five runs one after the other in one child process (wandb's service starts once), each one's output
    # after a line of its own.
    runs = [(range(1, 7), True, 1, False), ([4, 5], False, 4, False), ([6], False, 6, False), ([3], False, 3, True),
            ([4], False, 4, True)]
    script = "".join(f"print('=== run', flush=True)\nrun({dump!r}, {list(steps)}, {fresh}, {first_step}, {rewind})\n"
                     for steps, fresh, first_step, rewind in runs)
    first, warned, caught_up, rewound, ahead = run_script(WANDB_RESUME + script).stdout.split("=== run\n")[1:]
    assert "resume_from: None" in first and "warning" not in first
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    (line,) = [line for line in warned.splitlines() if "warning" in line]
    assert f"wandb run {run_id} already has steps up to 6" in line and "drops steps 4 to 6" in line, line
    assert "metrics.wandb_rewind" in line
    # The JSONL now ends at step 5: the next resume from step 6 on is behind nothing and says nothing.
    assert "warning" not in caught_up
    assert f"resume_from: ('{run_id}', 2)" in rewound and "warning" not in rewound
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == run_id
    assert "resume_from: None" in ahead and "warning" not in ahead  # nothing to rewind


def test_console_line_shows_peak_active_and_reserved_memory():
    """Design §6: the console line has peak active and reserved memory (reserved: CUDA's caching allocator)."""
    cfg = Config()
    logger = MetricsLogger(cfg, rank=1, world_size=1, num_flops_per_token=1, device=CPU)
    record = {"step": 3, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tps": 10.0, "tps_per_gpu": 10.0,
              "tflops": 1.0, "mfu": 40.0, "memory_gib": 30.5, "memory_pct": 38.5, "memory_reserved_gib": 34.25,
              "memory_reserved_pct": 43.25, "data_wait_pct": 1.0}
    assert "memory: 30.50GiB (38.5%), reserved 34.25GiB (43.2%)  " in logger.format_line(record)
    record.update(memory_reserved_gib=None, memory_reserved_pct=None)  # CPU: the peak RSS only
    assert "memory: 30.50GiB (38.5%)  data_wait" in logger.format_line(record)


def test_a_fresh_run_sets_the_earlier_config_aside(tmp_path, capsys):
    """The earlier run's config.toml goes aside with its metrics (config.<n>.toml, the same n) instead of being
    overwritten by the new run's; a resumed run leaves the run's config.toml where it is."""
    cfg = make_cfg(tmp_path)
    run = tmp_path / "run"
    log_steps(cfg, [1, 2], 3.0, fresh=True)
    (run / "config.toml").write_text("# first run\n")
    log_steps(cfg, [3], 3.0, fresh=False, first_step=3)
    assert (run / "config.toml").read_text() == "# first run\n"
    (run / "metrics.1.jsonl").write_text("")  # n = 1 is taken
    log_steps(cfg, [1], 2.0, fresh=True)
    assert sorted(os.listdir(run)) == ["config.2.toml", "metrics.1.jsonl", "metrics.2.jsonl", "metrics.jsonl"]
    assert (run / "config.2.toml").read_text() == "# first run\n"
    assert len((run / "metrics.2.jsonl").read_text().splitlines()) == 3


# ------------------------------------------------------------------------------------------------ plot


def write_synthetic(path, n=20, with_mfu=True):
    with open(path, "w") as f:
        for i in range(1, n + 1):
            rec = {"step": i * 10, "loss": 8.0 / i, "grad_norm": 1.0 + 0.1 * i, "lr": 1e-3 * min(1, i / 5),
                   "tps": 4000.0 + i, "tps_per_gpu": 1000.0 + i, "tflops": 1.0, "mfu": 30.0 + i if with_mfu else None,
                   "memory_gib": 2.0, "memory_reserved_gib": 3.0, "data_wait_s": 0.0, "elapsed_s": 1.0, "time": 0.0}
            f.write(json.dumps(rec) + "\n")


def test_plot_writes_pngs(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    write_synthetic(jsonl)
    paths = plot_metrics(str(jsonl), str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["loss.png", "throughput.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 1000


def test_plot_cli_run_dir_default_out(tmp_path, capsys):
    write_synthetic(tmp_path / "metrics.jsonl", with_mfu=False)
    assert plot_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "loss.png"), str(tmp_path / "throughput.png")]
    assert all(os.path.getsize(p) > 0 for p in printed)


def test_plot_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    assert plot_main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"{bad}:2" in err and "\n" not in err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_main([str(empty)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {empty}")

    assert plot_main([str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not glob.glob(str(tmp_path / "*.png"))


def test_read_metrics_takes_each_resumed_segment_from_its_first_step(tmp_path):
    """A run logged 1-7, was resumed from its step-4 checkpoint (5-9 again), then rolled back to step 2 (3-6):
    the curve is 1-2 of the first segment, 3-6 of the last; 7-9 of the abandoned ones are gone."""
    from engine.plot import read_metrics

    jsonl = tmp_path / "metrics.jsonl"
    segments = [(1, range(1, 8)), (2, range(5, 10)), (3, range(3, 7))]
    jsonl.write_text("".join(json.dumps({"step": s, "loss": float(seg)}) + "\n"
                             for seg, steps in segments for s in steps))
    assert [(r["step"], r["loss"]) for r in read_metrics(str(jsonl))] == [(1, 1.0), (2, 1.0), (3, 3.0), (4, 3.0),
                                                                           (5, 3.0), (6, 3.0)]


def test_plot_cli_unreadable_input_and_unwritable_output_are_one_line(tmp_path, capsys):
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert plot_main([str(binary)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {binary}: cannot read") and "\n" not in err
    good = tmp_path / "good.jsonl"
    write_synthetic(good)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert plot_main([str(good), "--out", str(a_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out: cannot write plots to '{a_file}'") and "\n" not in err


def test_plot_module_entry_point(tmp_path):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text("not json\n")
    proc = subprocess.run([sys.executable, "-m", "engine.plot", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {bad}:1: not valid JSON (Expecting value)"


# ------------------------------------------------------------------------------------------------ torn records


def test_a_resumed_run_cuts_off_a_torn_last_record(tmp_path, capsys):
    """A crash (or a full disk) mid-write leaves a last line without its newline: a resumed run cuts it off and
    says so, so its first record starts a line of its own and the file stays readable."""
    from engine.plot import read_metrics

    cfg = make_cfg(tmp_path, save_for_all_ranks=True)
    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2))
    torn = json.dumps({"step": 3, "loss": 1.0})[:-7]
    for name in ("metrics.jsonl", "metrics_rank0.jsonl"):
        (run / name).write_text(whole + torn)
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=10, device=CPU) as logger:
        logger.log(step=3, loss=0.5, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    out = capsys.readouterr().out.splitlines()
    for name in ("metrics.jsonl", "metrics_rank0.jsonl"):
        assert f"metrics: {run / name} ended in an unfinished record (a write cut short by a crash or a full disk); " \
               f"cut off its {len(torn)} bytes, appending after the last whole record" in out
        lines = (run / name).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
        assert lines[:2] == whole.splitlines()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(run / "metrics.jsonl"))] == [(1, 1.0), (2, 1.0), (3, 0.5)]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path, capsys):
    cfg = make_cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}))
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=10, device=CPU) as logger:
        logger.log(step=2, loss=0.5, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    assert "unfinished record" not in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_fresh_run_keeps_the_earlier_torn_file_as_it_was(tmp_path, capsys):
    cfg = make_cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    old = json.dumps({"step": 1}) + '\n{"step": 2, "lo'
    (run / "metrics.jsonl").write_text(old)
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=10, device=CPU, fresh=True) as logger:
        logger.log(step=1, loss=0.5, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    assert (run / "metrics.1.jsonl").read_text() == old
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_read_metrics_leaves_out_a_torn_last_line_only(tmp_path):
    from engine.plot import MetricsFileError, read_metrics

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(str(jsonl))] == [1, 2]
    jsonl.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(str(jsonl))


def test_plot_run_failure_is_one_warning_line(tmp_path, capsys):
    """The plots at the end of a run: drawn and listed; none for an empty file; a corrupt file is one warning
    line, not an exception that would fail the finished run."""
    from engine.plot import plot_run

    write_synthetic(tmp_path / "metrics.jsonl")
    assert plot_run(str(tmp_path)) == [str(tmp_path / "loss.png"), str(tmp_path / "throughput.png")]
    assert capsys.readouterr().out == f"plots: {tmp_path / 'loss.png'}, {tmp_path / 'throughput.png'}\n"

    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_run(str(tmp_path)) == [] and capsys.readouterr().out == ""

    (tmp_path / "metrics.jsonl").write_text('not json\n{"step": 2}\n')
    assert plot_run(str(tmp_path)) == []
    assert capsys.readouterr().out == (f"warning: plots not drawn ({tmp_path / 'metrics.jsonl'}:1: not valid JSON "
                                       "(Expecting value)); the run itself is complete\n")


# ------------------------------------------------------------------------------------------------ validation


class FakeWandbRun:
    """Stands in for a wandb run: records what log() was given."""

    def __init__(self):
        self.logged = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        pass


def test_validation_is_recorded_at_its_own_step_in_every_sink(tmp_path, capsys):
    """Validation at steps 2, 3 and 4 with logs at 1, 3 and 6: every result is in metrics.jsonl, tensorboard and
    wandb at the step it ran, none is lost between logs or moved to the next log's step; the readers keep the
    training records apart (one per logged step, as before)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from engine.plot import read_metrics, read_run_metrics

    cfg = make_cfg(tmp_path, enable_tensorboard=True)
    wandb_run = FakeWandbRun()
    with MetricsLogger(cfg, rank=0, world_size=1, num_flops_per_token=10, device=CPU, fresh=True) as logger:
        logger._wandb_run = wandb_run
        logger.log(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
        logger.log_validation(2, 2.5, seconds=0.1)
        logger.log(step=3, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
        logger.log_validation(3, 2.25, seconds=0.1)
        logger.log_validation(4, torch.tensor(2.0), seconds=0.1)
        logger.log(step=6, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
    out = capsys.readouterr().out
    assert "validation: step 2  loss: 2.5000" in out and "validation: step 4  loss: 2.0000" in out

    path = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], "loss" in r, r.get("validation_loss")) for r in records] == [
        (1, True, None), (2, False, 2.5), (3, True, None), (3, False, 2.25), (4, False, 2.0), (6, True, None)]
    assert set(records[1]) == {"step", "validation_loss", "validation_s", "time"}

    train, validation = read_run_metrics(str(path))
    assert [r["step"] for r in train] == [r["step"] for r in read_metrics(str(path))] == [1, 3, 6]
    assert [(r["step"], r["validation_loss"]) for r in validation] == [(2, 2.5), (3, 2.25), (4, 2.0)]

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("validation_loss")] == [(2, 2.5), (3, 2.25), (4, 2.0)]
    assert [e.step for e in acc.Scalars("loss")] == [1, 3, 6]
    assert [(step, data["validation_loss"]) for step, data in wandb_run.logged if "validation_loss" in data] == [
        (2, 2.5), (3, 2.25), (4, 2.0)]
    assert all("validation_loss" not in data for _, data in wandb_run.logged if "loss" in data)


def test_read_run_metrics_segments_keep_validation_of_the_kept_steps(tmp_path):
    """A run logged 1-6 and validated at 2, 4, 5 (its last records: log 4, validation 4 and 5 after its step-4
    checkpoint; then it crashed). Resumed from step 4: the new records from step 5 on replace the old ones; an
    abandoned validation (5) goes, whether or not the resumed run validates there. An older file's validation_loss
    riding on a training record counts at its validation_step."""
    from engine.plot import read_run_metrics

    def rec(step, loss=None, val=None, **more):
        r = {"step": step}
        if loss is not None:
            r["loss"] = loss
        if val is not None:
            r["validation_loss"] = val
        return json.dumps({**r, **more}) + "\n"

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(rec(1, 1.0) + rec(2, 1.0) + rec(2, val=9.0) + rec(4, 1.0) + rec(4, val=8.0) + rec(5, val=7.0)
                     + rec(5, 2.0) + rec(6, 2.0) + rec(6, val=6.0))
    train, validation = read_run_metrics(str(jsonl))
    assert [(r["step"], r["loss"]) for r in train] == [(1, 1.0), (2, 1.0), (4, 1.0), (5, 2.0), (6, 2.0)]
    assert [(r["step"], r["validation_loss"]) for r in validation] == [(2, 9.0), (4, 8.0), (6, 6.0)]

    jsonl.write_text(rec(3, 1.0, val=5.0, validation_step=2) + rec(6, 0.5))
    assert [(r["step"], r["validation_loss"]) for r in read_run_metrics(str(jsonl))[1]] == [(2, 5.0)]


def test_plot_draws_the_validation_loss_beside_the_training_loss(tmp_path, monkeypatch):
    import engine.plot as plot

    figures = []
    real_save = plot._save
    monkeypatch.setattr(plot, "_save", lambda fig, path: (figures.append(fig), real_save(fig, path))[1])
    jsonl = tmp_path / "metrics.jsonl"
    write_synthetic(jsonl, n=5)
    lines = jsonl.read_text().splitlines(keepends=True)
    validation = {20: 6.0, 40: 5.0}  # each after the training record of its step
    with open(jsonl, "w") as f:
        for line, step in zip(lines, (10, 20, 30, 40, 50)):
            f.write(line)
            if step in validation:
                f.write(json.dumps({"step": step, "validation_loss": validation[step], "validation_s": 0.1}) + "\n")
    plot_metrics(str(jsonl), str(tmp_path))
    lines = figures[0].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["training loss", "validation loss"]
    assert list(lines[1].get_xdata()) == [20, 40] and list(lines[1].get_ydata()) == [6.0, 5.0]
    assert list(lines[0].get_xdata()) == [10, 20, 30, 40, 50]

    write_synthetic(jsonl, n=5)  # no validation: the training loss alone
    figures.clear()
    plot_metrics(str(jsonl), str(tmp_path))
    assert [line.get_label() for line in figures[0].axes[0].get_lines()] == ["training loss"]


# ------------------------------------------------------------------------------------------------ fresh, resumed


def tb_scalars(folder, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def log_steps(cfg, steps, loss, fresh, first_step=1, rank=0):
    with MetricsLogger(cfg, rank=rank, world_size=2, num_flops_per_token=10, device=CPU, fresh=fresh,
                       first_step=first_step) as logger:
        for step in steps:
            logger.log(step=step, loss=loss, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)


def test_a_fresh_run_sets_the_earlier_tensorboard_folder_aside(tmp_path, capsys):
    """A fresh run in a folder that holds an earlier run's tb/: that one becomes tb.<n> (with metrics.<n>.jsonl,
    the same n), and the new tb/ holds only the new run's events."""
    cfg = make_cfg(tmp_path, enable_tensorboard=True)
    run = tmp_path / "run"
    log_steps(cfg, [1, 2, 3], 3.0, fresh=True)
    log_steps(cfg, [1, 2], 2.0, fresh=True)
    assert tb_scalars(run / "tb") == [(1, 2.0), (2, 2.0)]
    assert tb_scalars(run / "tb.1") == [(1, 3.0), (2, 3.0), (3, 3.0)]
    (run / "metrics.2.jsonl").write_text("")  # the next n must name none of them: 2 is taken by a metrics file
    log_steps(cfg, [1], 1.0, fresh=True)
    assert sorted(os.listdir(run)) == ["metrics.1.jsonl", "metrics.2.jsonl", "metrics.3.jsonl", "metrics.jsonl",
                                       "tb", "tb.1", "tb.3"]
    assert tb_scalars(run / "tb") == [(1, 1.0)] and tb_scalars(run / "tb.3") == [(1, 2.0), (2, 2.0)]


def test_a_resumed_run_hides_the_steps_it_trains_again_in_tensorboard(tmp_path, capsys):
    """A run logged 1-6; resumed from its step-3 checkpoint (a rollback, or a crash after step 6), the new run
    logs 4-5: tensorboard shows 1-3 of the first run and 4-5 of the new one, not the abandoned 6."""
    cfg = make_cfg(tmp_path, enable_tensorboard=True)
    log_steps(cfg, range(1, 7), 3.0, fresh=True)
    log_steps(cfg, [4, 5], 2.0, fresh=False, first_step=4)
    assert tb_scalars(tmp_path / "run" / "tb") == [(1, 3.0), (2, 3.0), (3, 3.0), (4, 2.0), (5, 2.0)]


def test_a_fresh_run_sets_every_rank_metrics_file_aside(tmp_path, capsys):
    """metrics.save_for_all_ranks: a fresh run sets the earlier run's metrics_rank<N>.jsonl aside with
    metrics.jsonl (rank 0 does it for every rank, a rank of the earlier run that this one lacks too), so no file
    mixes two runs; the other ranks open their files at their first record, after that."""
    cfg = make_cfg(tmp_path, save_for_all_ranks=True)
    run = tmp_path / "run"
    for rank in (0, 1, 2):
        log_steps(cfg, [1, 2], 3.0, fresh=True, rank=rank)
    loggers = [MetricsLogger(cfg, rank=rank, world_size=2, num_flops_per_token=10, device=CPU, fresh=True)
               for rank in (1, 0)]  # rank 1 starts first: it must not open its file before rank 0 sets it aside
    for logger in loggers:
        logger.log(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100, elapsed=1.0, data_wait=0.0)
        logger.close()
    assert sorted(os.listdir(run)) == ["metrics.1.jsonl", "metrics.jsonl", "metrics_rank0.1.jsonl",
                                       "metrics_rank0.jsonl", "metrics_rank1.1.jsonl", "metrics_rank1.jsonl",
                                       "metrics_rank2.1.jsonl"]
    for rank in (0, 1):
        assert [json.loads(line)["loss"] for line in (run / f"metrics_rank{rank}.jsonl").read_text().splitlines()] \
            == [1.0]
        assert len((run / f"metrics_rank{rank}.1.jsonl").read_text().splitlines()) == 2
