"""The GPU benchmark scripts, checked on CPU before a device call spends the GPU's time on them.

bench/run.py and the bench/*.sh scripts run on the Hopper machine only (CI has no GPU), so a misspelled flag or
a layout that validation rejects would show up there, one 10-minute device call too late. Here each runs with a
stand-in ``python3`` on PATH: every ``python3 -m engine.train`` (alone, through ./run_train.sh, or under
``torch.distributed.run``) is recorded and then parsed and validated as on a Hopper GPU (engine.train.check
with engine.config.validation.HOPPER and the run's world size). The scripts' own code runs for real, and so
does bench/summarize.py; the reference kit is a stand-in that writes a log, and the wheel installs are left
out (no .whl in the copy).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stands in for python3: records the arguments of every engine.train launch (one NUL-separated file per call,
# numbered in order; "dist" for a torch.distributed.run launch), does nothing for any other call.
SHIM = """#!/usr/bin/env bash
case " $* " in
  *" -m torch.distributed.run "*|*" -m engine.train "*)
    n=$(ls {record} | wc -l)
    printf '%s\\0' "$@" > {record}/$(printf %04d "$n") ;;
esac
exit 0
"""


def _check(argv: list[str]) -> dict:
    """engine.train's own checks of one recorded launch, as on a Hopper GPU with that launch's world size."""
    from engine.config.validation import HOPPER
    from engine.train import check

    world = 1
    if "torch.distributed.run" in argv:
        for i, a in enumerate(argv):
            if a == "--nproc_per_node":
                world = int(argv[i + 1])
            elif a.startswith("--nproc_per_node="):
                world = int(a.split("=", 1)[1])
    argv = argv[argv.index("engine.train") + 1:]
    record = {"argv": argv, "world": world}
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        check(argv, HOPPER)
    except ValueError as e:
        record["error"] = str(e)
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old
    return record


def _copy_repo(dst: str) -> str:
    """The scripts cd to their repository: give them a copy holding only what they read."""
    repo = os.path.join(dst, "repo")
    for name in ("bench", "train_configs"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(repo, name))
    shutil.copy(os.path.join(ROOT, "run_train.sh"), repo)
    return repo


def _run_script(tmp_path, script: str, env_extra: dict) -> list[dict]:
    repo = _copy_repo(str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "launches"
    record.mkdir()
    for name, text in (("python3", SHIM.format(record=record)),
                       ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB, 0'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), RUNS=str(tmp_path / "runs"),
               **env_extra)
    proc = subprocess.run(["bash", os.path.join(repo, "bench", script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # What the device returns: at most 8 files from $OUT, none more than 2 folders down; the runs are packed.
    returned = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(returned) <= 8 and all(len(p.parts) <= 3 for p in returned), returned
    assert any(p.name.endswith(".tar.gz") for p in returned), returned
    rows = [_check(p.read_text().split("\0")[:-1]) for p in sorted(record.iterdir())]
    errors = [f"{' '.join(r['argv'])} (world {r['world']}): {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    return rows


def test_gpu_foundation_configs_are_valid_on_hopper(tmp_path):
    rows = _run_script(tmp_path, "gpu_foundation.sh", {})
    flavors = [r["argv"][r["argv"].index("--model.flavor") + 1] for r in rows]
    assert flavors == ["8B_L8", "8B_L2"], flavors
    assert "--profiling.enable_memory_snapshot" in rows[1]["argv"]


def test_gpu_parallel_configs_are_valid_on_hopper(tmp_path):
    rows = _run_script(tmp_path, "gpu_parallel.sh", {})
    # the one-rank debug run, four two-rank layouts over gloo, then CPU offload
    assert [r["world"] for r in rows] == [1] + [2] * 4 + [1], rows
    two_rank = [" ".join(r["argv"]) for r in rows[1:5]]
    assert any("--parallelism.cp 2" in a for a in two_rank)
    assert any("--training.loss_chunk_tokens" in a and "--parallelism.tp 2" in a for a in two_rank)
    assert all("--comm.init_timeout_seconds 60" in a for a in two_rank)  # a hang ends inside the call
    assert "--parallelism.fsdp_cpu_offload" in rows[5]["argv"]


def _compare_to_one(tmp_path, one: list[float] | None, run: list[float] | None, mode: str = "losses"):
    """gpu_parallel.sh's compare_to_one (its Python, as the script has it) on made-up curves of 8 steps: the
    exit status and the verdict line."""
    with open(os.path.join(ROOT, "bench", "gpu_parallel.sh")) as f:
        script = f.read()
    code = script[script.index("<<'PY' || FAILED+="):].split("\n", 1)[1].split("\nPY\n", 1)[0]
    for name, losses in (("one", one), ("tp2", run)):
        folder = tmp_path / name
        shutil.rmtree(folder, ignore_errors=True)
        if losses is not None:
            folder.mkdir()
            (folder / "metrics.jsonl").write_text("".join(
                json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))
    proc = subprocess.run([sys.executable, "-", str(tmp_path / "one"), str(tmp_path / "tp2"), "8", "1e-3", mode],
                          input=code, capture_output=True, text=True, timeout=60)
    assert not proc.stderr, proc.stderr
    return proc.returncode, proc.stdout.splitlines()[-1].strip()


def test_gpu_parallel_compares_whole_curves_and_says_pass_or_fail(tmp_path):
    """A curve passes only with every step the one-rank run logged and each loss within the threshold: a run that
    died early, logged nothing or drifted fails (no reassuring figure over the steps it has); FSDP 2's curve,
    other data, is not compared, only checked for every step."""
    curve = [10.0 - 0.5 * i for i in range(8)]
    assert _compare_to_one(tmp_path, curve, [x * (1 + 1e-5) for x in curve]) == (
        0, "PASS tp2: max relative difference 1e-05, at most 0.001")
    rc, line = _compare_to_one(tmp_path, curve, curve[:4])
    assert rc == 1 and line == "FAIL tp2: tp2 misses steps [5, 6, 7, 8]", line
    rc, line = _compare_to_one(tmp_path, curve, None)
    assert rc == 1 and line.startswith("FAIL tp2: tp2 misses steps [1, 2, 3, 4, 5, 6, 7, 8]"), line
    rc, line = _compare_to_one(tmp_path, curve[:3], curve[:3])  # the one-rank run died too: not a match
    assert rc == 1 and "one rank misses steps [4, 5, 6, 7, 8]" in line, line
    rc, line = _compare_to_one(tmp_path, curve, curve[:7] + [curve[7] * 1.01])
    assert rc == 1 and line == "FAIL tp2: max relative difference 0.01, above 0.001", line
    rc, line = _compare_to_one(tmp_path, curve, curve[:7] + [float("nan")])
    assert rc == 1 and "not finite" in line, line
    rc, line = _compare_to_one(tmp_path, curve, [x + 1 for x in curve], mode="steps")
    assert rc == 0 and line.startswith("PASS tp2: every step logged; its curve not compared"), line
    rc, line = _compare_to_one(tmp_path, curve, curve[:5], mode="steps")
    assert rc == 1 and line == "FAIL tp2: tp2 misses steps [6, 7, 8]", line


def test_gpu_parallel_runs_every_check_and_then_exits_non_zero_if_one_failed(tmp_path):
    """The two TP 2 curves fail (the stand-in python3 says so): the script still runs the rest (CPU offload,
    cuda_cp_check.py, the tarball), names the failures and exits 1."""
    repo = _copy_repo(str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "launches"
    record.mkdir()
    shim = SHIM.format(record=record).replace("#!/usr/bin/env bash\n", "#!/usr/bin/env bash\n"
                                              '[ "$1" = - ] && [[ $3 == *tp2* ]] && { echo "  FAIL $3"; exit 1; }\n'
                                              '[ "$1" = - ] && echo "  PASS $3"\n')
    for name, text in (("python3", shim), ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RUNS=str(tmp_path / "runs"))
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "gpu_parallel.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("  PASS ") == 3 and proc.stdout.count("  FAIL ") == 2, proc.stdout
    failed = proc.stdout.strip().splitlines()[-1]
    assert failed.startswith("FAILED:") and failed.count("tp2") == 2, failed
    assert len(list(record.iterdir())) == 6  # every launch ran, CPU offload the last
    assert "packed " in proc.stdout and (tmp_path / "out" / "gpu_parallel.tar.gz").exists()


# bench/run.py on CPU: a stand-in python3 on PATH answers every launch (engine.train's through ./run_train.sh
# records its arguments and writes made-up metrics; memory_check.py says what it was asked; anything else does
# nothing), and a stand-in reference kit writes a torchtitan log for each reference run asked for. The runner's
# own code and bench/summarize.py run for real.
TRAINER_STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "engine.train"]:
    record = {record!r}
    with open(os.path.join(record, "%04d" % len(os.listdir(record))), "w") as f:
        f.write("\\0".join(args) + "\\0")
    run = args[args.index("--job.dump_folder") + 1]
    label = os.path.basename(run)
    print("launched:", " ".join(args))
    if label in os.environ.get("STUB_FAIL", "").split(","):
        print("died at start-up")
        sys.exit(1)
    os.makedirs(run, exist_ok=True)
    reserved = json.loads(os.environ.get("STUB_RESERVED", "{{}}"))
    tps = float(os.environ.get("STUB_TPS", "32000"))
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step in (1, 5, 10, 15, 20, 25):
            f.write(json.dumps({{"step": step, "loss": 7.0, "tps": tps, "tps_per_gpu": tps, "tflops": 500.0,
                                "mfu": 50.0, "memory_gib": 40.0,
                                "memory_reserved_gib": reserved.get(label, 41.0)}}) + "\\n")
elif "bench/memory_check.py" in args:
    print("memory_check:", " ".join(args))
sys.exit(0)
"""
ANCHOR_STUB = r"""for spec in "$@"; do
  label=${spec%%|*}
  echo "reference asked: $label"
  for s in 5 10 15 20 25; do
    echo "[titan] step: $s  loss:  7.1  memory: 42.00GiB(55.00%)  tps: 29,500  tflops: 496.00  mfu: 50.00%"
  done > "$ANCHOR_LOGS/anchor_$label.log"
done
"""
MATRIX_CONFIGS = ["bf16_compile_ac_op", "fp8_compile_ac_op", "bf16_autocast", "fp8_autocast", "eager_ac_op",
                  "fsdp1_compile_ac_op", "fsdp1_bf16w_compile_ac_op", "fsdp1_fp8_compile_ac_op",
                  "fsdp1_bf16w_fp8_compile_ac_op", "noac_compile", "qwen3_moe_compile_ac_op",
                  "qwen3_dense_compile_ac_op", "fullac_compile", "bf16_compile_ac_alt", "fp8_compile_ac_alt", "fused_loss", "cudnn_sdpa", "fused_loss_cudnn", "bf16_snapshot",
                  "bf16_noautotune", "fp8_noautotune"]


