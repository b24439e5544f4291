"""sbatch scripts: rendered for 4 nodes x 8 GPUs, valid bash, and the SIGTERM -> checkpoint -> requeue path."""

import os
import signal
import subprocess
import sys
import time

from tools import slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def render_4x8(tmp_path, *train_args, dump_folder: str = ""):
    out = tmp_path / "job.sbatch"
    dump = ["--dump-folder", dump_folder] if dump_folder else []
    with open(out, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.slurm", "--nodes", "4", "--gpus-per-node", "8", "--config",
             "train_configs/debug_model.toml", "--job-name", "tessera-test", "--partition", "gpu", "--time",
             "02:00:00", *dump, "--", *train_args], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True,
            timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


def test_render_4_nodes_x_8_gpus(tmp_path):
    script = render_4x8(tmp_path, "--training.steps", "100")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], timeout=600).returncode == 0
    for line in ["#SBATCH --job-name=tessera-test", "#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00",
                 "#SBATCH --signal=B:TERM@120", "#SBATCH --requeue", "GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "--rdzv_backend=c10d",
                 '--rdzv_endpoint="$HEAD_NODE:$MASTER_PORT"', '--nnodes="$NNODES"',
                 "export NCCL_DEBUG=", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=", 'scontrol requeue "$SLURM_JOB_ID"',
                 'LOG_DIR="$DUMP_FOLDER/slurm/', "trap forward_term TERM", "--training.steps 100"]:
        assert line in text, line
    assert text.startswith("#!/bin/bash\n")


