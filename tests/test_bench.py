"""The GPU benchmark scripts, checked on CPU before a device call spends the H100's time on them.

The bench/*.sh scripts run on the H100 machine only (CI has no GPU), so a misspelled flag or a layout that
validation rejects would show up there, one 10-minute device call too late. Here each script runs with a
stand-in ``python3`` on PATH: every ``python3 -m engine.train`` (alone or under ``torch.distributed.run``)
is parsed and validated as on a Hopper GPU (engine.train.check with engine.config.HOPPER and the run's world
size) and recorded; every other python3 call does nothing. The scripts' own shell code runs for real.
The reference trainer is left out (ANCHOR=""), and so are the wheel installs (no .whl in the copy).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

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
    # the single-GPU 8B_L8 run with FSDP on one rank, the one-rank debug run, four two-rank layouts over gloo,
    # then CPU offload
    assert [r["world"] for r in rows] == [1] * 2 + [2] * 4 + [1], rows
    assert "--parallelism.fsdp_single_rank" in rows[0]["argv"] and "8B_L8" in rows[0]["argv"]
    two_rank = [" ".join(r["argv"]) for r in rows[2:6]]
    assert any("--parallelism.cp 2" in a for a in two_rank)
    assert any("--training.loss_chunk_tokens" in a and "--parallelism.tp 2" in a for a in two_rank)
    assert all("--comm.init_timeout_seconds 60" in a for a in two_rank)  # a hang ends inside the call
    assert "--parallelism.fsdp_cpu_offload" in rows[6]["argv"]


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
    cuda_cp_check.py, the memory table, the tarball), names the failures and exits 1."""
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
    assert len(list(record.iterdir())) == 7  # every launch ran, CPU offload the last
    assert "packed " in proc.stdout and (tmp_path / "out" / "gpu_parallel.tar.gz").exists()


def test_perf_vs_reference_configs_are_valid_on_hopper(tmp_path):
    """Every configuration the script defines runs (none left out of its run order) and passes the trainer's
    checks as on a Hopper GPU."""
    with open(os.path.join(ROOT, "bench", "perf_vs_reference.sh")) as f:
        script = f.read()
    table = script[script.index("declare -A TESSERA=("):script.index("declare -A REFERENCE=(")]
    only = " ".join(re.findall(r"^  \[(\w+)\]=", table, flags=re.M))
    assert len(only.split()) == 16 and "bf16_autocast" in only and "bf16_snapshot" in only
    rows = _run_script(tmp_path, "perf_vs_reference.sh", {"ONLY": only, "ANCHOR": "", "BUDGET": "100000"})
    assert len(rows) == len(only.split()), rows
    assert sum("--training.no-bf16_weights" in r["argv"] for r in rows) == 2
    for r in rows:  # the reference kit's shapes, every one
        argv = " ".join(r["argv"])
        assert "--model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1" in argv, argv
    assert sum("--float8.enable" in r["argv"] for r in rows) == 4
    assert sum("alternate" in r["argv"] for r in rows) == 2
    for r in rows:  # the reference's protocol: 25 steps logged every 5 (one host sync per log, not per step)
        argv = " ".join(r["argv"])
        assert "--training.steps 25 --metrics.log_freq 5" in argv, argv


@pytest.mark.parametrize("only, anchor", [
    ("bf16_compile_ac_op fp8_compile_ac_op eager_ac_op", "bf16_compile fp8_compile"),
    ("fused_loss cudnn_sdpa bf16_compile_ac_alt", "bf16_compile"),  # a second call's levers keep their reference
    ("fp8_compile_ac_alt", "fp8_compile"),
])
def test_perf_vs_reference_runs_the_reference_its_runs_are_compared_with(tmp_path, only, anchor):
    """Without ANCHOR, the reference runs are those ONLY's runs are compared with (bf16 and float8 compiled:
    the eager and no-AC reference figures are the kit README's)."""
    repo = _copy_repo(str(tmp_path))
    os.makedirs(os.path.join(repo, ".anchor"))
    # A stand-in reference kit that only says which runs it was asked for.
    with open(os.path.join(repo, ".anchor", "run_anchor.sh"), "w") as f:
        f.write('for spec in "$@"; do echo "reference asked: ${spec%%|*}"; done\n')
    env = dict(os.environ, PATH=f"{_stub_bin(tmp_path)}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RUNS=str(tmp_path / "runs"), ONLY=only, BUDGET="100000")
    env.pop("ANCHOR", None)
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    asked = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("reference asked: ")]
    assert asked == anchor.split(), proc.stdout[-2000:]