def _runner(tmp_path, *args, anchor: bool = True, **env_extra) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """bench/run.py ARGS in a copy of the repository (made once per tmp_path) with the stand-ins; its output and
    the arguments of each engine.train launch, in order (a fresh record per call)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        _copy_repo(str(tmp_path))
        if anchor:
            (repo / ".anchor").mkdir()
            (repo / ".anchor" / "run_anchor.sh").write_text(ANCHOR_STUB)
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "nvidia-smi").write_text(
            "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB, 0'\n")
    record = tmp_path / "launches"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir()
    (tmp_path / "bin" / "python3").write_text(TRAINER_STUB.format(python=sys.executable, record=str(record)))
    for name in ("python3", "nvidia-smi"):
        (tmp_path / "bin" / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", **env_extra)
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(repo / "bench" / "run.py"), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), *args], env=env, capture_output=True, text=True,
                          timeout=300)
    launches = [p.read_text().split("\0")[:-1] for p in sorted(record.iterdir())]
    return proc, launches


def _ran(proc) -> list[str]:
    return re.findall(r"^=== Tessera (\w+): ", proc.stdout, re.MULTILINE)


def _asked(proc) -> list[str]:
    return [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("reference asked: ")]


def _table(proc) -> dict[str, str]:
    """The summary table's rows by configuration."""
    rows = {}
    for line in proc.stdout[proc.stdout.index("=== Tessera / reference"):].splitlines()[3:]:
        if line.startswith(("skipped for the time budget", "elapsed")):
            return rows
        rows[line.split()[0]] = line
    return rows


