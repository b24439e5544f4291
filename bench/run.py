"""The performance call: the configurations of bench/matrix.toml on one GPU, each beside its reference run.

    python3 bench/run.py [--only NAME,...] [--budget SECONDS] [--out DIR] [--runs DIR] [--no-reference]
                         [--no-follow-ups] [--matrix FILE] [--list]

Through the device tool, once `bash bench/prepare_device.sh` has filled .anchor/ and .whl/ here:

    run(command="python3 bench/run.py --only bf16_compile_ac_op,fp8_compile_ac_op", carry=[".anchor", ".whl"],
        timeout_s=600)

Each Tessera configuration runs once through ./run_train.sh, each reference run it is compared with once
through the reference kit (.anchor/run_anchor.sh), right before the first configuration that needs it. A run
whose estimate no longer fits in --budget is skipped (and so is a configuration whose reference run was), and
the summary ends with the command that runs what was skipped. A configuration's declared follow-up
(`on_memory_above`, `on_memory_within`) runs once every selected configuration declaring it has run.

Under --runs (it outlives a call on a warm machine; each run first clears what an earlier call left of it):
tessera/NAME/ (the dump folder, metrics.jsonl) and tessera/NAME.log, reference/anchor_REF.log, CHECK.log.
Under --out: summary.txt (the table of bench/summarize.py), summary.json, DATE-GPU.csv (a row per run, for
bench/results/) and runs.tar.gz (logs and metrics, no snapshots or traces).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import summarize  # noqa: E402

NEEDED = ("datasets", "tomli_w", "torchao")  # every Tessera run imports these; the device image lacks them
KEYS = {
    "settings": {"default", "flavor", "seq_len", "local_batch_size", "steps", "log_freq", "warmup_steps_skipped",
                 "common", "tessera_config", "environment", "budget", "seconds", "reference_seconds"},
    "reference": {"overrides", "seconds"},
    "config": {"overrides", "reference", "seconds", "on_memory_above", "on_memory_within"},
    "check": {"command", "after", "seconds", "limit"},
}


def matrix_errors(matrix: dict) -> list[str]:
    """What is wrong with the matrix: unknown keys, and names that name nothing."""
    errors = [f"[{t}] is not a table of the matrix" for t in matrix if t not in KEYS]
    settings, configs = matrix.get("settings", {}), matrix.get("config", {})
    errors += [f"[settings] lacks {k}" for k in sorted(KEYS["settings"] - set(settings))]
    for table in ("reference", "config", "check"):
        for name, entry in matrix.get(table, {}).items():
            errors += [f"[{table}.{name}] has no key {k}" for k in entry if k not in KEYS[table]]
    for name, c in configs.items():
        if c.get("reference") and c["reference"] not in matrix.get("reference", {}):
            errors.append(f"[config.{name}] reference '{c['reference']}' is no [reference.*]")
        errors += [f"[config.{name}] {k} '{c[k]}' is no [config.*]" for k in ("on_memory_above", "on_memory_within")
                   if k in c and c[k] not in configs]
        if "overrides" not in c:
            errors.append(f"[config.{name}] lacks overrides")
    for name, c in matrix.get("check", {}).items():
        if c.get("after") not in configs:
            errors.append(f"[check.{name}] after '{c.get('after')}' is no [config.*]")
    errors += [f"[settings] default: '{n}' is no configuration or check" for n in settings.get("default", [])
               if n not in run_order(matrix)]
    return errors


def run_order(matrix: dict) -> list[str]:
    """Every configuration in the file's order, each check right after the configuration it names."""
    order = []
    for name in matrix.get("config", {}):
        order.append(name)
        order += [c for c, check in matrix.get("check", {}).items() if check.get("after") == name]
    return order


def shapes(s: dict) -> list[str]:
    """The shapes and protocol both trainers run with."""
    return ["--model.flavor", s["flavor"], "--training.seq_len", str(s["seq_len"]), "--training.local_batch_size",
            str(s["local_batch_size"]), "--training.steps", str(s["steps"]), "--metrics.log_freq", str(s["log_freq"]),
            *shlex.split(s["common"])]


def tessera_command(matrix: dict, name: str, dump_folder: str) -> list[str]:
    s = matrix["settings"]
    return ["bash", "run_train.sh", "--config", s["tessera_config"], "--job.dump_folder", dump_folder, *shapes(s),
            *shlex.split(matrix["config"][name]["overrides"])]


