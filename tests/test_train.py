"""End to end: the entry point's user errors, a short training run, determinism, gradient accumulation."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from engine import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model.flavor", "debugmodel_L2",  # 2 layers: depth adds nothing here
         "--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2", "--metrics.no-plots"]  # plots: where they are checked


def run_main(argv, capsys):
    rc = train.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def jsonl_data(tmp_path):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(50):
            f.write(json.dumps({"body": f"document number {i} says hello to the world. " * 5}) + "\n")
    return str(path)


BAD_INPUTS = [
    (["--training.setps", "10"], "training.steps"),
    (["--training.steps", "ten"], "training.steps"),
    (["--training.steps", "-5"], "training.steps"),
    (["--config", "no_such_config.toml"], "--config"),
    (["--data.path", "/no/such/data.jsonl"], "data.path"),
    (["--model.flavor", "13B"], "model.flavor"),
    (["--model.attn", "xformers"], "model.attn"),
    (["--model.attn", "flash_attn"], "model.attn"),
    (["--training.local_batch_size", "0"], "training.local_batch_size"),
    (["--optimizer.lr", "-0.1"], "optimizer.lr"),
    (["--training.seq_len", "0"], "training.seq_len"),
    (["--training.global_batch_size", "6"], "training.global_batch_size"),
    (["--data.tokenizer", "/no/such/tokenizer.json"], "data.tokenizer"),
    (["--model.attn_mask", "block_causal"], "model.attn_mask"),
    (["--lr_scheduler.decay_type", "step"], "lr_scheduler.decay_type"),
    (["--optimizer.name", "Lion"], "optimizer.name"),
    (["--metrics.log_freq", "0"], "metrics.log_freq"),
    (["--training.loss_chunk_tokens", "-1"], "training.loss_chunk_tokens"),
    (["--model.sdpa_backend", "cudnn"], "model.sdpa_backend"),  # needs CUDA
    (["--model.sdpa_backend", "flash4"], "model.sdpa_backend"),
    (["--model.attn", "flex", "--model.sdpa_backend", "math"], "model.sdpa_backend"),
    (["--model.vocab_size", "100"], "model.vocab_size"),
    (["--model.hf_assets_path", "/no/such/folder"], "model.hf_assets_path: folder '/no/such/folder' not found; "
     "download the Hugging Face model's tokenizer.json and config.json into it (hf download REPO"),
    (["--profiling.profile_freq", "0"], "profiling.profile_freq"),
    (["--profiling.enable_profiling", "--profiling.profile_freq", "3"], "profiling.profile_freq"),  # < 3 + 1
    (["--profiling.enable_memory_snapshot"], "profiling.enable_memory_snapshot"),  # needs CUDA
    (["--comm.train_timeout_seconds", "0"], "comm.train_timeout_seconds"),
    (["--comm.trace_buf_size", "-1"], "comm.trace_buf_size"),
    (["--training.gc_freq", "-1"], "training.gc_freq"),
    (["--checkpoint.last_save_hf"], "checkpoint.last_save_hf"),  # needs checkpoint.enable
    (["--optimizer.lr", "nan"], "optimizer.lr"),
    (["--optimizer.lr", "inf"], "optimizer.lr"),
    (["--checkpoint.exclude_from_loading", "optimizer"], "checkpoint.exclude_from_loading"),
    (["--checkpoint.last_save_model_only"], "checkpoint.last_save_model_only"),  # needs checkpoint.enable
    (["--compile.no-autotune"], "compile.autotune"),  # needs compile.enable
    (["--compile.enable", "--compile.backend", "aot_eagre"], "compile.backend: 'aot_eagre' is not one of inductor, "
     "aot_eager, eager (did you mean"),
    (["--compile.backend", "aot_eager"], "compile.backend"),  # needs compile.enable
    (["--compile.enable", "--compile.backend", "eager", "--compile.no-autotune"], "compile.autotune"),  # inductor's
    (["--debug.seed", "4294967296"], "debug.seed: must be in [0, 2**32 - 1]"),
    (["--parallelism.pp_schedule", "1f1b"], "parallelism.pp_schedule"),  # checked at pp = 1 too
    (["--validation.enable", "--validation.dataset_config", "en"], "validation.dataset_config"),
    (["--data.dataset", "tessera_doc"], "data.dataset: 'tessera_doc' is not a built-in dataset (did you mean"),
]


@pytest.mark.parametrize("argv, field", BAD_INPUTS, ids=[a[0][0] + "=" + a[0][-1] for a in BAD_INPUTS])
def test_bad_input_gives_one_error_line(argv, field, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dump = tmp_path / "run"
    rc, out, err = run_main(["--job.dump_folder", str(dump), *argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert field in lines[0]
    assert not dump.exists()


def test_model_too_large_for_host_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
    """On CPU the 8B flavor's float32 state (16 bytes per parameter, 120 GiB) is refused before it is
    allocated when the machine has less available (here made 20 GiB), not killed later by the kernel."""
    from engine import build

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(build, "host_memory_available", lambda: 20 * 1024**3)
    dump = tmp_path / "run"
    rc, out, err = run_main(["--job.dump_folder", str(dump), "--model.flavor", "8B"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: model.flavor: 8B (8.03B parameters) needs at least 119.7 GiB"), lines[0]
    assert "has 20.0 GiB available" in lines[0]
    assert not dump.exists()
    # The state is split over the ranks of a replica: 4 of 32 FSDP ranks on this machine hold an eighth of it
    # (15 GiB), which fits.
    from parallelize.mesh import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=32, cp=1, tp=1, pp=1, world_size=32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    build.check_host_memory("8B", 8_030_261_248, dims, 32)


def test_a_repeat_of_the_data_is_announced_once_and_counted(tmp_path, capsys):
    # 6 documents of about 60 tokens, 4 x 65 tokens a step: each pass over them takes 1-2 steps.
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"text": f"few documents here, number {i}. " * 12}) + "\n" for i in range(6)))
    rc, out, err = run_main([*SMALL, "--data.path", str(path), "--training.steps", "6",
                             "--job.dump_folder", str(tmp_path / "run")], capsys)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.startswith("data: rank 0 has read")]
    epochs = [r["data_epoch"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]  # steps 1 to 6
    assert len(lines) == 1 and epochs[0] == 0 and epochs == sorted(epochs) and epochs[-1] >= 2, (lines, epochs)
    step = int(re.search(r"from step (\d+) it reads it again \(epoch 1\), so documents repeat", lines[0]).group(1))
    assert epochs.index(1) + 1 == step, (lines, epochs)  # the step whose batch holds the first repeated document


def test_bad_data_contents_give_one_error_line(tmp_path, capsys, jsonl_data):
    dump = tmp_path / "run"
    bad_ext = tmp_path / "data.csv"
    bad_ext.write_text("text\nhello\n")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(10)))
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n' * 10)
    for argv, field in [
        (["--data.path", jsonl_data], "data.text_field"),  # the file's column is 'body'
        (["--data.path", str(bad_ext)], "data.path"),
        # Found by reading the first document at start-up, not at the first step.
        (["--data.path", str(numbers)], "data.text_field: column 'text' holds int values"),
        (["--data.path", str(numbers), "--data.streaming", "false"], "data.text_field: column 'text' holds int"),
        (["--data.path", str(blank)], "data.path: "),
        # The validation data is checked with the training data, before step 1 trains.
        (["--validation.enable", "--validation.path", jsonl_data], "validation.path: 'text' is not a column"),
        (["--validation.enable", "--validation.split", "test"], "validation.split: "),
    ]:
        rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, *argv], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], err
        assert not dump.exists()


def test_run_train_sh_error_is_one_line(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(
        ["./run_train.sh", "--training.setps", "3", "--job.dump_folder", str(dump)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key 'training.setps' (did you mean 'training.steps'?)"
    ]
    assert not dump.exists()


RUN_TRAIN_SH = os.path.join(ROOT, "run_train.sh")


def test_run_train_sh_runs_in_the_callers_directory(tmp_path, jsonl_data):
    """Relative paths (CONFIG_FILE, the config's data.path and job.dump_folder) are the caller's: run_train.sh
    does not change directory, and finds Tessera even where a folder of the caller's is named like its package."""
    work = tmp_path / "work"
    (work / "engine").mkdir(parents=True)  # not Tessera's
    os.rename(jsonl_data, work / "docs.jsonl")
    (work / "my.toml").write_text('[job]\ndump_folder = "out"\n[data]\npath = "docs.jsonl"\ntext_field = "body"\n'
                                  '[training]\nsteps = 2\nseq_len = 64\nlocal_batch_size = 2\n'
                                  '[lr_scheduler]\nwarmup_steps = 1\n')
    env = {**os.environ, "PYTHON": sys.executable, "CONFIG_FILE": "my.toml"}
    env.pop("NGPU", None)
    proc = subprocess.run([RUN_TRAIN_SH], cwd=work, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_jsonl(work / "out" / "metrics.jsonl")) == 2
    assert not os.path.exists(os.path.join(ROOT, "out"))


def test_log_rank_shows_that_ranks_log_lines(tmp_path):
    """LOG_RANK=1 shows rank 1's own lines (its stage's memory under PP, say), not an empty console; its metrics
    are its own (the loss is the global one on every rank)."""
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "2", "LOG_RANK": "1"}
    proc = subprocess.run([RUN_TRAIN_SH, "--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.steps", "2",
                           "--lr_scheduler.warmup_steps", "1", "--parallelism.pp", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert all(line.startswith("[rank1]:") for line in lines if line.strip()), lines
    shown = [line for line in lines if line.startswith("[rank1]:step:")]
    written = read_jsonl(tmp_path / "run" / "metrics.jsonl")  # rank 0's file
    assert len(shown) == len(written) == 2 and f"loss: {written[-1]['loss']:7.4f}" in shown[-1], (shown, written)


def test_the_backend_keeps_gloo_beside_nccl_under_cpu_offload_whatever_tessera_backend_says(monkeypatch):
    """FSDP's CPU offload reduces the gradient norm's squares in CPU memory, which NCCL cannot: TESSERA_BACKEND=nccl
    (the default on CUDA, named) gets gloo beside it all the same; gloo stays gloo."""
    from engine.distributed import backend_for

    for env, offload, backend in ((None, False, "nccl"), (None, True, "cuda:nccl,cpu:gloo"),
                                  ("nccl", False, "nccl"), ("nccl", True, "cuda:nccl,cpu:gloo"),
                                  ("gloo", True, "gloo")):
        if env is None:
            monkeypatch.delenv("TESSERA_BACKEND", raising=False)
        else:
            monkeypatch.setenv("TESSERA_BACKEND", env)
        assert backend_for("cuda", offload) == backend, (env, offload)
    monkeypatch.delenv("TESSERA_BACKEND")
    assert backend_for("cpu", True) == "gloo"


@pytest.mark.parametrize("env, argv, message", [
    ({"DRY_RUN": "true"}, [], "DRY_RUN: expected 0 or 1, got 'true'"),
    ({"CONFIG_FILE": "/no/such.toml"}, [], "CONFIG_FILE: '/no/such.toml' is not a file"),
    ({"NGPU": "2", "LOG_RANK": "abc"}, [], "LOG_RANK: 'abc' is not a comma-separated list of ranks in [0, 2)"),
    ({"NGPU": "2", "LOG_RANK": "0,5"}, [], "LOG_RANK: rank 5 is not in [0, 2)"),
    ({"NGPU": "2", "TESSERA_BACKEND": "foo"}, [], "TESSERA_BACKEND: 'foo' is not one of gloo, nccl"),
    ({"TESSERA_BACKEND": "nccl"}, [], "TESSERA_BACKEND: nccl needs CUDA GPUs"),
    ({"NGPU": "2"}, ["--debug.seed", "4294967296"], "debug.seed: must be in [0, 2**32 - 1]"),  # before any worker
    ({}, ["--config", "a.toml", "--config", "b.toml"], "--config: given twice"),
    ({"NGPU": "+2"}, [], "NGPU: expected the number of processes on this node, a whole number from 1 to 1024"),
    ({"NGPU": "2", "LOG_RANK": "0,,1"}, [], "LOG_RANK: '0,,1' is not a comma-separated list of ranks"),
    ({"LOG_RANK": "7"}, [], "LOG_RANK: rank 7 is not in [0, 1)"),
    ({"PYTHON": "/no/such/python"}, [], "PYTHON: '/no/such/python' is not a program here"),
    # A WORLD_SIZE left in the caller's shell does not make a one-process run a rank of a larger world.
    ({"WORLD_SIZE": "2"}, ["--parallelism.dp_shard", "2"], "parallelism: the degrees multiply to 2"),
    ({"RANK": "1"}, ["--training.steps", "abc"], "training.steps: expected an integer"),  # else rank 1's: silent
    ({"RANK": "1", "NGPU": "2"}, ["--training.steps", "abc"], "training.steps: expected an integer"),
], ids=["DRY_RUN", "CONFIG_FILE", "LOG_RANK=abc", "LOG_RANK=0,5", "TESSERA_BACKEND=foo", "TESSERA_BACKEND=nccl",
        "seed", "config-twice", "NGPU=+2", "LOG_RANK=0,,1", "LOG_RANK=7", "PYTHON", "WORLD_SIZE", "RANK", "RANK-NGPU2"])
def test_run_train_sh_bad_environment_is_one_error_line(env, argv, message, tmp_path):
    import torch

    if env.get("TESSERA_BACKEND") == "nccl" and torch.cuda.is_available():
        pytest.skip("nccl is this machine's backend")
    dump = tmp_path / "run"
    proc = subprocess.run([RUN_TRAIN_SH, *argv, "--job.dump_folder", str(dump)], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable, **env}, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr[-2000:]
    assert not dump.exists()


def test_run_train_sh_refuses_a_python_without_torch(tmp_path):
    # The common first mistake: the virtual environment Tessera was installed in is not active.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = str(tmp_path / "bare" / "bin" / "python")
    for extra in ({}, {"DRY_RUN": "1"}, {"NGPU": "2"}):
        proc = subprocess.run([RUN_TRAIN_SH, "--job.dump_folder", str(tmp_path / "run")], cwd=tmp_path,
                              capture_output=True, text=True, env={**os.environ, "PYTHON": bare, **extra}, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines == [f"error: PYTHON: '{bare}' has no torch installed; activate the "
                                                  "virtual environment Tessera is installed in (. .venv/bin/activate) "
                                                  "or give its interpreter, e.g. PYTHON=.venv/bin/python"], proc.stderr
        assert not (tmp_path / "run").exists()


OPTIONAL_PACKAGES = ("transformers", "wandb", "tensorboard", "torchao", "flash_attn")


def test_a_run_and_its_checkpoints_need_only_the_base_install(tmp_path):
    """`pip install -e .` without extras: training, a checkpoint and its Hugging Face export run in an environment
    without the optional packages (this one's site-packages, less them, linked into a folder of their own)."""
    import sysconfig

    site = tmp_path / "site"
    site.mkdir()
    packages = sysconfig.get_paths()["purelib"]
    for name in os.listdir(packages):
        if not name.lower().replace("-", "_").startswith(OPTIONAL_PACKAGES):
            (site / name).symlink_to(os.path.join(packages, name))
    probe = "import importlib.util as u; print([n for n in %r if u.find_spec(n)])" % (OPTIONAL_PACKAGES,)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    found = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr  # none of them importable there
    proc = subprocess.run([sys.executable, "-S", "-m", "engine.train", *SMALL, "--training.steps", "2",
                           "--checkpoint.enable", "--checkpoint.last_save_hf", "--job.dump_folder",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint" / "step-000002-hf" / "config.json").exists()


def test_run_train_sh_help_is_printed_once():
    proc = subprocess.run([RUN_TRAIN_SH, "--training.steps", "3", "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "NGPU": "2"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("usage: ./run_train.sh") == 1, proc.stderr[-2000:]
    assert "--training.steps" in proc.stdout and "rank" not in proc.stderr


def test_unusable_dump_folder_is_one_error_line(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    toml = tmp_path / "inf.toml"
    toml.write_text('[optimizer]\nlr = inf\n')
    dangling = tmp_path / "link"  # to a folder that does not exist: os.makedirs fails on it (at the first save)
    dangling.symlink_to(tmp_path / "gone")
    for argv, message in [
        (["--job.dump_folder", str(dangling / "run")], f"is a symbolic link to '{tmp_path / 'gone'}', which does not"),
        (["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "--checkpoint.folder", str(dangling)],
         "checkpoint.folder: "),
        (["--job.dump_folder", str(a_file)], "exists and is not a folder"),
        (["--job.dump_folder", str(a_file / "run")], "is a file"),
        (["--job.dump_folder", "/proc/tessera/run"], "cannot write '/proc/tessera/run' (in '/proc')"),
        (["--config", str(toml), "--job.dump_folder", str(tmp_path / "run")], "optimizer.lr: expected a finite"),
        (["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "--checkpoint.folder", str(a_file)],
         "checkpoint.folder: "),
        (["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.load_step", "4"],
         "checkpoint.load_step: loading step 4 needs checkpoint.enable"),
        # The seed checkpoint goes to checkpoint.folder without checkpoint.enable; the profiler's traces to theirs.
        (["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.create_seed_checkpoint", "--checkpoint.folder",
          str(a_file)], "checkpoint.folder: "),
        (["--job.dump_folder", str(tmp_path / "run"), "--profiling.enable_profiling",
          "--profiling.save_traces_folder", str(a_file / "traces")], "profiling.save_traces_folder: "),
    ]:
        rc, out, err = run_main(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and message in lines[0], err
    from engine.config import ConfigError
    from engine.config.validation import HOPPER  # memory snapshots need CUDA: checked for a Hopper machine

    with pytest.raises(ConfigError, match="^profiling.save_memory_snapshot_folder: "):
        train.check(["--job.dump_folder", str(tmp_path / "run"), "--profiling.enable_memory_snapshot",
                     "--profiling.save_memory_snapshot_folder", str(a_file)], HOPPER)
    assert a_file.read_text() == "not a folder" and sorted(os.listdir(tmp_path)) == ["a_file", "inf.toml", "link"]


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_malformed_json_line_is_one_error_line(tmp_path, streaming):
    """The datasets library logs its own line before raising; the user sees Tessera's one line only."""
    data = tmp_path / "broken.jsonl"
    good = "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(100))
    data.write_text(good + "{not json\n" + good)
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", "--data.path", str(data), "--data.streaming", streaming,
         "--job.dump_folder", str(dump)], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: data.path: ") and "JSON parse error" in lines[0], lines
    assert not dump.exists()


def test_mid_run_error_of_a_hidden_rank_is_one_line_and_the_async_save_commits(tmp_path):
    """Rank 1 reads files b and d of a four-file folder (round robin), d malformed: its shard passes the start-up
    check (b's first record) and fails once b's 70 short documents are used up, a few steps in: a DataError on
    rank 1 alone, whose output LOG_RANK=0 hides. Rank 1 announces it before leaving; rank 0, whose collective
    then fails, prints rank 1's line instead of its own traceback (or, when torchrun stops rank 0 first, the
    launcher prints it), and the launcher exits with the status, without torchrun's report: one line either way.
    The previous step's async save is being written then (checkpoint.interval 1): rank 1 finishes writing its
    files without a collective (rank 0 is inside the next step's), rank 0 commits the save, so the last step
    trained is the last checkpoint, committed, as with synchronous saves (a collective commit on rank 1 alone
    waited for rank 0 until the collective timeout)."""
    data = tmp_path / "data"
    data.mkdir()
    for name, count in (("a", 400), ("b", 70), ("c", 400)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i} " * 6}) + "\n"
                                                    for i in range(count)))
    (data / "d.jsonl").write_text("{not json\n")
    dump = tmp_path / "run"
    proc = subprocess.run(["./run_train.sh", *SMALL, "--data.path", str(data), "--job.dump_folder", str(dump),
                           "--training.steps", "30", "--checkpoint.enable", "--checkpoint.interval", "1",
                           "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2",
                           "--comm.train_timeout_seconds", "60"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable, "NGPU": "2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = proc.stderr.strip().splitlines()
    line = f"error: [rank 1] data.path: cannot read '{data}' (4 json files) past record 70 of shard 1 of 2 (epoch 0): "
    assert len(ours) == 1 and ours[0].startswith(line) and "d.jsonl" in ours[0], proc.stderr[-3000:]
    trained = read_jsonl(dump / "metrics.jsonl")[-1]["step"]
    assert 2 <= trained < 30, trained
    folders = sorted(os.listdir(dump / "checkpoint"))
    assert folders[-1] == f"step-{trained:06d}", (folders, trained)
    assert (dump / "checkpoint" / folders[-1] / "COMMITTED.json").is_file(), folders
    assert "did not finish" not in proc.stdout, proc.stdout[-3000:]


def _failure(tmp_path, local_rank: int, record: dict | None, timestamp: int = 100):
    """A torchrun ProcessFailure of ``local_rank``, with engine.train's error-file record when ``record``."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{local_rank}.json"
    if record is not None:
        info = {"timestamp": str(timestamp), "tessera": {"status": record["status"]}}
        path.write_text(json.dumps({"message": {"message": record["line"], "extraInfo": info}}))
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=1, error_file=str(path))


@pytest.mark.parametrize("recorded_by_rank0", [False, True])
def test_launcher_ends_with_the_recorded_user_error(tmp_path, monkeypatch, capsys, recorded_by_rank0):
    """engine/launch.py: a user error recorded in a rank's error file ends the launch with its status and no
    torchrun report; the launcher prints the one line (no rank prints it: torchrun would prefix it), rank 0's
    (which names the failing rank) or else the first one recorded, prefixed with its rank. A failure without a
    record (a crash) keeps torchrun's ChildFailedError."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine import launch

    rank1 = {"line": "data.path: cannot read 'x'", "status": 2}
    rank0 = {"line": "[rank 1] data.path: cannot read 'x'", "status": 2} if recorded_by_rank0 else None
    failures = {0: _failure(tmp_path, 0, rank0, timestamp=101), 1: _failure(tmp_path, 1, rank1)}

    def run(args):
        assert os.environ[launch.LAUNCHER_ENV] == "1"  # the training processes record, they do not print
        raise ChildFailedError("engine.train", failures)

    monkeypatch.setattr(torchrun, "run", run)
    # launch.main sets these in this process: undone after the test (an ignored SIGUSR2 would be inherited by every
    # later test's processes, and a shell cannot trap a signal ignored when it starts: test_slurm's launch_node.sh).
    monkeypatch.setenv(launch.LAUNCHER_ENV, "0")
    monkeypatch.setenv(launch.PARENT_ENV, "")
    monkeypatch.setattr(launch, "ignore_step_signal", lambda: None)
    argv = ["--nproc_per_node=2", "--local-ranks-filter=0", "-m", "engine.train"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: [rank 1] data.path: cannot read 'x'"], err

    failures.update({0: _failure(tmp_path / "none", 0, None), 1: _failure(tmp_path / "none", 1, None)})
    with pytest.raises(ChildFailedError):
        launch.main(argv)


def folder_with_a_bad_file(tmp_path, good_documents: int):
    """A data folder of two jsonl files: a.jsonl with ``good_documents`` documents, b.jsonl malformed."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n"
                                          for i in range(good_documents)))
    (data / "b.jsonl").write_text("{not json\n")
    return data


def test_malformed_record_found_mid_run_is_one_error_line(tmp_path):
    """Streaming data is checked at start-up by its first record only: a malformed file met later (here the
    second file of a folder, after 130 documents: the loader reads 64 records ahead, so about step 30) stops
    the run with one error line naming the file, after the checkpoints so far have committed."""
    data = folder_with_a_bad_file(tmp_path, good_documents=130)
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", "--data.path", str(data), "--job.dump_folder", str(dump), *SMALL,
         "--training.steps", "60", "--checkpoint.enable", "--checkpoint.interval", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: data.path: cannot read '{data}' (2 json files) past record 130"), lines
    assert f"of shard 0 of 1 (epoch 0): Failed to load JSON from file '{data / 'b.jsonl'}'" in lines[0]
    assert lines[0].endswith("fix or remove the bad record, then resume from the last checkpoint")
    steps = sorted(int(name.split("-")[1]) for name in os.listdir(dump / "checkpoint") if name.startswith("step-"))
    assert steps and steps[-1] >= 20, steps
    assert len(read_jsonl(dump / "metrics.jsonl")) >= steps[-1]


def test_divergence_stops_before_it_is_saved(tmp_path, capsys):
    """lr 1e3 makes the debug model's loss nan within a few steps: the run stops at the first log or checkpoint
    step that sees it, with one error line, and every checkpoint it leaves is of a step before."""
    dump = tmp_path / "run"
    argv = ["--job.dump_folder", str(dump), *SMALL, "--optimizer.lr", "1e3", "--training.max_norm", "1e30",
            "--lr_scheduler.warmup_steps", "1", "--training.steps", "30", "--metrics.log_freq", "100",
            "--checkpoint.enable", "--checkpoint.interval", "2"]
    rc, out, err = run_main(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 3 and len(lines) == 1, err
    assert lines[0].startswith("error: optimizer.lr: training diverged by step "), lines[0]
    stopped = int(lines[0].split("by step ")[1].split()[0])
    assert 2 < stopped < 30 and stopped % 2 == 0  # found at a checkpoint step (logs: steps 1 and 30 only)
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").iterdir())
    assert saved == list(range(2, stopped, 2)), saved
    assert [r["step"] for r in read_jsonl(dump / "metrics.jsonl")] == [1]
    # Two FSDP ranks see the same loss and gradient norm: both stop at the same step, none waits for the other.
    dump2 = tmp_path / "fsdp2"
    proc = subprocess.run(["./run_train.sh", *argv, "--job.dump_folder", str(dump2)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable, "NGPU": "2"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: optimizer.lr: training diverged by step "), \
        proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr  # no launcher report
    stopped2 = int(errors[0].split("by step ")[1].split()[0])
    saved2 = sorted(int(p.name.split("-")[1]) for p in (dump2 / "checkpoint").iterdir())
    assert 2 < stopped2 < 30 and saved2 == list(range(2, stopped2, 2)), (stopped2, saved2)


def test_check_finite_stops_on_a_nan_or_inf_gradient_norm_of_the_window():
    from engine.trainer import TrainingDiverged, check_finite

    check_finite(7, 2.5, 1.0, 0.0)  # finite loss, no step of the window with a nan or inf gradient norm
    with pytest.raises(TrainingDiverged, match=r"^optimizer\.lr: training diverged by step 7 \(loss 2\.5, gradient "
                                               r"norm 1, nan or inf at 1 earlier step of its window\)"):
        check_finite(7, 2.5, 1.0, 1.0)  # an earlier step's norm was inf, this step's is finite
    with pytest.raises(TrainingDiverged, match=r"^optimizer\.lr: training diverged by step 7 \(loss 2\.5, gradient "
                                               r"norm inf: nan or inf\)"):
        check_finite(7, 2.5, float("inf"), 1.0)
    with pytest.raises(TrainingDiverged, match=r"by step 7 \(loss nan, gradient norm 1: nan or inf\)"):
        check_finite(7, float("nan"), 1.0, 0.0)


def test_an_inf_gradient_norm_with_a_finite_loss_stops_before_it_is_saved(tmp_path, capsys, monkeypatch):
    """Step 5's gradient norm is inf, its loss (and every other step's) finite: step 5 is neither logged (every 4)
    nor saved (every 3), so the window's count of nan or inf norms stops the run at the save of step 6, with one
    error line and exit status 3; the checkpoints left are of steps before step 5."""
    import torch

    from engine.trainer import Trainer

    train_step = Trainer.train_step

    def inf_at_step_5(self, *args, **kwargs):
        loss, grad_norm = train_step(self, *args, **kwargs)
        return loss, torch.full_like(grad_norm, float("inf")) if self.step == 5 else grad_norm

    monkeypatch.setattr(Trainer, "train_step", inf_at_step_5)
    dump = tmp_path / "run"
    rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "10", "--metrics.log_freq",
                             "4", "--checkpoint.enable", "--checkpoint.interval", "3"], capsys)
    lines = err.strip().splitlines()
    assert rc == 3 and len(lines) == 1, err
    assert lines[0].startswith("error: optimizer.lr: training diverged by step 6 (loss "), lines[0]
    assert "nan or inf at 1 earlier step of its window" in lines[0] and "loss nan" not in lines[0], lines[0]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-000003"]
    assert [r["step"] for r in read_jsonl(dump / "metrics.jsonl")] == [1, 4]


def test_error_of_a_rank_whose_output_is_hidden_is_printed_by_the_launcher(tmp_path):
    """Two data-parallel ranks stream a folder of two files, one each; only rank 1's file is malformed. At
    start-up rank 1's shard fails and rank 0's does not: the ranks agree, both exit with status 2, and rank 0
    (the one the console shows) prints rank 1's line; no traceback, no torchrun report."""
    data = folder_with_a_bad_file(tmp_path, good_documents=40)
    dump = tmp_path / "run"
    proc = subprocess.run(["./run_train.sh", *SMALL, "--data.path", str(data), "--job.dump_folder", str(dump),
                           "--training.steps", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "NGPU": "2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"error: [rank 1] data.path: cannot read '{data}'"), \
        proc.stderr[-3000:]
    assert "JSON parse error" in errors[0] and "ChildFailedError" not in proc.stderr
    assert not dump.exists()  # the ranks agreed before anything was written


def set_up_failure_job(world_size: int, rank: int, failure: str) -> list:
    """Rank 1 fails inside agree_on_user_errors with ``failure`` (a ValueError or an OSError); returns what each
    rank raised (gathered to rank 0), or that it went on."""
    import torch.distributed as dist

    from engine.distributed import agree_on_user_errors

    try:
        with agree_on_user_errors():
            if rank == 1:
                raise (ValueError if failure == "user" else PermissionError)("data.path: cannot read 'x'")
        outcome = "went on"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    return everyone


def test_ranks_agree_on_any_set_up_failure(tmp_path):
    """A set-up failure on one rank stops every rank at the same point, whatever it is: a user error becomes the
    same user error on the others (with its rank), anything else (here an OSError) a RuntimeError naming the rank
    and the exception, instead of the others waiting in their next collective until the timeout."""
    from tests.parallel_harness import run_jobs

    result = run_jobs(2, set_up_failure_job, {"user": ("user",), "other": ("other",)}, str(tmp_path))
    assert result["user"] == ["ValueError: [rank 1] data.path: cannot read 'x'",
                              "ValueError: data.path: cannot read 'x'"]
    assert result["other"] == ["RuntimeError: [rank 1] failed during set-up: PermissionError: data.path: cannot "
                               "read 'x'", "PermissionError: data.path: cannot read 'x'"]


def test_garbage_collection_runs_between_steps(tmp_path, capsys, monkeypatch):
    """training.gc_freq 2: automatic collection is off during the loop; the young generations are collected
    before steps 2, 4 and 6 (after one full collection of what set-up left), and automatic collection is back
    on afterwards."""
    import gc

    real = gc.collect
    calls = []

    def collect(generation=2):
        calls.append((generation, gc.isenabled()))
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    rc, out, err = run_main(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.steps", "6",
                             "--training.gc_freq", "2"], capsys)
    assert rc == 0, err
    assert calls == [(2, False), (1, False), (1, False), (1, False)]
    assert gc.isenabled()


def test_the_loop_sets_the_collector_and_leaves_it_as_it_found_it():
    """gc_freq 0 collects automatically in the loop even where the entry point turned the collector off for
    set-up; gc_freq N turns it off; both leave it as they found it."""
    import gc

    from engine.step_guards import scheduled_gc

    was = gc.isenabled()
    try:
        for outside in (False, True):
            for every, inside in ((0, True), (2, False)):
                (gc.enable if outside else gc.disable)()
                with scheduled_gc(every):
                    assert gc.isenabled() is inside, (outside, every)
                assert gc.isenabled() is outside, (outside, every)
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("release", [True, False])
def test_first_steps_cached_memory_is_released_before_its_log(tmp_path, capsys, monkeypatch, release):
    """training.empty_cache_after_first_step: the allocator's cache is emptied once, after the first step and
    before its log resets the peak statistics, so that the first step's record holds its own peak and the next
    windows' peaks start from what the run keeps reserved; off (the default): never."""
    from engine import metrics, trainer

    events = []
    monkeypatch.setattr(trainer, "release_cached_memory", lambda device: events.append(("release", device.type)))
    monkeypatch.setattr(metrics, "reset_peak_memory", lambda device: events.append(("reset", device.type)))
    flag = ["--training.empty_cache_after_first_step"] if release else []
    rc, out, err = run_main(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.steps", "3", *flag],
                            capsys)
    assert rc == 0, err
    assert events == [("release", "cpu")] * release + [("reset", "cpu")] * 3


def test_release_cached_memory_empties_cudas_cache_and_leaves_cpu_alone(monkeypatch):
    """CUDA: the whole device synchronized, then torch.cuda.empty_cache. CPU: there is no caching allocator to
    empty, torch.cuda is not touched."""
    import torch

    from engine.trainer import release_cached_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", str(device))))
    release_cached_memory(torch.device("cpu"))
    assert calls == []
    release_cached_memory(torch.device("cuda", 0))
    assert calls == [("synchronize", "cuda:0"), "empty_cache"]


def test_help_lists_fields(capsys):
    rc, out, err = run_main(["--help"], capsys)
    assert rc == 0 and "--training.steps" in out and "--checkpoint" not in err


def _losses(dump):
    return [r["loss"] for r in read_jsonl(os.path.join(dump, "metrics.jsonl"))]


def test_short_run_writes_config_metrics_and_plots(tmp_path, capsys, jsonl_data):
    dump = str(tmp_path / "run")
    rc, out, err = run_main(
        ["--job.dump_folder", dump, *SMALL, "--training.steps", "12", "--data.path", jsonl_data,
         "--data.text_field", "body", "--metrics.enable_tensorboard", "--metrics.plots"], capsys)
    assert rc == 0, err
    rows = read_jsonl(os.path.join(dump, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"):
        assert key in rows[0]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert os.path.exists(os.path.join(dump, "config.toml"))
    drawn = os.stat(os.path.join(dump, "loss.png")).st_mtime_ns
    assert os.path.getsize(os.path.join(dump, "throughput.png")) > 0
    assert os.path.isdir(os.path.join(dump, "tb"))
    # A second run in the same folder keeps the first run's metrics (and, with metrics.no-plots, draws nothing).
    rc, out, err = run_main(["--job.dump_folder", dump, *SMALL, "--training.steps", "2", "--data.path",
                             jsonl_data, "--data.text_field", "body"], capsys)
    assert rc == 0, err
    assert os.stat(os.path.join(dump, "loss.png")).st_mtime_ns == drawn
    assert len(read_jsonl(os.path.join(dump, "metrics.1.jsonl"))) == 12
    assert len(read_jsonl(os.path.join(dump, "metrics.jsonl"))) == 2


def test_deterministic_runs_are_identical(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        dump = str(tmp_path / name)
        rc, out, err = run_main(["--job.dump_folder", dump, *SMALL, "--training.steps", "20",
                                 "--debug.deterministic", "--debug.seed", "7"], capsys)
        assert rc == 0, err
        runs.append(_losses(dump))
    assert len(runs[0]) == 20
    assert runs[0] == runs[1]


def test_gradient_accumulation_matches_one_big_batch(tmp_path, capsys):
    """local 2 x accumulation 2 sees the same samples as local 4 in one pass: same losses and gradient norms (a
    gradient scaled by the accumulation count would leave the losses nearly alone: clipping and Adam absorb it)."""
    common = ["--training.seq_len", "64", "--metrics.log_freq", "1", "--training.steps", "4",
              "--debug.deterministic", "--lr_scheduler.warmup_steps", "1"]
    big, acc = str(tmp_path / "big"), str(tmp_path / "acc")
    assert run_main(["--job.dump_folder", big, *common, "--training.local_batch_size", "4"], capsys)[0] == 0
    assert run_main(["--job.dump_folder", acc, *common, "--training.local_batch_size", "2",
                     "--training.global_batch_size", "4"], capsys)[0] == 0
    assert _losses(big) == pytest.approx(_losses(acc), rel=1e-5)
    norms = [[r["grad_norm"] for r in read_jsonl(os.path.join(d, "metrics.jsonl"))] for d in (big, acc)]
    assert len(norms[0]) == 4 and norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_throughput_window_skips_checkpoint_saves_and_a_resumed_first_step_is_logged_alone(
        tmp_path, capsys, monkeypatch):
    """A save is not training time: the next window's elapsed time leaves it out. The trainer's clock is made to
    jump 1000 s inside the step-2 save: the window of step 3 (logged alone) shows the step's own time, never the
    jump, whatever this machine's speed. A resumed run logs its first step on its own (its compile and warm-up),
    as a fresh run logs step 1."""
    import types

    import engine.trainer as trainer_module
    from engine.checkpoint.checkpointer import Checkpointer

    jumped = [0.0]  # seconds the trainer's clock is ahead of the real one
    monkeypatch.setattr(trainer_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jumped[0]))
    save = Checkpointer.save

    def slow_save(self, *args, **kwargs):
        jumped[0] += 1000.0
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", slow_save)
    dump = str(tmp_path / "run")
    argv = ["--job.dump_folder", dump, *SMALL, "--training.seq_len", "32", "--training.local_batch_size", "1",
            "--metrics.log_freq", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
    rc, out, err = run_main([*argv, "--training.steps", "3"], capsys)
    assert rc == 0, err
    assert jumped[0] == 2000.0  # steps 2 and 3 saved
    rows = read_jsonl(os.path.join(dump, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["elapsed_s"] < 1000.0 for r in rows), rows  # step 3's window: the step alone, not the save
    monkeypatch.setattr(Checkpointer, "save", save)
    rc, out, err = run_main([*argv, "--training.steps", "8"], capsys)  # resumes from step 3
    assert rc == 0, err
    assert [r["step"] for r in read_jsonl(os.path.join(dump, "metrics.jsonl"))] == [1, 2, 3, 4, 6, 8]


def test_a_full_disk_outside_a_save_is_one_error_line(tmp_path, capsys, monkeypatch):
    """No space left where the run writes, at set-up (the run folder's owner file), mid-run (a metrics record) and
    in the final Hugging Face export: one error line naming the field and exit status 2, not a traceback. (A save's:
    tests/test_checkpoint.py.)"""
    import errno

    from engine.metrics import MetricsLogger
    from engine.run_owner import RunOwner

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    dump = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(RunOwner, "_write_tmp", full)
        rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "2"], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        f"error: job.dump_folder: no space left on the device of {dump}; free space there, or set job.dump_folder "
        "on another disk"], err
    log = MetricsLogger.log

    def fills_at_step_3(self, step, *args, **kwargs):
        if step == 3:
            full()
        return log(self, step, *args, **kwargs)

    monkeypatch.setattr(MetricsLogger, "log", fills_at_step_3)
    rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "4"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: job.dump_folder: no space left on the device of {dump} while writing ")
    assert lines[0].endswith("(without checkpoint.enable it starts over)"), lines
    assert re.search(r"step: +2 ", out) and not re.search(r"step: +3 ", out), out
    monkeypatch.setattr(MetricsLogger, "log", log)
    from engine.checkpoint.checkpointer import Checkpointer

    monkeypatch.setattr(Checkpointer, "export_hf", full)  # the final Hugging Face folder, once the last save commits
    rc, out, err = run_main(["--job.dump_folder", str(tmp_path / "export"), *SMALL, "--training.steps", "2",
                             "--checkpoint.enable", "--checkpoint.last_save_hf"], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        f"error: checkpoint.last_save_hf: no space left on the device of {tmp_path / 'export' / 'checkpoint'} while "
        "exporting step 2, whose checkpoint is committed; free space there, then run the same command again: it "
        "writes the Hugging Face folder"], err


def test_wandb_without_a_login_is_one_error_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """metrics.enable_wandb in online mode with no API key: wandb.init's refusal is a user error found before the
    dump folder (config, metrics) is written."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network either way
    for sub in ("config", "cache", "data"):
        monkeypatch.setenv(f"WANDB_{sub.upper()}_DIR", str(tmp_path / f"wandb_{sub}"))
    dump = tmp_path / "run"
    rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "2",
                             "--metrics.enable_wandb"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: metrics.enable_wandb: wandb.init failed (") and "wandb login" in lines[0]
    assert not dump.exists()


@pytest.mark.parametrize("log_freq", ["1", "3"])
def test_a_data_error_stops_the_run_after_every_step_before_it_is_logged(tmp_path, capsys, monkeypatch, log_freq):
    """The batches of the step after a logged one are read before the log's host sync (read ahead): a bad
    record in them still stops the run at that step, one error line, after the steps before it are logged
    and checkpointed as without reading ahead."""
    import engine.trainer as trainer_module
    from engine.data.datasets import DataError

    build = trainer_module.build_dataloader

    class FailsAtBatch7:
        def __init__(self, loader):
            self.loader = loader

        def __getattr__(self, name):
            return getattr(self.loader, name)

        def __iter__(self):
            for i, batch in enumerate(self.loader, start=1):
                if i == 7:
                    raise DataError("data.path: a bad record in batch 7")
                yield batch

    monkeypatch.setattr(trainer_module, "build_dataloader", lambda *a, **k: FailsAtBatch7(build(*a, **k)))
    dump = tmp_path / "run"
    rc, out, err = run_main(["--job.dump_folder", str(dump), *SMALL, "--metrics.log_freq", log_freq,
                             "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "5"], capsys)
    assert rc == 2 and err.strip().splitlines() == ["error: data.path: a bad record in batch 7"], err
    logged = [r["step"] for r in read_jsonl(dump / "metrics.jsonl") if "loss" in r]
    assert logged == ([1, 2, 3, 4, 5, 6] if log_freq == "1" else [1, 3, 6])  # step 6 trained, then step 7 failed
    assert sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name.startswith("step-")) == ["step-000005"]