def test_workdir_with_spaces_and_dollars(tmp_path):
    """The checkout folder is quoted for the double quotes it stands in: the script changes into it."""
    workdir = tmp_path / "my checkout $HOME"
    workdir.mkdir()
    text = slurm.render(slurm.JobSpec(nodes=1, workdir=str(workdir)))
    cd = next(line for line in text.splitlines() if line.startswith("cd "))
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_DIR"}
    proc = subprocess.run(["bash", "-c", f"{cd}; pwd"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == str(workdir), (cd, proc.stdout, proc.stderr)


def test_committed_templates_are_the_renderer_output():
    for name, spec in slurm.TEMPLATES.items():
        path = os.path.join(ROOT, "slurm", name)
        with open(path) as f:
            assert f.read() == slurm.render(spec), f"{path} is stale: python -m tools.slurm --write-templates"
        assert subprocess.run(["bash", "-n", path], timeout=600).returncode == 0


def debug_config(tmp_path, name, extra="", section="[training]"):
    """train_configs/debug_model.toml with ``extra`` appended and its [training] header spelled ``section``; the
    run folder in tmp_path."""
    with open(os.path.join(ROOT, "train_configs", "debug_model.toml")) as f:
        text = f.read().replace("[training]", section)
    path = tmp_path / name
    path.write_text(f"{text}\n{extra}\n".replace('"./outputs/debug_model"', f'"{tmp_path / "run"}"'))
    return path


LAYOUT_256 = "[parallelism]\npp = 8\ndp_shard = 4\ncp = 4\ntp = 2\n"


def test_the_renderer_checks_the_config_for_its_world(tmp_path):
    """A 256-GPU layout rendered for 1 node x 8 GPUs: the error line the job's own check would print, hours later
    on the batch node, now, and no script; for 32 nodes x 8 GPUs the same config renders."""
    config = debug_config(tmp_path, "big.toml", LAYOUT_256)
    job = subprocess.run(["bash", "-c", f'WORLD_SIZE=8 TESSERA_CHECK_ONLY=1 "{sys.executable}" -m engine.train '
                          f"--config {config} --job.dump_folder {tmp_path / 'run'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert job.returncode == 2 and job.stderr.startswith("error: parallelism: the degrees multiply to 256"), job.stderr
    render = subprocess.run([sys.executable, "-m", "tools.slurm", "--nodes", "1", "--gpus-per-node", "8",
                             "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert (render.returncode, render.stdout, render.stderr) == (2, "", job.stderr)
    render = subprocess.run([sys.executable, "-m", "tools.slurm", "--nodes", "32", "--gpus-per-node", "8",
                             "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert render.returncode == 0 and "#SBATCH --nodes=32" in render.stdout, render.stderr
    assert not (tmp_path / "run").exists()


def test_the_renderer_refuses_a_misspelled_section_and_bad_training_args(tmp_path, monkeypatch, capsys):
    """The file and the training arguments after -- are checked, in-process; WORLD_SIZE and the working
    directory are left as they were."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    cwd = os.getcwd()
    typo = debug_config(tmp_path, "typo.toml", section="[trainig]")
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--config", str(typo)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: unknown config section '[trainig]' in {typo} (did you mean 'training'?)\n"
    good = debug_config(tmp_path, "good.toml")
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--config", str(good), "--",
                       "--parallelism.tp", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: parallelism") and err.count("\n") == 1, err
    # A float8 filter that leaves no layer to convert: the launch refuses it, so does the renderer.
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--config", str(good), "--", "--float8.enable",
                       "--float8.filter_fqns", "attention,feed_forward"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: float8.filter_fqns: no linear layer would run in float8"), err
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--config", str(good), "--",
                       "--parallelism.tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert os.environ["WORLD_SIZE"] == "3" and os.getcwd() == cwd
    # Without --config: a template (CONFIG when submitting), checked when the job starts, as before.
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert "CONFIG=${CONFIG:-train_configs/llama3_8b.toml}" in capsys.readouterr().out
    missing = tmp_path / "no-checkout"
    assert slurm.main(["--config", str(good), "--workdir", str(missing)]) == 2
    assert capsys.readouterr().err == (f"error: --workdir: folder '{missing}' not found; the configuration is checked "
                                       "in the checkout the job runs in: render where it is visible (the cluster's "
                                       "login node)\n")


STUBS = {
    # scontrol: record the call; `show hostnames` lists four nodes.
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
if [ "$1 $2" = "show hostnames" ]; then printf 'node-a\\nnode-b\\nnode-c\\nnode-d\\n'; fi
""",
    # srun: record the arguments, then run the task (everything from the first non-option on); a SIGTERM to srun
    # kills the tasks, as the real srun does ("forcing job termination": it forwards SIGKILL).
    "srun": """#!/bin/bash
echo "srun $*" >> "$CALLS"
while [ "${1#--}" != "$1" ]; do shift; done
"$@" &
task=$!
trap 'echo "srun got SIGTERM" >> "$CALLS"; pkill -KILL -P "$task"; kill -KILL "$task"' TERM
wait "$task"; status=$?
while kill -0 "$task" 2>/dev/null; do wait "$task"; status=$?; done
exit "$status"
""",
    # scancel --signal=SIG JOB: record the call, then signal every process of the job step, as slurmstepd does
    # (the srun stub became launch_node.sh: it and all its descendants).
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$CALLS"
sig=${1#--signal=}
tree() { echo "$1"; for child in $(pgrep -P "$1"); do tree "$child"; done; }
for root in $(pgrep -f "^bash $DUMP_FOLDER/slurm/.*/launch_node.sh"); do
  for pid in $(tree "$root"); do kill -"$sig" "$pid" 2>/dev/null; done
done
""",
    # PYTHON: a stand-in for `-m engine.launch` (torchrun), the real interpreter for everything else.
    "python-stub": """#!/bin/bash
if [ "$1 $2" = "-m engine.launch" ]; then exec "$REAL_PYTHON" "$STUB_DIR/fake_torchrun.py"; fi
exec "$REAL_PYTHON" "$@"
""",
    # torchrun stand-in: ignores the step signal as engine.launch does (its own code), starts one training process
    # and returns its exit status; records a SIGTERM to itself.
    "fake_torchrun.py": """import os, signal, subprocess, sys
sys.path.insert(0, os.getcwd())
from engine.launch import ignore_step_signal
ignore_step_signal()
def told(*_):
    open(os.environ["CALLS"], "a").write("torchrun got SIGTERM\\n")
    sys.exit(1)
signal.signal(signal.SIGTERM, told)
worker = subprocess.Popen([sys.executable, os.path.join(os.environ["STUB_DIR"], "fake_worker.py")])
sys.exit(worker.wait())
""",
    # training process stand-in: on SIGTERM "saves" and exits 0 (FAKE_SAVE=0: dies, as without checkpoint.enable);
    # otherwise it would time out with status 3.
    "fake_worker.py": """import os, signal, sys, time
def done(*_):
    if os.environ.get("FAKE_SAVE") == "0":
        open(os.environ["CALLS"], "a").write("worker got SIGTERM, no checkpoint\\n")
        sys.exit(143)
    open(os.environ["CALLS"], "a").write("worker got SIGTERM, saved\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
open(os.environ["CALLS"], "a").write("worker running\\n")
time.sleep(60)
sys.exit(3)
""",
}


def _terminated_job(tmp_path, save: bool):
    """Run the rendered 4 x 8 script with stub srun/scontrol/scancel and a stand-in torchrun until the training
    process runs, send SIGTERM to the batch shell; returns (exit status, its output, the recorded calls)."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    for name, text in STUBS.items():
        (stub_dir / name).write_text(text)
        os.chmod(stub_dir / name, 0o755)
    calls = tmp_path / "calls.txt"
    script = render_4x8(tmp_path, dump_folder=str(tmp_path / "run"))
    # CONFIG and DUMP_FOLDER exported in the submitting shell (sbatch passes them on) do not replace the script's.
    env = dict(os.environ, CONFIG="train_configs/llama3_405b.toml", DUMP_FOLDER=str(tmp_path / "elsewhere"),
               PATH=f"{stub_dir}:{os.environ['PATH']}", CALLS=str(calls), STUB_DIR=str(stub_dir),
               REAL_PYTHON=sys.executable, PYTHON=str(stub_dir / "python-stub"), SLURM_JOB_ID="4242",
               SLURM_NNODES="4", SLURM_JOB_NODELIST="node-[a-d]", SLURM_SUBMIT_DIR=ROOT,
               SLURM_JOB_CPUS_PER_NODE="96(x3),64", VIRTUAL_ENV="set", FAKE_SAVE="1" if save else "0")
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 300  # a hang guard: the loop ends as soon as the worker runs
    while time.time() < deadline and proc.poll() is None and not (calls.exists() and "worker running" in calls.read_text()):
        time.sleep(0.2)
    if not (calls.exists() and "worker running" in calls.read_text()):
        proc.kill()  # still running past the deadline: its output, without waiting on it for ever
        raise AssertionError(proc.communicate(timeout=60)[0])
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out, calls.read_text()


def test_sigterm_is_forwarded_then_the_job_requeued(tmp_path):
    """SIGTERM to the batch shell reaches the training process (torchrun's child) through scancel's USR2 and
    launch_node.sh, never through srun (which would kill it): it exits 0 as after its checkpoint; torchrun
    ignores the USR2 (engine.launch) and exits 0; the job is requeued."""
    status, out, log = _terminated_job(tmp_path, save=True)
    assert status == 0, out
    srun = next(line for line in log.splitlines() if line.startswith("srun "))
    assert "--rdzv_endpoint=node-a:29500" in srun and "--nnodes=4" in srun and "--nproc_per_node=8" in srun
    assert "--cpus-per-task=64" in srun  # the node's task has every CPU of the (smallest) node, not one
    assert f"--config train_configs/debug_model.toml --job.dump_folder {tmp_path / 'run'}" in srun
    assert "scancel --signal=USR2 4242" in log and "srun got SIGTERM" not in log
    assert "worker got SIGTERM, saved" in log and "torchrun got SIGTERM" not in log
    assert "training stopped with status 0 after SIGTERM" in out
    assert log.strip().splitlines()[-1] == "scontrol requeue 4242"
    assert (tmp_path / "run" / "slurm" / "4242_0" / "launch_node.sh").is_file()


def test_sigterm_without_a_checkpoint_is_not_requeued(tmp_path):
    """Training processes that stop on SIGTERM without saving (checkpoint.enable off) end the job with their
    status: a requeue would start the run over, again and again."""
    status, out, log = _terminated_job(tmp_path, save=False)
    assert status != 0, out
    assert "worker got SIGTERM, no checkpoint" in log and "scontrol requeue" not in log
    assert "not requeued (a requeue would start over: set checkpoint.enable = true)" in out