def test_perf_vs_reference_ends_with_the_command_that_runs_what_its_budget_skipped(tmp_path):
    """The session's one call runs the acceptance pairs first; a budget too short for a reference run (estimated
    130 s) skips it and the Tessera run compared with it. The summary ends with the environment that runs the
    skipped ones, which the script takes as it is (the next session lent a GPU starts there)."""
    import shlex

    repo = _copy_repo(str(tmp_path))
    os.makedirs(os.path.join(repo, ".anchor"))
    with open(os.path.join(repo, ".anchor", "run_anchor.sh"), "w") as f:
        f.write('for spec in "$@"; do echo "reference asked: ${spec%%|*}"; done\n')
    env = dict(os.environ, PATH=f"{_stub_bin(tmp_path)}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RUNS=str(tmp_path / "runs"), BUDGET="120")
    for name in ("ONLY", "ANCHOR", "CP_CHECK"):
        env.pop(name, None)
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = re.findall(r"^=== Tessera (\w+): ", proc.stdout, re.MULTILINE)
    assert ran == ["eager_ac_op", "fsdp1_compile_ac_op", "noac_compile", "fullac_compile"], proc.stdout[-3000:]
    assert "=== bench/cuda_cp_check.py" in proc.stdout and "reference asked" not in proc.stdout
    lines = proc.stdout.splitlines()
    command = lines[lines.index("skipped for the time budget; the next call runs them with:") + 1].strip()
    assert command == ('ONLY="bf16_compile_ac_op fp8_compile_ac_op" ANCHOR="bf16_compile fp8_compile" CP_CHECK=0 '
                       'ANCHOR_LOGS=$OUT bash bench/perf_vs_reference.sh'), command
    again = dict(word.split("=", 1) for word in shlex.split(command) if "=" in word and "$" not in word)
    rows = _run_script(tmp_path / "again", "perf_vs_reference.sh", {**again, "BUDGET": "100000"})
    assert ["--float8.enable" in r["argv"] for r in rows] == [False, True], rows
    # A reference run skipped beside no Tessera run of ONLY is named too (with a Tessera run it pairs with).
    env.update(ONLY="fullac_compile", ANCHOR="bf16_compile", BUDGET="120")
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    command = lines[lines.index("skipped for the time budget; the next call runs them with:") + 1].strip()
    assert command.startswith('ONLY="bf16_compile_ac_op" ANCHOR="bf16_compile" CP_CHECK=0 '), command


def test_perf_vs_reference_refuses_an_unknown_configuration(tmp_path):
    repo = _copy_repo(str(tmp_path))
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")],
                          env=dict(os.environ, ONLY="bf16_compile_ac_op fused_los", OUT=str(tmp_path / "out"),
                                   RUNS=str(tmp_path / "runs"), PATH=f"{_stub_bin(tmp_path)}:{os.environ['PATH']}"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "ONLY: unknown configuration 'fused_los'" in proc.stdout, proc.stdout


@pytest.mark.parametrize("pair_above, fix_holds", [(None, None), ("bf16", True), ("bf16", False), ("fp8", True)])
def test_perf_vs_reference_tries_the_fix_and_records_the_allocators_history_when_a_pair_reserves_more(
        tmp_path, pair_above, fix_holds):
    """When bf16_compile_ac_op's or fp8_compile_ac_op's reserved memory is above its reference run's
    (compare_reference.py --memory-above), the same call runs bf16_noautotune right after the two pairs; if that
    one's memory holds, fp8_noautotune (both pairs with the fix in one call), else bf16_snapshot; the table
    compares the runs without autotuning with the reference too. Otherwise none of them runs. The stand-in
    python3 writes each launch's metrics file, answers --memory-above as told for each run and prints the table's
    labels."""
    above = pair_above is not None
    repo = _copy_repo(str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" --memory-above "*)
    case " $* " in *" --labels bf16_noautotune "*) echo "asked: fix" >&2; exit {1 if fix_holds else 0} ;; esac
    case " $* " in *" --labels {pair_above}_compile_ac_op "*) echo "asked: memory above" >&2; exit 0 ;; esac
    echo "asked: memory above" >&2; exit 1 ;;
  *" bench/compare_reference.py "*" --json "*) echo "table: $*" ;;
  *" -m engine.train "*)
    args=("$@")
    for i in "${{!args[@]}}"; do
      [ "${{args[$i]}}" = --job.dump_folder ] && mkdir -p "${{args[$((i + 1))]}}" \
        && touch "${{args[$((i + 1))]}}/metrics.jsonl"
    done
    echo "launched: $*" >&2 ;;