def test_matrix_configurations_are_valid_on_hopper(tmp_path):
    """Every configuration of bench/matrix.toml runs once (none left out of the run order) through ./run_train.sh
    and passes the trainer's checks as on a Hopper GPU, with the reference kit's shapes and protocol; what comes
    back from the device fits its limits."""
    run = _bench_module("run")
    matrix = run.summarize.load_matrix()
    assert list(matrix["config"]) == MATRIX_CONFIGS and run.matrix_errors(matrix) == []
    proc, launches = _runner(tmp_path, "--only", ",".join(MATRIX_CONFIGS), "--no-reference", "--no-follow-ups",
                             "--budget", "100000", anchor=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _ran(proc) == MATRIX_CONFIGS
    rows = [_check(["engine.train"] + argv[2:]) for argv in launches]
    assert len(rows) == len(MATRIX_CONFIGS)
    errors = [f"{' '.join(r['argv'])}: {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    for r in rows:  # the reference's shapes and protocol: 25 steps logged every 5 (one host sync per log)
        argv = " ".join(r["argv"])
        assert ("--model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1 --training.steps 25 "
                "--metrics.log_freq 5") in argv, argv
    assert sum("--float8.enable" in r["argv"] for r in rows) == 6
    assert sum("--training.fsdp_bf16_weights" in r["argv"] for r in rows) == 2
    assert sum("alternate" in r["argv"] for r in rows) == 2
    assert sum("--training.no-bf16_weights" in r["argv"] for r in rows) == 2
    assert sum("--compile.no-autotune" in r["argv"] for r in rows) == 2
    # the reference runs take the same shapes, each with its own overrides
    for ref in matrix["reference"]:
        spec = run.reference_command(matrix, ref)[-1]
        assert spec.startswith(f"{ref}|--model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1 "
                               "--training.steps 25 --metrics.log_freq 5"), spec
    # What the device returns: at most 8 files from $OUT, none more than 2 folders down.
    import datetime

    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    returned = [p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert {str(p) for p in returned} == {"runs.tar.gz", "summary.json", "summary.txt", f"{today}-h100.csv"}


@pytest.mark.parametrize("only, references", [
    ("bf16_compile_ac_op,fp8_compile_ac_op,eager_ac_op", ["bf16_compile", "fp8_compile", "eager"]),
    ("fused_loss,cudnn_sdpa,bf16_compile_ac_alt", ["bf16_compile"]),  # a lever call keeps its reference run
    ("fp8_compile_ac_alt,fsdp1_compile_ac_op,fp8_compile_ac_op", ["fp8_compile", "bf16_compile"]),
    ("fullac_compile", []),
])
def test_run_runs_each_reference_its_configurations_are_compared_with_once(tmp_path, only, references):
    """The reference runs are those of the configurations run, each once, right before the first configuration
    compared with it; --no-reference runs none."""
    proc, _ = _runner(tmp_path, "--only", only, "--budget", "100000")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _asked(proc) == references, proc.stdout[-3000:]
    matrix = _bench_module("summarize").load_matrix()
    events = re.findall(r"^(?:reference asked: (\w+)|=== Tessera (\w+): )", proc.stdout, re.MULTILINE)
    for i, (_, name) in enumerate(events):  # each configuration's reference run came before it
        if name and matrix["config"][name].get("reference"):
            assert (matrix["config"][name]["reference"], "") in events[:i], events
    table = _table(proc)
    assert list(table) == [n for n in _bench_module("run").run_order(matrix) if n in only.split(",")]
    for name, line in table.items():  # compared with the reference's 29,500 tps
        assert ("1.085" in line) == bool(matrix["config"][name].get("reference")), line
    proc, _ = _runner(tmp_path, "--only", only, "--budget", "100000", "--no-reference")
    assert proc.returncode == 0 and _asked(proc) == [] and _ran(proc) == list(table), proc.stdout[-2000:]


def test_run_ends_with_the_command_that_runs_what_its_budget_skipped(tmp_path):
    """A budget too short for a reference run (estimated 130 s) skips it and the configurations compared with it;
    the summary ends with the command that runs the skipped ones, which runs them (with their reference runs)."""
    import shlex

    proc, _ = _runner(tmp_path, "--budget", "120")  # the default selection
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _ran(proc) == ["fullac_compile"], proc.stdout[-3000:]
    assert "=== python3 bench/cuda_cp_check.py" in proc.stdout and _asked(proc) == []
    lines = proc.stdout.splitlines()
    command = lines[lines.index("skipped for the time budget; the next call runs them with:") + 1].strip()
    skipped = ["bf16_compile_ac_op", "fp8_compile_ac_op", "eager_ac_op", "fsdp1_compile_ac_op",
               "fsdp1_bf16w_compile_ac_op", "noac_compile"]
    assert command == f"python3 bench/run.py --only {','.join(skipped)}", command
    table = _table(proc)
    assert all("no result" in table[name] for name in skipped) and "32,000" in table["fullac_compile"], table
    argv = shlex.split(command)
    assert argv[:2] == ["python3", "bench/run.py"]
    proc, _ = _runner(tmp_path, *argv[2:], "--budget", "100000")
    assert _ran(proc) == skipped and _asked(proc) == ["bf16_compile", "fp8_compile", "eager", "noac_compile"]
    assert "skipped for the time budget" not in proc.stdout
    # a check that does not fit is named too, with the flags the call had
    proc, _ = _runner(tmp_path, "--only", "eager_ac_op,cuda_cp_check,hopper_levers", "--budget", "50",
                      "--no-reference")
    assert _ran(proc) == ["eager_ac_op"] and "=== skip hopper_levers (budget)" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    command = lines[lines.index("skipped for the time budget; the next call runs them with:") + 1].strip()
    assert command == "python3 bench/run.py --only hopper_levers --no-reference", command


def test_run_refuses_an_unknown_configuration(tmp_path):
    """A typo in --only, or in the matrix, is one error line naming it, before anything runs."""
    proc, launches = _runner(tmp_path, "--only", "bf16_compile_ac_op,fused_los")
    assert proc.returncode == 2 and not launches and not proc.stdout, proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: --only: unknown configuration 'fused_los'; choose from: bf16_compile_ac_op,"), line
    with open(os.path.join(ROOT, "bench", "matrix.toml")) as f:
        text = f.read()
    bad = tmp_path / "matrix.toml"
    bad.write_text(text.replace('reference = "eager"', 'referenc = "eager"')
                   .replace('reference = "noac_compile"', 'reference = "noac"'))
    proc, launches = _runner(tmp_path, "--matrix", str(bad))
    assert proc.returncode == 2 and not launches and not proc.stdout, proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and "[config.eager_ac_op] has no key referenc" in line, line
    assert "[config.noac_compile] reference 'noac' is no [reference.*]" in line, line


@pytest.mark.parametrize("pair_above, fix_holds", [(None, None), ("bf16", True), ("bf16", False), ("fp8", True)])
def test_run_tries_the_fix_and_records_the_allocators_history_when_a_pair_reserves_more(
        tmp_path, pair_above, fix_holds):
    """When bf16_compile_ac_op's or fp8_compile_ac_op's reserved memory is above its reference run's (42 GiB
    here), the call runs their declared follow-up bf16_noautotune right after both pairs; if its memory holds,
    fp8_noautotune (both pairs with the fix in one call), else bf16_snapshot; each once, in the table beside the
    others. Otherwise none of them runs, and --no-follow-ups never runs them."""
    above = pair_above is not None
    reserved = {f"{pair_above}_compile_ac_op": 43.0} if above else {}
    reserved["bf16_noautotune"] = 41.0 if fix_holds else 43.0
    only = "bf16_compile_ac_op,fp8_compile_ac_op,eager_ac_op"
    proc, launches = _runner(tmp_path, "--only", only, "--budget", "100000", STUB_RESERVED=json.dumps(reserved))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    auto = ["bf16_noautotune", "fp8_noautotune" if fix_holds else "bf16_snapshot"] if above else []
    assert _ran(proc) == ["bf16_compile_ac_op", "fp8_compile_ac_op", *auto, "eager_ac_op"], proc.stdout[-3000:]
    assert list(_table(proc)) == ["bf16_compile_ac_op", "fp8_compile_ac_op", *auto, "eager_ac_op"]
    assert _asked(proc) == ["bf16_compile", "fp8_compile", "eager"]  # fp8_noautotune's reference: already run
    snapshot_log = tmp_path / "runs" / "tessera" / "bf16_snapshot.log"  # the launch's output: its run's log
    assert snapshot_log.exists() == (above and not fix_holds)
    assert not snapshot_log.exists() or "--profiling.enable_memory_snapshot" in snapshot_log.read_text()
    fp8_log = tmp_path / "runs" / "tessera" / "fp8_noautotune.log"
    assert not fix_holds or "--float8.enable --compile.no-autotune" in fp8_log.read_text()
    proc, _ = _runner(tmp_path, "--only", only, "--budget", "100000", "--no-follow-ups",
                      STUB_RESERVED=json.dumps(reserved))
    assert proc.returncode == 0 and _ran(proc) == ["bf16_compile_ac_op", "fp8_compile_ac_op", "eager_ac_op"]


def test_run_never_reports_an_earlier_calls_run_as_this_ones(tmp_path):
    """The run folders outlive a call on a warm machine. Here an earlier call left a folder and metrics for every
    configuration asked for, with 99,999 tps, and a reference log. Now bf16_compile_ac_op is skipped (its
    reference run does not fit the budget), fullac_compile fails before its first log and bf16_snapshot runs:
    the table gives the first two "no result" and the third its own figures, the reference log is gone, and the
    memory check is asked for this call's launches only. Other folders stay (the tarball)."""
    runs = tmp_path / "runs"
    for label in ("bf16_compile_ac_op", "fullac_compile", "bf16_snapshot", "earlier_only"):
        folder = runs / "tessera" / label
        folder.mkdir(parents=True)
        with open(folder / "metrics.jsonl", "w") as f:
            for step in (1, 5, 10, 15, 20, 25):
                f.write(json.dumps({"step": step, "loss": 7.0, "tps": 99_999, "tps_per_gpu": 99_999, "tflops": 500.0,
                                    "mfu": 50.0, "memory_gib": 40.0, "memory_reserved_gib": 42.0}) + "\n")
        (runs / "tessera" / f"{label}.log").write_text("the earlier call's log\n")
    (runs / "reference").mkdir()
    (runs / "reference" / "anchor_bf16_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    proc, _ = _runner(tmp_path, "--only", "bf16_compile_ac_op,fullac_compile,bf16_snapshot", "--budget", "120",
                      STUB_FAIL="fullac_compile", STUB_TPS="12345")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _ran(proc) == ["fullac_compile", "bf16_snapshot"]
    table = _table(proc)
    assert list(table) == ["bf16_compile_ac_op", "fullac_compile", "bf16_snapshot"], table
    assert "99,999" not in proc.stdout[proc.stdout.index("=== Tessera / reference"):], table
    assert "no result" in table["bf16_compile_ac_op"] and "no result" in table["fullac_compile"], table
    assert "12,345" in table["bf16_snapshot"], table
    assert not (runs / "reference" / "anchor_bf16_compile.log").exists()  # its reference run was skipped: none
    assert not (runs / "tessera" / "bf16_compile_ac_op").exists()
    assert not (runs / "tessera" / "bf16_compile_ac_op.log").exists()
    assert "died at start-up" in (runs / "tessera" / "fullac_compile.log").read_text()
    assert (runs / "tessera" / "earlier_only" / "metrics.jsonl").exists()  # not this call's: left for the tarball
    (asked,) = [line for line in proc.stdout.splitlines() if line.startswith("memory_check: ")]
    assert " --labels fullac_compile,bf16_snapshot " in asked, asked
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["config"] for r in rows] == list(table) and rows[2]["tps"] == 12345


def _stub_bin(tmp_path) -> str:
    """python3 and nvidia-smi that do nothing (the scripts' shell logic alone runs)."""
    bin_dir = tmp_path / "stub_bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text("#!/usr/bin/env bash\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def test_memory_check_estimates_every_configuration(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "memory_check.py"), "--estimate-only",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "memory_check.json").read_text())
    assert len(rows) >= 4  # the acceptance needs at least 4 single-GPU configurations
    for r in rows:
        assert 10 < r["estimate_gib"] < 80, r  # each one fits an 80 GB H100, so it can be measured


# One line of torchtitan 0.2.2's metrics logger (components/metrics.py), colours included, then its validation
# line, which must not count as a training step.
ANCHOR_LOG = """\
[titan] 2026-11-22 10:00:00,000 - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss:  7.12345  \x1b[33m\
grad_norm:  1.2345  \x1b[36mmemory: {mem:5.2f}GiB(55.12%)  \x1b[34mtps: {tps:,}  \x1b[36mtflops: 496.12  \
\x1b[35mmfu: 50.16%\x1b[39m
"""
VALIDATE = ("[titan] 2026-11-22 10:00:01,000 - root - INFO - \x1b[33mvalidate step: 20  \x1b[32mloss:  7.0000  "
            "\x1b[36mmemory: 70.00GiB(88.00%)  \x1b[34mtps: 99,999\x1b[39m\n")


def _bench_module(name: str):
    """A module of bench/ (a folder of scripts, not a package)."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _tessera_metrics(folder, steps=(1, 5, 10, 15, 20, 25), tps=32_000, reserved=41.0, first_reserved=None):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 8.0 - step / 10, "grad_norm": 1.0, "lr": 3e-4,
                                "tps": 10_000 if step <= 5 else tps, "tps_per_gpu": 10_000 if step <= 5 else tps,
                                "tflops": 546.0, "mfu": 55.2, "memory_gib": 39.0,
                                "memory_reserved_gib": first_reserved if step == 1 and first_reserved else reserved})
                    + "\n")


def test_summarize_reads_both_trainers(tmp_path):
    summarize = _bench_module("summarize")
    runs = tmp_path / "runs"
    (runs / "reference").mkdir(parents=True)
    log = "".join(ANCHOR_LOG.format(step=s, mem=40.0 + s / 10, tps=t)
                  for s, t in ((1, 600), (5, 10_000), (10, 29_000), (15, 29_400), (20, 29_600)))
    (runs / "reference" / "anchor_bf16_compile.log").write_text(log + VALIDATE)
    ref = summarize.reference_run(str(runs / "reference" / "anchor_bf16_compile.log"), skip=10)
    assert ref["steps"] == "15-20" and ref["last_loss"] == pytest.approx(7.12345)
    assert ref["tps"] == 29_500 and ref["mfu"] == pytest.approx(50.16)
    assert ref["reserved_gib"] == pytest.approx(42.0)  # the validation line's 70 GiB is not a step
    assert ref["run_reserved_gib"] == pytest.approx(42.0)  # its first step reserved less (40.1 GiB)
    # Tessera logged at the reference's steps, 41 GiB reserved after the first step (which reserved 40.5)
    _tessera_metrics(runs / "tessera" / "bf16_compile_ac_op", steps=(1, 5, 10, 15, 20), tps=32_450,
                     first_reserved=40.5)
    out = tmp_path / "summary.json"
    pair = [str(runs), "--steps", "20"]
    assert summarize.main(pair + ["--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    # the defaults: both trainers' medians over the same windows, those after step 10 (the matrix's protocol)
    assert row["config"] == "bf16_compile_ac_op" and row["reference"] == "bf16_compile"
    assert row["steps"] == row["ref_steps"] == "15-20", row
    assert row["tps_ratio"] == pytest.approx(32_450 / 29_500)
    assert row["memory_ratio"] == pytest.approx(41.0 / 42.0)
    assert row["run_memory_ratio"] == pytest.approx(41.0 / 42.0)
    assert row["active_gib"] == 39.0 and row["last_loss"] == pytest.approx(6.0)
    # --skip for both trainers
    assert summarize.main(pair + ["--skip", "5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["steps"] == row["ref_steps"] == "10-20", row
    assert row["tps_ratio"] == pytest.approx(32_450 / 29_400)
    # --memory-above: the exit status says whether a run's memory ratio is above the bound
    assert summarize.main(pair + ["--memory-above", "1.0"]) == 1
    assert summarize.main(pair + ["--memory-above", "0.97"]) == 0
    # a first step that reserved more than the reference ever did: within bounds after warm-up, not over the
    # whole run, and --memory-above says so
    _tessera_metrics(runs / "tessera" / "bf16_compile_ac_op", steps=(1, 5, 10, 15, 20), tps=32_450,
                     first_reserved=43.0)
    assert summarize.main(pair + ["--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["memory_ratio"] == pytest.approx(41.0 / 42.0)
    assert row["run_memory_ratio"] == pytest.approx(43.0 / 42.0)
    assert summarize.main(pair + ["--memory-above", "1.0"]) == 0


def test_summarize_gives_no_ratio_for_a_run_that_stopped_early(tmp_path):
    """A run cut by the time budget (or out of memory) has medians over fewer windows: marked, no ratio; the
    same for a reference run that stopped early."""
    summarize = _bench_module("summarize")
    runs = tmp_path / "runs"
    (runs / "reference").mkdir(parents=True)
    for ref, last in (("bf16_compile", 25), ("fp8_compile", 25), ("eager", 20)):
        (runs / "reference" / f"anchor_{ref}.log").write_text("".join(
            ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25) if s <= last))
    for label, last in (("bf16_compile_ac_op", 25), ("fp8_compile_ac_op", 15), ("eager_ac_op", 25)):
        _tessera_metrics(runs / "tessera" / label, steps=[s for s in (1, 5, 10, 15, 20, 25) if s <= last])
    out = tmp_path / "summary.json"
    assert summarize.main([str(runs), "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["bf16_compile_ac_op", "fp8_compile_ac_op", "eager_ac_op"]  # the matrix's order
    assert rows["bf16_compile_ac_op"]["tps_ratio"] == pytest.approx(32_000 / 29_500)
    assert rows["fp8_compile_ac_op"]["partial"] and rows["fp8_compile_ac_op"].get("tps_ratio") is None
    assert rows["fp8_compile_ac_op"]["note"] == "partial: stopped early"
    assert rows["eager_ac_op"]["ref_partial"] and rows["eager_ac_op"].get("tps_ratio") is None
    assert rows["eager_ac_op"]["note"] == "reference partial: stopped early"


def test_summarize_says_no_result_for_a_run_without_metrics(tmp_path, capsys):
    """A configuration the runner asked for whose run was skipped or failed before its first log is a row
    "no result", not a crash, and not left out; a lone run folder likewise, with exit status 1."""
    summarize = _bench_module("summarize")
    runs = tmp_path / "runs"
    (runs / "reference").mkdir(parents=True)
    (runs / "reference" / "anchor_bf16_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    _tessera_metrics(runs / "tessera" / "bf16_compile_ac_op")
    (runs / "tessera" / "fp8_compile_ac_op").mkdir()  # launched, died before its first log
    out = tmp_path / "summary.json"
    capsys.readouterr()
    assert summarize.main([str(runs), "--only", "bf16_compile_ac_op,fp8_compile_ac_op,eager_ac_op", "--json",
                           str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in table[2:]}
    assert list(rows) == ["bf16_compile_ac_op", "fp8_compile_ac_op", "eager_ac_op"], table
    for label in ("fp8_compile_ac_op", "eager_ac_op"):
        assert rows[label].endswith("no result (no metrics.jsonl: skipped, or stopped before its first log)"), table
    by_label = {r["config"]: r for r in json.loads(out.read_text())}
    assert by_label["bf16_compile_ac_op"]["tps_ratio"] == pytest.approx(32_000 / 29_500)
    assert "no result" in by_label["eager_ac_op"]["note"] and "tps" not in by_label["eager_ac_op"]
    # --memory-above: a run with no result is not above anything
    assert summarize.main([str(runs), "--only", "fp8_compile_ac_op", "--memory-above", "0.5"]) == 1
    # one run folder alone: "no result" and exit status 1, for a missing file and for no step after warm-up
    capsys.readouterr()
    assert summarize.main([str(runs / "tessera" / "eager_ac_op"), "--skip", "10"]) == 1
    assert summarize.main([str(runs / "tessera" / "bf16_compile_ac_op"), "--skip", "25"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "eager_ac_op            no result (no metrics.jsonl: skipped, or stopped before its first log)"
    assert lines[5].endswith("no result (no logged steps after the first 25)"), lines
    assert summarize.main([str(runs / "tessera" / "bf16_compile_ac_op"), "--steps", "25"]) == 0


def test_summarize_writes_a_csv_row_per_run(tmp_path):
    """--csv appends a row per run (the header once): when its last log was written, the machine and torch
    given, the figures and ratios; the committed results are such files, one per measured day, and small."""
    import csv

    summarize = _bench_module("summarize")
    runs = tmp_path / "runs"
    (runs / "reference").mkdir(parents=True)
    (runs / "reference" / "anchor_fp8_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    _tessera_metrics(runs / "tessera" / "fp8_compile_ac_op")
    os.utime(runs / "tessera" / "fp8_compile_ac_op" / "metrics.jsonl", (1_795_773_600, 1_795_773_600))
    (runs / "memory_runs.json").write_text(json.dumps([{"name": "fp8_compile_ac_op", "estimate_gib": 41.75}]))
    path = tmp_path / "day.csv"
    for _ in range(2):
        assert summarize.main([str(runs), "--csv", str(path), "--machine", "NVIDIA H200", "--torch", "2.11.0"]) == 0
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and list(rows[0]) == list(summarize.CSV_COLUMNS)
    row = rows[0]
    assert (row["date"], row["time"], row["machine"], row["torch"]) == ("2026-11-27", "10:00", "NVIDIA H200", "2.11.0")
    assert (row["config"], row["reference"], row["tps"], row["ref_tps"]) == ("fp8_compile_ac_op", "fp8_compile",
                                                                          "32000", "29500")
    assert (row["tps_ratio"], row["memory_ratio"], row["estimate_gib"]) == ("1.085", "0.976", "41.75")
    results = os.path.join(ROOT, "bench", "results")
    names = sorted(os.listdir(results))
    assert names and all(re.fullmatch(r"\d{4}-\d\d-\d\d-h\d00\.csv", n) for n in names), names
    assert sum(os.path.getsize(os.path.join(results, n)) for n in names) < 20_000
    for name in names:
        with open(os.path.join(results, name)) as f:
            committed = list(csv.DictReader(f))
        assert committed and list(committed[0]) == list(summarize.CSV_COLUMNS), name
        assert all(r["date"] == name[:10] and r["config"] for r in committed), name


def test_memory_check_from_runs_sets_each_single_gpu_runs_peak_beside_its_estimate(tmp_path, monkeypatch):
    """Every benchmark run is a memory check: the logged peak beside the estimate for the run's config.toml;
    multi-rank runs and the debug model's are left out."""
    from engine.config import dump, parse_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    L8 = ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--model.flavor", "8B_L8",
          "--training.seq_len", "8192", "--training.local_batch_size", "1"]
    runs = {"fullac": (L8 + ["--activation_checkpoint.mode", "full"], 1, 44.0),
            "two_ranks": (L8, 2, 30.0),
            "debug": (L8[:2], 1, 0.4)}
    for name, (argv, gpus, peak) in runs.items():
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        dump(parse_args(argv), str(folder))
        with open(folder / "metrics.jsonl", "w") as f:
            for step in (1, 5, 10):
                f.write(json.dumps({"step": step, "loss": 7.0, "tps": 1000.0 * gpus, "tps_per_gpu": 1000.0,
                                    "memory_gib": peak - step / 100, "memory_reserved_gib": peak + 1}) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "memory_check.py"), "--from-runs",
                           str(tmp_path / "runs"), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "memory_runs.json").read_text())
    assert row["name"] == "fullac" and row["memory_gib"] == pytest.approx(43.99)
    assert row["ratio"] == pytest.approx(row["estimate_gib"] / 43.99) and row["moment"]
    # --labels: this call's runs only (the folder keeps an earlier call's), one with no result named as such
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "memory_check.py"), "--from-runs",
                           str(tmp_path / "runs"), "--labels", "skipped_now,two_ranks", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "memory_runs.json").read_text())
    assert row["name"] == "skipped_now" and row["error"].startswith("no result"), row
    assert "fullac" not in proc.stdout and "0 of 0 bf16 runs" in proc.stdout, proc.stdout


