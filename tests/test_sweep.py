"""The sweep tool: a CPU smoke of tp 1, 2 over gloo (2 ranks; tp 1, 2, 4 on 4 ranks works the same at twice
the CI time), its CSV and plots; errors before anything runs."""

import csv
import json
import os

import pytest

from tools import sweep

SMALL = ["--model.flavor", "debugmodel_L2",  # 2 layers: depth adds nothing here
         "--training.seq_len", "64", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1",
         "--metrics.log_freq", "1", "--metrics.peak_flops", "1e11", "--metrics.no-plots"]  # the sweep draws its own
PNG = b"\x89PNG\r\n\x1a\n"


def test_cpu_sweep_of_tp(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = sweep.main(["--config", "train_configs/debug_model.toml", "--dim", "parallelism.tp", "--values", "1,2",
                     "--ngpu", "2", "--steps", "3", "--warmup", "1", "--out", str(out), *SMALL])
    text = capsys.readouterr().out
    assert rc == 0, text
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["value"] for r in rows] == ["1", "2"]
    for row, dp_shard in zip(rows, (2, 1)):
        assert row["status"] == "ok" and row["dim"] == "parallelism.tp" and row["world_size"] == "2"
        assert f"dp_shard {dp_shard} x cp 1 x tp {row['value']}" in row["layout"]  # dp_shard = -1 took the rest
        assert row["steps_measured"] == "2-3"
        for key in ("tps", "tps_per_gpu", "tflops", "mfu", "memory_gib", "last_loss"):
            assert float(row[key]) > 0, (key, row)
        assert float(row["tps"]) == pytest.approx(2 * float(row["tps_per_gpu"]))
    for name in ("tps_per_gpu.png", "mfu.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == PNG
    with open(out / "configs" / "2.toml") as f:
        assert "tp = 2" in f.read()
    # --collect gathers the same numbers again.
    assert sweep.main(["--collect", "--out", str(out), "--warmup", "1"]) == 0
    with open(out / "sweep.csv") as f:
        assert list(csv.DictReader(f)) == rows


def test_an_impossible_value_stops_before_any_run(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = sweep.main(["--dim", "parallelism.tp", "--values", "1,3", "--ngpu", "4", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: parallelism.tp = 3: parallelism"), err
    assert not out.exists()  # every value is checked before the first config is written


def test_a_sweep_into_an_earlier_one_is_refused(tmp_path, capsys):
    """A run folder that holds an earlier run: its metrics.jsonl (appended to) would mix into the new CSV row."""
    out = tmp_path / "sweep"
    (out / "2").mkdir(parents=True)
    (out / "2" / "metrics.jsonl").write_text('{"step": 1}\n')
    rc = sweep.main(["--dim", "parallelism.tp", "--values", "1,2", "--ngpu", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: --out: {out / '2'} holds an earlier run"), err
    assert sorted(os.listdir(out)) == ["2"] and (out / "2" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def fake_sbatch(tmp_path, monkeypatch):
    """An sbatch on PATH that records its arguments in <tmp_path>/sbatch.txt and prints a job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/sbatch.txt\necho 77$RANDOM\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_sbatch_launcher_without_sbatch_stops_before_writing(tmp_path, monkeypatch, capsys):
    """No SLURM client on this machine: one error line naming --launcher, and no configs or scripts written."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch (python itself is already running)
    out = tmp_path / "sweep"
    rc = sweep.main(["--dim", "training.seq_len", "--values", "128,256", "--launcher", "sbatch", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: --launcher: sbatch is not on PATH (no SLURM client here); run the sweep on "
                               "the cluster's login node, or use --launcher local"], err
    assert not out.exists()


def test_sbatch_runs_are_checked_for_the_cluster_gpus(tmp_path, monkeypatch, capsys):
    """Runs for sbatch are validated for the cluster's GPUs: float8 passes on this CPU machine (a local sweep
    of it does not)."""
    fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.setattr(sweep, "launch_sbatch", lambda run, *a: setattr(run, "status", "submitted (stub)"))
    args = ["--dim", "parallelism.tp", "--values", "1", "--ngpu", "8", "--float8.enable", "true"]
    assert sweep.main([*args, "--launcher", "sbatch", "--out", str(tmp_path / "a")]) == 0, capsys.readouterr()
    assert sweep.main([*args, "--out", str(tmp_path / "b")]) == 2
    assert "float8" in capsys.readouterr().err


def test_summary_is_the_median_after_warmup(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 10.0 - s, "tps": 100.0 * s, "tps_per_gpu": 50.0 * s, "tflops": 1.0, "mfu": None,
                "memory_gib": 1.0 + s / 10} for s in range(1, 11)]
    with open(run / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    s = sweep.summarize_run(str(run), warmup=None)  # default: the first 5 of 10 steps left out
    assert s["steps_measured"] == "6-10"
    assert s["tps"] == 800.0 and s["tps_per_gpu"] == 400.0 and s["mfu"] is None
    assert s["memory_gib"] == 2.0 and s["last_loss"] == 0.0
    assert sweep.summarize_run(str(tmp_path / "missing"), warmup=None) == {}


def test_sbatch_launcher_submits_then_collects(tmp_path, monkeypatch, capsys):
    """--launcher sbatch renders one script per value and submits it; --collect gathers whatever has finished."""
    fake_sbatch(tmp_path, monkeypatch)
    out = tmp_path / "sweep"
    rc = sweep.main(["--dim", "parallelism.tp", "--values", "1,2", "--ngpu", "8", "--nodes", "2",
                     "--launcher", "sbatch", "--out", str(out), "--job-name", "tp"])
    assert rc == 0, capsys.readouterr()
    submitted = (tmp_path / "sbatch.txt").read_text().splitlines()
    assert submitted == [f"--parsable {out}/sbatch/1.sbatch", f"--parsable {out}/sbatch/2.sbatch"]
    script = (out / "sbatch" / "2.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --job-name=tp-2" in script
    # Its own config and folder, whatever CONFIG the submitting shell exports (sbatch passes it on).
    assert f"CONFIG={out / 'configs' / '2.toml'}  # this script's own" in script
    assert f"DUMP_FOLDER={out / '2'}\n" in script
    meta = json.loads((out / "sweep.json").read_text())
    assert all(r["status"].startswith("submitted (job 77") for r in meta["runs"])
    assert meta["runs"][1]["layout"] == "pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 2"  # 16 ranks
    # One run has finished: --collect puts it in the CSV, the other as "no metrics".
    (out / "1").mkdir()
    (out / "1" / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "loss": 5.0, "tps": 160.0, "tps_per_gpu": 10.0, "tflops": 1.0, "mfu": 2.0, "memory_gib": 3.0}) + "\n")
    assert sweep.main(["--collect", "--out", str(out)]) == 0
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["value"], r["status"], r["tps_per_gpu"]) for r in rows] == [("1", "ok", "10.0"), ("2", "no metrics", "")]
    assert (out / "memory.png").read_bytes()[:8] == PNG


def test_relative_input_paths_name_the_files_the_sweep_checked(tmp_path, monkeypatch, capsys):
    """Called from another directory with relative data and tokenizer paths: the configs it writes name the same
    files by absolute paths, since its runs start elsewhere (the checkout for --launcher local, a node's job
    folder for sbatch), where the relative paths name other files or none."""
    from engine.config import tomllib  # (tomli below Python 3.11)

    fake_sbatch(tmp_path, monkeypatch)
    monkeypatch.setattr(sweep, "launch_sbatch", lambda run, *a: setattr(run, "status", "submitted (stub)"))
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "c.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                   for i in range(8)))
    tokenizer = os.path.join(sweep.ROOT, "engine", "data", "assets", "tokenizer.json")
    os.symlink(tokenizer, work / "tok.json")
    monkeypatch.chdir(work)
    rc = sweep.main(["--config", os.path.join(sweep.ROOT, "train_configs", "debug_model.toml"),
                     "--dim", "training.local_batch_size", "--values", "2", "--launcher", "sbatch",
                     "--out", "sweep", "--data.path", "data/c.jsonl", "--data.tokenizer", "tok.json"])
    assert rc == 0, capsys.readouterr()
    with open(work / "sweep" / "configs" / "2.toml", "rb") as f:
        written = tomllib.load(f)
    assert written["data"]["path"] == str(work / "data" / "c.jsonl")
    assert written["data"]["tokenizer"] == str(work / "tok.json")
    assert written["checkpoint"]["folder"] == "checkpoint"  # relative to the run's folder, as it was


@pytest.mark.parametrize("flags,field", [
    (["--checkpoint.enable", "--checkpoint.folder", "{abs}"], "checkpoint.folder"),
    (["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.save_traces_folder", "{abs}"],
     "profiling.save_traces_folder"),
])
def test_an_absolute_run_folder_in_the_base_config_is_refused(tmp_path, capsys, flags, field):
    """An absolute checkpoint.folder would be every run's: tp = 2 resumed tp = 1's last step, had nothing to train
    and its CSV row said "no metrics". Refused with one line naming the field, before anything is written; unused
    (checkpointing off), it is harmless and allowed."""
    out = tmp_path / "sweep"
    argv = ["--config", "train_configs/debug_model.toml", "--dim", "parallelism.tp", "--values", "1,2", "--ngpu", "2",
            "--steps", "3", "--out", str(out)]
    flags = [f.replace("{abs}", str(tmp_path / "shared")) for f in flags]
    rc = sweep.main(argv + flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {field}: '{tmp_path / 'shared'}' is absolute"), err
    assert "relative to the run folder" in err[0] and not out.exists()
    runs = sweep.run_configs("train_configs/debug_model.toml", "parallelism.tp", ["1", "2"],
                             ["--checkpoint.folder", str(tmp_path / "shared")], 3, str(out), 2)
    assert [r.value for r in runs] == ["1", "2"]