def reference_command(matrix: dict, ref: str) -> list[str]:
    args = shapes(matrix["settings"]) + shlex.split(matrix["reference"][ref]["overrides"])
    return ["bash", ".anchor/run_anchor.sh", f"{ref}|{' '.join(args)}"]


def print_list(matrix: dict) -> None:
    s, default = matrix["settings"], matrix["settings"]["default"]
    print(f"Tessera: ./run_train.sh --config {s['tessera_config']} {' '.join(shapes(s))} OVERRIDES")
    print(f"reference: .anchor/run_anchor.sh \"REF|{' '.join(shapes(s))} OVERRIDES\"")
    print(f"medians after step {s['warmup_steps_skipped']}; budget {s['budget']} s; * = run by default\n")
    for name in run_order(matrix):
        mark = "*" if name in default else " "
        if name in matrix["config"]:
            c = matrix["config"][name]
            follow = "".join(f"  ({k.removeprefix('on_').replace('_', ' ')}: {c[k]})"
                             for k in ("on_memory_above", "on_memory_within") if k in c)
            print(f"{mark} {name:<22} {c.get('reference') or '-':<14} {c['overrides']}{follow}")
        else:
            print(f"{mark} {name:<22} {'(check)':<14} {matrix['check'][name]['command']}")
    print("\nreference runs:")
    for ref, r in matrix["reference"].items():
        print(f"  {ref:<22} {r['overrides'] or '(the kit defaults)'}")