def test_hopper_levers_rope_clip_and_bf16_compare_like_with_like(monkeypatch):
    """The rope, clip and bf16 microbenchmarks (run on the H100) on CPU, small: each pair of variants computes
    the same thing, so the GPU call times two ways of doing one job. The bf16 table's last two rows differ only
    in the update's launch configurations, which a CPU build ignores: what is checked there is that each row's
    step ran the update compiled as it says (Tessera's without pointwise autotuning, the other with Inductor's
    defaults)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import hopper_levers

    torch._dynamo.reset()
    outs = hopper_levers.lever_rope(1, device="cpu", seq=64)
    assert len(outs) == 4
    reference = outs["complex product, eager (Tessera eager)"]
    for name, (q, k) in outs.items():
        torch.testing.assert_close(q.float(), reference[0].float(), rtol=0, atol=2e-2, msg=name)  # bf16 rounding
        torch.testing.assert_close(k.float(), reference[1].float(), rtol=0, atol=2e-2, msg=name)
    params = hopper_levers.lever_clip(1, device="cpu", flavor="debugmodel_L2")
    explicit, folded = params.values()
    assert max((a - b).abs().max().item() for a, b in zip(explicit, folded)) < 1e-6
    assert max(a.abs().max().item() for a in folded) > 0  # the step moved the parameters
    from engine.optim import _adam_update

    compiled, compile_ = [], torch.compile

    def recording_compile(fn, **kwargs):  # each compiled function, its options and its calls
        entry = {"fn": fn, "options": kwargs.get("options"), "calls": 0}
        compiled.append(entry)
        inner = compile_(fn, **kwargs)

        def counted(*args, **kw):
            entry["calls"] += 1
            return inner(*args, **kw)
        return counted

    monkeypatch.setattr(torch, "compile", recording_compile)
    fp32, split, _ = hopper_levers.lever_bf16(1, device="cpu", flavor="debugmodel_L2", tokens=16).values()
    monkeypatch.setattr(torch, "compile", compile_)
    # The same update; the split one from the bf16 rounding of the gradients (the clip's norm moves with it).
    assert max((a - b).abs().max().item() for a, b in zip(fp32, split)) < 1e-6
    assert max(a.abs().max().item() for a in split) > 0
    # Tessera's row: the optimizer's own compiled update, one launch configuration per kernel, ran its step; the
    # autotuned row: its optimizer's own update (the same) never ran, replaced by one with Inductor's default
    # options, which did. Nothing else was compiled.
    no_autotune = {"triton.autotune_pointwise": False}
    updates = [(e["options"], e["calls"] > 0) for e in compiled if e["fn"] is _adam_update]
    assert updates == [(no_autotune, True), (no_autotune, False), (None, True)], compiled
    assert len(updates) == len(compiled), compiled


def test_snapshot_summary_names_the_code_behind_the_reserved_growth(tmp_path):
    """bench/snapshot_summary.py on a made-up allocator snapshot: the state's totals, and each growth of the
    reserved memory charged to the allocation that followed it, named by its frames outside torch (Inductor's
    kept)."""
    import pickle

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import snapshot_summary

    gib = 1024 ** 3
    autotune = [{"filename": "/usr/lib/python3/site-packages/torch/_inductor/runtime/triton_heuristics.py",
                 "line": 1430, "name": "maybe_clone_args"},
                {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1, "name": "call"},
                {"filename": "/work/engine/optim.py", "line": 144, "name": "step"}]
    forward = [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 2, "name": "linear"},
               {"filename": "/work/models/llama3/model.py", "line": 250, "name": "forward"}]
    snapshot = {
        "segments": [{"total_size": 6 * gib, "allocated_size": 4 * gib,
                      "blocks": [{"size": 4 * gib, "state": "active_allocated"},
                                 {"size": 1.5 * gib, "state": "inactive"}, {"size": 0.5 * gib, "state": "inactive"}]}],
        "device_traces": [[
            {"action": "segment_map", "size": 4 * gib, "time_us": 0},
            {"action": "alloc", "size": 4 * gib, "frames": forward},
            {"action": "segment_map", "size": 1 * gib},
            {"action": "segment_map", "size": 1 * gib},
            {"action": "alloc", "size": 2 * gib, "frames": autotune},
            {"action": "alloc", "size": 1 * gib, "frames": forward},  # no growth before it: not counted
            {"action": "segment_unmap", "size": 1 * gib, "time_us": 2_500_000},
        ]],
    }
    path = tmp_path / "rank0_memory_snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    lines = snapshot_summary.summarize(pickle.loads(path.read_bytes()), top=5)
    assert lines[0].startswith("at the snapshot: reserved 6.00 GiB, in live blocks 4.00 GiB, free inside reserved "
                               "segments 2.00 GiB in 2 blocks; the largest: 1.50, 0.50 GiB"), lines[0]
    assert "grew 6.00 GiB and shrank 1.00 GiB in 7 recorded events over 2.5 s" in lines[1], lines[1]
    assert lines[2].split()[:5] == ["4.00", "GiB", "in", "1", "events"], lines[2]
    assert lines[2].endswith("llama3/model.py:250 forward"), lines[2]
    assert lines[3].split()[:5] == ["2.00", "GiB", "in", "2", "events"], lines[3]
    assert lines[3].endswith("runtime/triton_heuristics.py:1430 maybe_clone_args <- engine/optim.py:144 step"), lines[3]
    assert len(lines) == 4
    assert snapshot_summary.main([str(path)]) == 0


def test_dry_run_time_times_each_command_and_names_a_failed_one(capsys):
    """bench/dry_run_time.py: one line per run (a refused layout says FAILED with its error line), exit 1 when one
    failed; a malformed --run is an error before anything runs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import dry_run_time
    finally:
        sys.path.pop(0)
    assert dry_run_time.main(["--run", "x:train_configs/debug_model.toml"]) == 2
    assert "error: --run: 'x:train_configs/debug_model.toml' is not NGPU:CONFIG" in capsys.readouterr().err
    rc = dry_run_time.main(["--run", "2:train_configs/debug_model.toml:--parallelism.tp 2",
                            "--run", "4:train_configs/debug_model.toml:--parallelism.tp 3"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert re.fullmatch(r"\s+2\s+\d+\.\d  DRY_RUN=1 NGPU=2 \./run_train\.sh --config train_configs/debug_model\.toml "
                        r"--parallelism\.tp 2", out[1]), out
    assert "FAILED (exit 2): error: parallelism.dp_shard:" in out[2], out


def test_prepare_device_fills_what_the_calls_carry(tmp_path):
    """bench/prepare_device.sh puts the reference kit in .anchor/ (the kit's own prepare.sh) and downloads into .whl/
    the packages bench/common.sh imports before any run, for the GPU machine's Python; without the kit it stops at
    once with one error line. A stand-in python3 records the download instead of reaching PyPI."""
    repo = _copy_repo(str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > " + str(tmp_path / "pip_args") + "\n"
        "while [ $# -gt 0 ]; do [ \"$1\" = -d ] && mkdir -p \"$2\" && touch \"$2/x.whl\"; shift; done\n")
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", ANCHOR_KIT=str(tmp_path / "kit"))
    script = os.path.join(repo, "bench", "prepare_device.sh")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: no reference kit at"), proc.stderr
    assert not os.path.exists(os.path.join(repo, ".anchor")) and not (tmp_path / "pip_args").exists()

    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "prepare.sh").write_text("mkdir -p .anchor/whl && touch .anchor/run_anchor.sh\n")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(os.path.join(repo, ".anchor", "run_anchor.sh"))
    assert os.path.exists(os.path.join(repo, ".whl", "x.whl"))
    args = (tmp_path / "pip_args").read_text().split()
    assert args[:3] == ["-m", "pip", "download"] and args[args.index("--python-version") + 1] == "3.12"
    with open(os.path.join(ROOT, "bench", "common.sh")) as f:
        imported = re.search(r'python3 -c "import ([\w, ]+)"', f.read()).group(1).split(", ")
    downloaded = {a.split("==")[0].replace("-", "_") for a in args if "==" in a}
    assert set(imported) <= downloaded, (imported, downloaded)
    assert set(_bench_module("run").NEEDED) <= downloaded, downloaded  # bench/run.py's check of the same


def _gpu_check():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_runs_are_valid_on_hopper(tmp_path):
    """Every run of bench/gpu_check.py passes engine.train's checks as on a Hopper GPU, at its world size."""
    gpu_check = _gpu_check()
    plan = gpu_check.runs()
    assert {"fsdp_compile_8b_l2", "gloo_hsdp2x2", "ckpt_async_with_pinned_mem_resumed",
            "config_llama3_405b"} <= {r.label for r in plan}
    rows = [_check_world(run, tmp_path) for run in plan]
    errors = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)