esac
exit 0
""")
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RUNS=str(tmp_path / "runs"), ONLY="bf16_compile_ac_op fp8_compile_ac_op eager_ac_op", ANCHOR="",
               CP_CHECK="0", BUDGET="100000")
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = re.findall(r"^=== Tessera (\w+): ", proc.stdout, re.MULTILINE)
    auto = ["bf16_noautotune", "fp8_noautotune" if fix_holds else "bf16_snapshot"] if above else []
    assert ran == ["bf16_compile_ac_op", "fp8_compile_ac_op", *auto, "eager_ac_op"], proc.stdout[-3000:]
    labels = "bf16_compile_ac_op,fp8_compile_ac_op,eager_ac_op" + \
        (",bf16_noautotune" if above else "") + (",fp8_noautotune" if fix_holds else "")
    assert f"--labels {labels} " in proc.stdout, proc.stdout[-3000:]
    assert "asked: memory above" in proc.stderr and ("asked: fix" in proc.stderr) == above
    snapshot_log = tmp_path / "runs" / "bf16_snapshot.log"  # the launch's output goes to its run's log
    assert snapshot_log.exists() == (above and not fix_holds)
    assert not snapshot_log.exists() or "--profiling.enable_memory_snapshot" in snapshot_log.read_text()
    fp8_log = tmp_path / "runs" / "fp8_noautotune.log"
    assert not fix_holds or "--float8.enable --compile.no-autotune" in fp8_log.read_text()
    # AUTO_MEMORY=0 never asks
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")],
                          env=dict(env, AUTO_MEMORY="0", RUNS=str(tmp_path / "runs2")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "asked: memory above" not in proc.stderr, proc.stderr[-2000:]


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


def test_compare_reference_reads_both_trainers(tmp_path):
    compare_reference = _bench_module("compare_reference")
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    log = "".join(ANCHOR_LOG.format(step=s, mem=40.0 + s / 10, tps=t)
                  for s, t in ((1, 600), (5, 10_000), (10, 29_000), (15, 29_400), (20, 29_600)))
    (anchor / "anchor_bf16_compile.log").write_text(log + VALIDATE)
    ref = compare_reference.summarize_anchor(str(anchor / "anchor_bf16_compile.log"), skip=10)
    assert ref["steps"] == "15-20"
    assert ref["tps"] == 29_500 and ref["mfu"] == pytest.approx(50.16)
    assert ref["peak_reserved_gib"] == pytest.approx(42.0)  # the validation line's 70 GiB is not a step
    assert ref["run_peak_reserved_gib"] == pytest.approx(42.0)  # its first step reserved less (40.1 GiB)

    def tessera_run(first_step_reserved):
        """Logged at the reference's steps (1, 5, 10, 15, 20), 41 GiB reserved after the first step, which
        reserved ``first_step_reserved``."""
        run = tmp_path / "tessera" / "bf16_compile_ac_op"
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "metrics.jsonl", "w") as f:
            for step in (1, 5, 10, 15, 20):
                f.write(json.dumps({"step": step, "loss": 8.0 - step / 10, "grad_norm": 1.0, "lr": 3e-4,
                                    "tps": 10_000 if step <= 5 else 32_450,
                                    "tps_per_gpu": 10_000 if step <= 5 else 32_450, "tflops": 546.0, "mfu": 55.2,
                                    "memory_gib": 39.0,
                                    "memory_reserved_gib": first_step_reserved if step == 1 else 41.0}) + "\n")

    tessera_run(first_step_reserved=40.5)
    out = tmp_path / "summary.json"
    assert compare_reference.main(["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor),
                                   "--pairs", "bf16_compile_ac_op=bf16_compile", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    # the defaults: both trainers' medians over the same windows, those after step 10 (the script's protocol)
    assert result["tessera"]["steps"] == result["reference"]["steps"] == "15-20", result
    assert result["tps_ratio"] == pytest.approx(32_450 / 29_500)
    assert result["memory_ratio"] == pytest.approx(41.0 / 42.0)
    assert result["run_memory_ratio"] == pytest.approx(41.0 / 42.0)
    # --anchor-skip follows --skip unless given
    assert compare_reference.main(["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor), "--skip", "5",
                                   "--pairs", "bf16_compile_ac_op=bf16_compile", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["tessera"]["steps"] == result["reference"]["steps"] == "10-20", result
    assert result["tps_ratio"] == pytest.approx(32_450 / 29_400)
    # --memory-above: the exit status says whether a pair's memory ratio is above the bound
    pair = ["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor),
            "--pairs", "bf16_compile_ac_op=bf16_compile"]
    assert compare_reference.main(pair + ["--memory-above", "1.0"]) == 1
    assert compare_reference.main(pair + ["--memory-above", "0.97"]) == 0
    # a first step that reserved more than the reference ever did: within bounds after warm-up, not over the
    # whole run, and --memory-above says so
    tessera_run(first_step_reserved=43.0)
    assert compare_reference.main(pair + ["--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["memory_ratio"] == pytest.approx(41.0 / 42.0)
    assert result["run_memory_ratio"] == pytest.approx(43.0 / 42.0)
    assert compare_reference.main(pair + ["--memory-above", "1.0"]) == 0


def test_compare_reference_gives_no_ratio_for_a_run_that_stopped_early(tmp_path):
    """A run cut by the time budget (or out of memory) has medians over fewer windows: marked, no ratio."""
    compare_reference = _bench_module("compare_reference")
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    (anchor / "anchor_bf16_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    for label, last in (("bf16_compile_ac_op", 25), ("fp8_compile_ac_op", 15)):
        run = tmp_path / "tessera" / label
        run.mkdir(parents=True)
        with open(run / "metrics.jsonl", "w") as f:
            for step in (1, 5, 10, 15, 20, 25):
                if step <= last:
                    f.write(json.dumps({"step": step, "loss": 7.0, "tps": 32_000, "tps_per_gpu": 32_000,
                                        "tflops": 540.0, "mfu": 54.6, "memory_gib": 39.0,
                                        "memory_reserved_gib": 41.0}) + "\n")
    out = tmp_path / "summary.json"
    assert compare_reference.main(["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor), "--pairs",
                                   "bf16_compile_ac_op=bf16_compile,fp8_compile_ac_op=bf16_compile", "--skip", "10",
                                   "--steps", "25", "--json", str(out)]) == 0
    by_label = {r["label"]: r for r in json.loads(out.read_text())}
    assert by_label["bf16_compile_ac_op"]["tps_ratio"] == pytest.approx(32_000 / 29_500)
    assert by_label["fp8_compile_ac_op"]["tessera"]["partial"] and by_label["fp8_compile_ac_op"]["tps_ratio"] is None


def test_compare_reference_and_summarize_say_no_result_for_a_run_without_metrics(tmp_path, capsys):
    """A label the script asked for whose run was skipped or failed before its first log (bench/common.sh's
    ``fresh`` removed what an earlier call left of it) is a row "no result", not a crash, and not left out."""
    compare_reference = _bench_module("compare_reference")
    summarize = _bench_module("summarize")
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    (anchor / "anchor_bf16_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    run = tmp_path / "tessera" / "bf16_compile_ac_op"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 5, 10, 15, 20, 25):
            f.write(json.dumps({"step": step, "loss": 7.0, "tps": 32_000, "tps_per_gpu": 32_000, "tflops": 540.0,
                                "mfu": 54.6, "memory_gib": 39.0, "memory_reserved_gib": 41.0}) + "\n")
    (tmp_path / "tessera" / "fp8_compile_ac_op").mkdir()  # launched, died before its first log
    out = tmp_path / "summary.json"
    capsys.readouterr()
    assert compare_reference.main(["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor), "--labels",
                                   "bf16_compile_ac_op,fp8_compile_ac_op,eager_ac_op", "--pairs",
                                   "bf16_compile_ac_op=bf16_compile,fp8_compile_ac_op=fp8_compile",
                                   "--steps", "25", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in table[2:]}
    assert list(rows) == ["bf16_compile_ac_op", "fp8_compile_ac_op", "eager_ac_op"], table
    for label in ("fp8_compile_ac_op", "eager_ac_op"):
        assert "no result (no metrics.jsonl: skipped, or stopped before its first log)" in rows[label], table
    by_label = {r["label"]: r for r in json.loads(out.read_text())}
    assert by_label["bf16_compile_ac_op"]["tps_ratio"] == pytest.approx(32_000 / 29_500)
    assert "error" in by_label["eager_ac_op"] and "tessera" not in by_label["eager_ac_op"]
    # --memory-above: a run with no result is not above anything
    assert compare_reference.main(["--tessera", str(tmp_path / "tessera"), "--anchor", str(anchor), "--labels",
                                   "fp8_compile_ac_op", "--memory-above", "0.5"]) == 1
    # summarize.py alone: "no result" and exit status 1, for a missing file and for one with no step after warm-up
    capsys.readouterr()
    assert summarize.main([str(tmp_path / "tessera" / "eager_ac_op"), "--skip", "10"]) == 1
    assert summarize.main([str(run), "--skip", "25"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("eager_ac_op: no result (no metrics.jsonl: skipped, or stopped before its first log)")
    assert lines[1].endswith("no result (no logged steps after the first 25)"), lines


def test_perf_vs_reference_never_reports_an_earlier_calls_run_as_this_ones(tmp_path):
    """RUNS (and ANCHOR_LOGS) outlive a call on a warm machine. Here an earlier call left a folder and metrics
    for every run of ONLY, with 99,999 tps, and a reference log. Now bf16_compile_ac_op is skipped (its reference
    run does not fit the budget), eager_ac_op fails before its first log and noac_compile runs: the table
    (compare_reference.py, for real) gives the first two "no result" and the third its own figures, the reference
    log is gone, and the memory table is asked for this call's launches only. Other folders stay (the tarball)."""
    repo = _copy_repo(str(tmp_path))
    os.makedirs(os.path.join(repo, ".anchor"))
    with open(os.path.join(repo, ".anchor", "run_anchor.sh"), "w") as f:
        f.write('for spec in "$@"; do echo "reference asked: ${spec%%|*}"; done\n')
    runs, logs = tmp_path / "runs", tmp_path / "anchor_logs"

    def metrics(folder, tps):
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "metrics.jsonl", "w") as f:
            for step in (1, 5, 10, 15, 20, 25):
                f.write(json.dumps({"step": step, "loss": 7.0, "tps": tps, "tps_per_gpu": tps, "tflops": 500.0,
                                    "mfu": 50.0, "memory_gib": 40.0, "memory_reserved_gib": 42.0}) + "\n")

    for label in ("bf16_compile_ac_op", "eager_ac_op", "noac_compile", "earlier_only"):  # the earlier call's
        metrics(runs / label, 99_999)
        (runs / f"{label}.log").write_text("the earlier call's log\n")
    logs.mkdir()
    (logs / "anchor_bf16_compile.log").write_text("".join(
        ANCHOR_LOG.format(step=s, mem=42.0, tps=29_500) for s in (5, 10, 15, 20, 25)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # python3: the bench scripts that read results run for real; a launch writes 12,345 tps, eager_ac_op's fails
    # first; memory_check.py says what it was asked.
    (bin_dir / "python3").write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" bench/compare_reference.py "*|*" bench/summarize.py "*) exec {sys.executable} "$@" ;;
  *" bench/memory_check.py "*) echo "memory_check: $*" ;;
  *" -m engine.train "*)
    args=("$@")
    for i in "${{!args[@]}}"; do [ "${{args[$i]}}" = --job.dump_folder ] && run=${{args[$((i + 1))]}}; done
    [ "$(basename "$run")" = eager_ac_op ] && {{ echo "died at start-up"; exit 1; }}
    mkdir -p "$run"
    for step in 1 5 10 15 20 25; do
      echo '{{"step": '$step', "loss": 7.0, "tps": 12345, "tps_per_gpu": 12345, "tflops": 100.0, "mfu": 10.0, \
"memory_gib": 40.0, "memory_reserved_gib": 42.0}}' >> "$run/metrics.jsonl"
    done ;;