class Call:
    """One device call: what ran, what was skipped, the time left."""

    def __init__(self, matrix: dict, args, env: dict):
        self.matrix, self.args, self.env = matrix, args, env
        self.settings = matrix["settings"]
        self.start = time.monotonic()
        self.runs = args.runs
        self.launched: list[str] = []   # Tessera configurations started by this call
        self.tabled: list[str] = []     # configurations of the table, in the order they came up
        self.skipped: list[str] = []    # configurations and checks the budget left out
        self.references: dict[str, bool] = {}  # reference run -> ran (False: skipped for the budget)

    def left(self) -> float:
        return self.settings["budget"] - (time.monotonic() - self.start)

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()

    def launch(self, command: list[str], log: str | None, seconds: float, env: dict | None = None) -> int:
        """COMMAND in its own process group, output to LOG (or the console), killed with its children after
        SECONDS: exit status 124 then."""
        sys.stdout.flush()
        with open(log, "w") if log else contextlib.nullcontext() as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    env=env or self.env, cwd=ROOT, start_new_session=True)
            try:
                return proc.wait(timeout=max(1.0, seconds))
            except subprocess.TimeoutExpired:
                for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                return 124

    def reference(self, ref: str) -> bool:
        """The reference run REF, once per call; whether it ran (False: the budget skipped it)."""
        if ref not in self.references:
            seconds = self.matrix["reference"][ref].get("seconds", self.settings["reference_seconds"])
            self.references[ref] = self.fits(seconds)
            if self.references[ref]:
                self.launch(reference_command(self.matrix, ref), None, self.left())
            else:
                print(f"=== skip reference {ref} (budget)")
        return self.references[ref]

    def tessera(self, name: str) -> dict | None:
        """Configuration NAME (after its reference run): its row of the table, or None if skipped."""
        config = self.matrix["config"][name]
        self.tabled.append(name)
        ref = config.get("reference") if not self.args.no_reference else None
        if ref and not self.reference(ref):
            print(f"=== skip Tessera {name} (its reference run was skipped)")
            self.skipped.append(name)
            return None
        if not self.fits(config.get("seconds", self.settings["seconds"])):
            print(f"=== skip Tessera {name} (budget)")
            self.skipped.append(name)
            return None
        clear(self.runs, name)
        self.launched.append(name)
        print(f"=== Tessera {name}: {config['overrides']}")
        log = os.path.join(self.runs, "tessera", f"{name}.log")
        env = dict(self.env, NGPU="1")
        rc = self.launch(tessera_command(self.matrix, name, os.path.join(self.runs, "tessera", name)), log,
                         self.left(), env)
        print(tail(log, 2) + ("" if rc == 0 else f"\nTessera {name}: exit {rc}"))
        self.snapshot_summary(name)
        row = summarize.compare(self.runs, name, self.matrix, self.settings["warmup_steps_skipped"],
                                self.settings["steps"])
        print(summarize.table([row])[2])
        return row

    def snapshot_summary(self, name: str) -> None:
        """The first allocator snapshot a run wrote, if any: where its reserved memory grew."""
        found = glob.glob(os.path.join(self.runs, "tessera", name, "memory_snapshot", "iteration_*",
                                       "rank0_memory_snapshot.pickle"))
        if found:
            first = min(found, key=lambda p: int(re.search(r"iteration_(\d+)", p).group(1)))
            log = os.path.join(self.runs, "tessera", f"{name}.snapshot_summary.txt")
            self.launch(["python3", "bench/snapshot_summary.py", first], log, min(120, self.left()))
            print(tail(log, 40))

    def check(self, name: str) -> None:
        check = self.matrix["check"][name]
        if not self.fits(check.get("seconds", self.settings["seconds"])):
            print(f"=== skip {name} (budget)")
            self.skipped.append(name)
            return
        print(f"=== {check['command']}")
        log = os.path.join(self.runs, f"{name}.log")
        rc = self.launch(shlex.split(check["command"]), log, min(check.get("limit", self.left()), self.left()))
        print(tail(log, 60) + ("" if rc == 0 else f"\n{name}: exit {rc}"))

    def follow_up(self, name: str, row: dict | None) -> str | None:
        """The follow-up configuration NAME's memory asks for: on_memory_above when its reserved memory is above
        its reference run's, on_memory_within when it is not; none without a memory ratio."""
        config = self.matrix["config"][name]
        if self.args.no_follow_ups or row is None:
            return None
        if summarize.memory_above(row, 1.0):
            return config.get("on_memory_above")
        if row.get("memory_ratio") is not None:
            return config.get("on_memory_within")
        return None

    def run(self, selected: list[str]) -> None:
        queue, asked = list(selected), []
        while queue:
            name = queue.pop(0)
            if name in self.matrix.get("check", {}):
                self.check(name)
            else:
                follow = self.follow_up(name, self.tessera(name))
                if follow and follow not in asked:
                    asked.append(follow)
            # A follow-up runs once no configuration still queued declares it, and once per call.
            for follow in asked:
                declared = any(follow in (self.matrix["config"].get(q, {}).get("on_memory_above"),
                                          self.matrix["config"].get(q, {}).get("on_memory_within")) for q in queue)
                if not declared and follow not in queue and follow not in self.tabled:
                    print(f"=== follow-up: {follow}")
                    queue.insert(0, follow)

    def rerun_command(self) -> str:
        flags = " --no-reference" * self.args.no_reference + " --no-follow-ups" * self.args.no_follow_ups
        return f"python3 bench/run.py --only {','.join(self.skipped)}{flags}"


def clear(runs: str, name: str) -> None:
    """Forget what an earlier call left of configuration NAME: its folder, log and summaries."""
    for path in [os.path.join(runs, "tessera", name)] + glob.glob(os.path.join(runs, "tessera", f"{name}.*")):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def tail(path: str, n: int) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:]).rstrip("\n")


def prepare(env: dict) -> tuple[str, str]:
    """The carried wheels installed, the packages every run imports checked; the GPU's name and torch's version."""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    installed = wheels and subprocess.run(["python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                           "--no-compile", "--no-cache-dir", "--upgrade", "--target", "/tmp/site",
                                           *wheels], env=env).returncode == 0
    if installed:
        env["PYTHONPATH"] = "/tmp/site:" + env["PYTHONPATH"]
    if subprocess.run(["python3", "-c", f"import {', '.join(NEEDED)}"], env=env, cwd=ROOT).returncode:
        print("error: the carried wheels are missing or broken: bash bench/prepare_device.sh here, then carry .whl",
              file=sys.stderr)
        sys.exit(2)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        gpu = ""
    print(gpu or "no nvidia-smi: no GPU here")
    version = subprocess.run(["python3", "-c", "import torch; print(torch.__version__, 'cuda', torch.version.cuda)"],
                             capture_output=True, text=True, env=env).stdout.strip()
    print(f"torch {version}")
    return gpu.splitlines()[0].split(",")[0].strip() if gpu else "", version.split(" ")[0]