def _check_world(run, tmp_path) -> dict:
    from engine.config.validation import HOPPER
    from engine.train import check

    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(run.ngpu)
    try:
        check([*run.args, "--job.dump_folder", str(tmp_path / run.label)], HOPPER)
        return {"label": run.label}
    except ValueError as e:
        return {"label": run.label, "error": str(e)}
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def test_gpu_check_verdicts_can_fail(tmp_path):
    """A curve off by more than its tolerance, a step missing, a nan, a run that died and a resume that differs
    in the last bit each FAIL; the same curve PASSes."""
    gpu_check = _gpu_check()
    Run, Result = gpu_check.Run, gpu_check.Result

    def write(label, losses, norms=None):
        (tmp_path / label).mkdir()
        with open(tmp_path / label / "metrics.jsonl", "w") as f:
            for step, loss in enumerate(losses, 1):
                f.write(json.dumps({"step": step, "loss": loss, "grad_norm": (norms or losses)[step - 1]}) + "\n")

    curve = [8.0, 7.5, 7.0, 6.5, 6.0, 5.5]
    args = ["--training.steps", "6"]
    write("ref", curve)
    write("same", [x * 1.001 for x in curve])
    write("off", [x * 1.05 for x in curve])
    write("short", curve[:5])
    write("nan", curve[:5] + [float("nan")])
    write("ckpt_whole", curve)
    write("ckpt_async_killed", curve[:3])
    write("ckpt_async_resumed", curve[:5] + [5.5 + 1e-12])
    write("ckpt_disabled_killed", curve[:3])
    write("ckpt_disabled_resumed", curve)
    labels = ["ref", "same", "off", "short", "nan", "ckpt_whole", "ckpt_async_killed", "ckpt_async_resumed", "died",
              "ckpt_disabled_killed", "ckpt_disabled_resumed"]
    plan = [Run(label, args) for label in labels]
    resumed = "checkpoint: resumed from step 3 (...) in 0.10s; its 5 files matched their checksums (checked in 0.01s)"
    results = {label: Result(0, 1.0, resumed) for label in labels}
    results["ckpt_async_killed"] = results["ckpt_disabled_killed"] = Result(-9, 1.0, "")
    results["died"] = Result(1, 1.0, "Traceback\nRuntimeError: CUDA error: an illegal memory access")
    c = gpu_check.Checker(plan, results, tmp_path)
    assert c.close("same", "ref", 1e-2).ok and c.falls("ref").ok and c.exact_resume("disabled").ok
    results["ckpt_disabled_resumed"] = Result(0, 1.0, resumed.split(";")[0])  # the same losses, nothing checked
    assert "not checked against their checksums" in c.exact_resume("disabled").detail
    for verdict in (c.close("off", "ref", 1e-2), c.close("short", "ref", 1e-2), c.close("nan", "ref", 1e-2),
                    c.close("died", "ref", 1e-2), c.exact_resume("async"), c.falls("same", by=0.5)):
        assert not verdict.ok, verdict.detail
    assert "illegal memory access" in c.close("died", "ref", 1e-2).detail
    # A first step off by 1e-3 passes a curve's tolerance but not the same initial weights'.
    assert c.close("same", "ref", 1e-2, first_rtol=2e-3).ok and not c.close("same", "ref", 1e-2, first_rtol=1e-4).ok