esac
exit 0
""")
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), RUNS=str(runs),
               ANCHOR_LOGS=str(logs), ONLY="bf16_compile_ac_op eager_ac_op noac_compile", BUDGET="120",
               CP_CHECK="0")
    env.pop("ANCHOR", None)
    proc = subprocess.run(["bash", os.path.join(repo, "bench", "perf_vs_reference.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.findall(r"^=== Tessera (\w+): ", proc.stdout, re.MULTILINE) == ["eager_ac_op", "noac_compile"]
    table = proc.stdout[proc.stdout.index("Tessera config"):proc.stdout.index("skipped for the time budget")]
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line.strip()}
    assert list(rows) == ["bf16_compile_ac_op", "eager_ac_op", "noac_compile"], table
    assert "99,999" not in table, table
    assert "no result" in rows["bf16_compile_ac_op"] and "no result" in rows["eager_ac_op"], table
    assert "12,345" in rows["noac_compile"], table
    assert not (logs / "anchor_bf16_compile.log").exists()  # its reference run was skipped: none
    assert not (runs / "bf16_compile_ac_op").exists() and not (runs / "bf16_compile_ac_op.log").exists()
    assert "died at start-up" in (runs / "eager_ac_op.log").read_text()
    assert (runs / "earlier_only" / "metrics.jsonl").exists()  # not this call's: left for the tarball
    (asked,) = [line for line in proc.stdout.splitlines() if line.startswith("memory_check: ")]
    assert " --labels eager_ac_op,noac_compile " in asked, asked


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
    params = hopper_levers.lever_clip(1, device="cpu", flavor="debugmodel")
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
    fp32, split, _ = hopper_levers.lever_bf16(1, device="cpu", flavor="debugmodel", tokens=16).values()
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
    labels = ["ref", "same", "off", "short", "nan", "ckpt_whole", "ckpt_async_killed", "ckpt_async_resumed", "died"]
    plan = [Run(label, args) for label in labels]
    results = {label: Result(0, 1.0, "resumed from step 3") for label in labels}
    results["ckpt_async_killed"] = Result(-9, 1.0, "")
    results["died"] = Result(1, 1.0, "Traceback\nRuntimeError: CUDA error: an illegal memory access")
    c = gpu_check.Checker(plan, results, tmp_path)
    assert c.close("same", "ref", 1e-2).ok and c.falls("ref").ok
    for verdict in (c.close("off", "ref", 1e-2), c.close("short", "ref", 1e-2), c.close("nan", "ref", 1e-2),
                    c.close("died", "ref", 1e-2), c.exact_resume("async"), c.falls("same", by=0.5)):
        assert not verdict.ok, verdict.detail
    assert "illegal memory access" in c.close("died", "ref", 1e-2).detail


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