def pack(runs: str, out: str) -> None:
    """Every log and metrics file under RUNS as OUT/runs.tar.gz (no plots, traces, snapshots or checkpoints)."""
    def keep(info):
        skip = info.name.endswith((".png", ".pickle", ".distcp")) or "trace" in os.path.basename(info.name)
        return None if skip else info

    path = os.path.join(out, "runs.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(runs, arcname=".", filter=keep)
    print(f"packed {runs} into {path} ({os.path.getsize(path) // 1024} KiB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", metavar="NAME,...", help="configurations and checks (default: the "
                   "matrix's default); they run in the matrix's order")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole call (default: the matrix's)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/tessera_bench_out"),
                   help="where the summary, the CSV and the tarball go (default: $OUT)")
    p.add_argument("--runs", default="/tmp/tessera_bench/runs", help="the run folders and logs")
    p.add_argument("--no-reference", action="store_true", help="no reference run (no ratios)")
    p.add_argument("--no-follow-ups", action="store_true", help="no on_memory_above / on_memory_within runs")
    p.add_argument("--matrix", default=summarize.MATRIX)
    p.add_argument("--list", action="store_true", help="print the matrix and exit")
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)

    # The matrix and the selection, before any set-up: a typo costs no device time.
    matrix = summarize.load_matrix(args.matrix)
    errors = matrix_errors(matrix)
    if errors:
        print(f"error: {args.matrix}: {'; '.join(errors)}", file=sys.stderr)
        return 2
    if args.list:
        print_list(matrix)
        return 0
    order = run_order(matrix)
    wanted = [n for n in args.only.split(",") if n] or matrix["settings"]["default"]
    unknown = [n for n in wanted if n not in order]
    if unknown:
        print(f"error: --only: unknown configuration '{unknown[0]}'; choose from: {', '.join(order)}",
              file=sys.stderr)
        return 2
    selected = [n for n in order if n in wanted]
    if args.budget is not None:
        matrix["settings"]["budget"] = args.budget
    needs_reference = not args.no_reference and any(matrix["config"].get(n, {}).get("reference") for n in selected)
    if needs_reference and not os.path.exists(os.path.join(ROOT, ".anchor", "run_anchor.sh")):
        print("error: no .anchor/run_anchor.sh: bash bench/prepare_device.sh here, then carry .anchor "
              "(or --no-reference)", file=sys.stderr)
        return 2

    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1", **matrix["settings"]["environment"])
    for folder in (args.out, os.path.join(args.runs, "tessera"), os.path.join(args.runs, "reference")):
        os.makedirs(folder, exist_ok=True)
    env["ANCHOR_LOGS"] = os.path.join(args.runs, "reference")
    gpu, torch_version = prepare(env)

    # Nothing an earlier call on this machine left counts as this call's: a run skipped or failed is "no result".
    call = Call(matrix, args, env)
    for name in selected:
        clear(args.runs, name)
        ref = matrix["config"].get(name, {}).get("reference")
        if ref and not args.no_reference:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.runs, "reference", f"anchor_{ref}.log"))
    call.run(selected)

    if call.launched:  # each run's logged peak beside tools/memory.py's estimate for its config
        call.launch(["python3", "bench/memory_check.py", "--from-runs", os.path.join(args.runs, "tessera"),
                     "--labels", ",".join(call.launched), "--out", args.runs], None, max(60.0, call.left()))
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    short = re.search(r"\b([A-Z]\d{2,4})\b", gpu)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        print(f"\n=== Tessera / reference, {gpu or 'no GPU'}, torch {torch_version}")
        if call.tabled:
            summarize.main([args.runs, "--only", ",".join(call.tabled), "--json",
                            os.path.join(args.out, "summary.json"), "--csv",
                            os.path.join(args.out, f"{today}-{short.group(1).lower() if short else 'gpu'}.csv"),
                            "--machine", gpu, "--torch", torch_version, "--matrix", args.matrix])
        if call.skipped:
            print("skipped for the time budget; the next call runs them with:")
            print(f"  {call.rerun_command()}")
        print(f"elapsed {time.monotonic() - call.start:.0f} s")
    print(report.getvalue(), end="")
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(report.getvalue())
    pack(args.runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