def test_gpu_check_fails_a_run_whose_log_does_not_show_its_path(tmp_path):
    """A run that trained but whose start-up lines do not show what its arguments asked for (FSDP2 units and
    their resharding, float8 and its all-gather, checkpointed blocks, the fused loss, the optimizer's kernel, the
    layout) FAILs; a real run's log, from the trainer on the CPU, shows all of it and PASSes."""
    gpu_check = _gpu_check()
    asked = ["--training.steps", "1", "--training.seq_len", "128", "--parallelism.fsdp_single_rank",
             "--parallelism.fsdp_reshard_after_forward", "never", "--activation_checkpoint.mode", "selective",
             "--float8.enable", "--float8.emulate", "--float8.fsdp_float8_all_gather",
             "--training.loss_chunk_tokens", "256", "--optimizer.implementation", "for-loop",
             "--job.dump_folder", str(tmp_path / "asked")]
    proc = subprocess.run([os.path.join(ROOT, "run_train.sh"), *asked], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    plan = [gpu_check.Run("asked", asked)]
    c = gpu_check.Checker(plan, {"asked": gpu_check.Result(0, 1.0, proc.stdout)}, tmp_path, device="cpu")
    said = c.says("asked")
    assert said == ["FSDP2 on", "(none resharded after forward)", "blocks checkpointed per op",
                    "float8 tensorwise (emulated): ", "weights all-gathered in float8",
                    "output loss fused in 256-token chunks", "AdamW for-loop"], said
    assert c.finished("asked") is None
    for line in said:
        c.results["asked"] = gpu_check.Result(0, 1.0, proc.stdout.replace(line, "?"))
        verdict = c.finished("asked")
        assert verdict is not None and line in verdict.detail, line
    # The layout of processes sharing the GPU, and the default kernel on CUDA.
    plan = [gpu_check.Run("tp", ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], ngpu=2)]
    cuda = gpu_check.Checker(plan, {}, tmp_path)
    assert cuda.says("tp") == ["tp 2"]
    plan = [gpu_check.Run("fsdp", ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"], ngpu=2)]
    assert gpu_check.Checker(plan, {}, tmp_path).says("fsdp") == ["dp_shard 2", "(ep 2)", "FSDP2 on", "AdamW fused"]


def test_gpu_check_compares_an_exported_folder_with_transformers(tmp_path):
    """The HF-export path's verdict, run on the CPU: a folder exported from a trained debug model PASSes with
    logits within 1e-5 of transformers'; the same folder with one weight changed FAILs."""
    import dataclasses

    import torch

    from engine.hf import export_hf
    from models.registry import get_model_spec

    gpu_check = _gpu_check()
    args = dataclasses.replace(get_model_spec("llama3").flavors["debugmodel"], vocab_size=4096)
    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    folder = tmp_path / "hf_export" / "checkpoint" / "step-000003-hf"
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, args, str(folder), dtype=torch.float32)
    with open(tmp_path / "hf_export" / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 8.0 - step, "grad_norm": 1.0}) + "\n")
    plan = [gpu_check.Run("hf_export", ["--training.steps", "3"])]
    checker = gpu_check.Checker(plan, {"hf_export": gpu_check.Result(0, 1.0, "")}, tmp_path, device="cpu")
    verdict = checker.hf_logits()
    assert verdict.ok and float(verdict.detail.split("= ")[1].split()[0]) < 1e-5, verdict.detail
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 10000.0
    (folder / "config.json").write_text(json.dumps(config))
    verdict = checker.hf_logits()
    assert not verdict.ok, verdict.detail


def test_gpu_check_starts_runs_only_while_their_memory_fits(tmp_path, monkeypatch):
    """Runs start at most ``jobs`` at a time and only while the memory they declare fits the GPU (a run alone may
    declare more); a run that follows another starts after it."""
    import threading

    gpu_check = _gpu_check()
    Run, Result = gpu_check.Run, gpu_check.Result
    lock, running, peaks = threading.Lock(), {}, []

    def launch(run, runs_dir, deadline):
        with lock:
            running[run.label] = run.gib
            peaks.append((sorted(running), sum(running.values())))
        time.sleep(0.05)
        with lock:
            del running[run.label]
        return Result(0, 0.05, "")

    monkeypatch.setattr(gpu_check, "launch", launch)
    plan = [Run("big1", [], gib=36), Run("big2", [], gib=36), Run("huge", [], gib=90), Run("a", []),
            Run("b", []), Run("c", [], after="a"), Run("d", [])]
    results = gpu_check.run_all(plan, tmp_path, 3, time.time() + 60, memory_gib=70.0)
    assert set(results) == {r.label for r in plan}
    assert all(len(labels) <= 3 for labels, _ in peaks)
    assert all(total <= 70 or labels == ["huge"] for labels, total in peaks), peaks
    assert not any({"big1", "big2"} <= set(labels) for labels, _ in peaks), peaks


def test_gpu_check_finds_every_process_a_launcher_started(tmp_path):
    """The killed-launcher path's view of the workers: every process under the launcher, a session leader of its
    own included, and none alive once killed (a zombie not yet reaped counts as dead): engine.lifetime's helpers,
    which it calls."""
    from engine.lifetime import descendants, running

    script = ("import subprocess, sys, time; subprocess.Popen(['sleep', '60'], start_new_session=True); "
              "subprocess.Popen(['sleep', '60']); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.time() + 10
        while len(descendants(proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        found = descendants(proc.pid)
        assert len(found) == 2 and all(running(p) for p in found), found
        for pid in found:
            os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while any(running(p) for p in found) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(running(p) for p in found)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_fa4_carry_puts_the_two_parts_back_together_and_imports_from_them(tmp_path):
    """bench/fa4_carry.sh on the device: part 1's half of the big wheel waits in FA4_PARTS; part 2 joins it, unzips
    every wheel into one folder (two share nvidia_cutlass_dsl/) and imports flash_attn.cute from there. Stand-in
    wheels here; without part 1, or without a part number, one error line."""
    import zipfile

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "bench", "fa4_carry.sh"), repo / "bench")
    big = tmp_path / "nvidia_cutlass_dsl_libs_cu13-1-py3-none-any.whl"
    with zipfile.ZipFile(big, "w") as z:
        z.writestr("nvidia_cutlass_dsl/cu13/lib/libx.so", os.urandom(3000))
        z.writestr("nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py", "")
    data = big.read_bytes()
    for part, chunk in (("1", data[:2000]), ("2", data[2000:])):
        (repo / ".fa4" / part).mkdir(parents=True)
        (repo / ".fa4" / part / f"{big.name}.part0{int(part) - 1}").write_bytes(chunk)
    with zipfile.ZipFile(repo / ".fa4" / "2" / "flash_attn_4-1-py3-none-any.whl", "w") as z:
        z.writestr("flash_attn/cute/__init__.py", "import cutlass\n")
    env = dict(os.environ, FA4_PARTS=str(tmp_path / "parts"), FA4_SITE=str(tmp_path / "site"))
    script = str(repo / "bench" / "fa4_carry.sh")

    def carry(*args):
        return subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=60)

    for args, message in (((), "error: give the part"), (("2",), "error: part 1 is missing")):
        proc = carry(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    shutil.rmtree(tmp_path / "parts")
    assert carry("1").returncode == 0
    proc = carry("2")
    assert proc.returncode == 0, proc.stderr
    assert "FlashAttention 4 imports from" in proc.stdout
    assert (tmp_path / "site" / "nvidia_cutlass_dsl" / "cu13" / "lib" / "libx.so").read_bytes() == \
        zipfile.ZipFile(big).read("nvidia_cutlass_dsl/cu13/lib/libx.so")
