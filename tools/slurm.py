"""sbatch scripts for Tessera: one node or many, torchrun with a c10d rendezvous on the job's first node.

    python -m tools.slurm --nodes 4 --gpus-per-node 8 --config train_configs/llama3_70b.toml \\
        --job-name llama70b [--partition P] [--account A] [--time 48:00:00] [--dump-folder DIR] \\
        [-- --section.key value ...] > job.sbatch
    sbatch job.sbatch

The rendered script
- asks for ``--nodes`` nodes with ``--gpus-per-node`` GPUs each, one task per node (the task is torchrun, which
  starts one process per GPU);
- checks the configuration once on the batch node for the whole world (one ``error:`` line and no job steps
  for a user error);
- takes the first node of ``scontrol show hostnames $SLURM_JOB_NODELIST`` as the rendezvous host (c10d, port
  ``MASTER_PORT``, default 29500, the job id as rendezvous id);
- sets NCCL and PyTorch environment knobs (every one overridable from the submitting shell);
- writes the logs of each attempt to ``<dump_folder>/slurm/<job id>_<restart count>/`` (one file per node,
  the batch script's own output beside the submit directory as ``<job name>-<job id>.out``);
- handles preemption and the time limit: ``--signal=B:TERM@120`` has SLURM send SIGTERM to the batch shell
  two minutes before the end; the script passes it on as ``scancel --signal=USR2`` to the job steps (never
  SIGTERM to srun, which would kill them). On every node a small shell around torchrun turns it into SIGTERM
  for the training processes (torchrun ignores USR2, engine.launch); they save a checkpoint at the next step
  boundary and exit 0 (``checkpoint.enable = true``). Should SLURM signal torchrun too (a preemption signals
  every process of the job), torchrun waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (here 110) before it
  kills them. When the training ended with status 0 after the signal, the script runs ``scontrol requeue``:
  the requeued job runs the same command with the same dump folder and resumes from the newest checkpoint.
  Any other status ends the job with it (a requeue without a checkpoint would start the run over).

Before it renders for a ``--config``, the tool runs that same check here (``check_config``), in the checkout the
job runs in (``--workdir``) and for the cluster's GPUs (Hopper, as a dry run): a user error is the same one
``error:`` line and exit status 2, and no script is written, instead of a job that waited in the queue to be
refused. Render where the job's files are visible (the cluster's login node). A script rendered for a
``--config`` runs that config and dump folder whatever CONFIG or DUMP_FOLDER the submitting shell exports.
Arguments given to sbatch itself are checked only by the script; so is the config of a script rendered without
``--config`` (a template, like those below, which reads CONFIG from the submitting shell).

``slurm/single_node.sbatch`` and ``slurm/multi_node.sbatch`` are this renderer's output with the defaults
(tests/test_slurm.py keeps them in sync); they read CONFIG, DUMP_FOLDER, GPUS_PER_NODE, PYTHON and extra
training arguments from the submitting shell: ``CONFIG=my.toml sbatch --nodes 16 slurm/multi_node.sbatch
--training.steps 100``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

from engine.config import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class JobSpec:
    """What an sbatch script is rendered from."""

    nodes: int = 1
    gpus_per_node: int = 8
    config: str = "train_configs/llama3_8b.toml"
    job_name: str = "tessera"
    dump_folder: str = ""
    """The run folder; empty: the config's job.dump_folder (read when the job starts)."""
    partition: str = ""
    account: str = ""
    time: str = "24:00:00"
    cpus_per_task: int = 0
    """CPUs of the one task per node; 0: every CPU of the node (the job has its nodes to itself)."""
    workdir: str = ""
    """The Tessera checkout the job runs in; empty: the directory sbatch was called from."""
    train_args: list[str] = field(default_factory=list)
    """Extra ``--section.key value`` arguments for every rank."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM sends SIGTERM to the batch shell."""
    fixed: bool = False
    """The script runs its own config and dump folder (rendered for one run: ``--config``, a sweep's runs), whatever
    CONFIG and DUMP_FOLDER the submitting shell holds (sbatch passes the shell's environment on); False: a
    template, which reads them from there."""


def _double_quoted(text: str) -> str:
    """``text`` escaped to stand inside double quotes in bash."""
    return "".join("\\" + c if c in '\\"$`' else c for c in text)


def render(spec: JobSpec) -> str:
    """The sbatch script for ``spec``."""
    q = shlex.quote
    header = [
        "#!/bin/bash",
        f"# Tessera training on {spec.nodes} node(s) x {spec.gpus_per_node} GPU(s); rendered by tools.slurm",
        "# (python -m tools.slurm --help). Submit from the Tessera checkout: sbatch THIS_FILE [--section.key value ...]",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={spec.gpus_per_node}",
    ]
    if spec.cpus_per_task:
        header.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        header.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        header.append(f"#SBATCH --account={spec.account}")
    header += [
        f"#SBATCH --time={spec.time}",
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:TERM@{spec.signal_seconds}",
        "#SBATCH --requeue",
    ]
    # Inside the double quotes of cd "${TESSERA_DIR:-...}", single quotes would stay literal: escape for them.
    workdir = _double_quoted(spec.workdir) if spec.workdir else "$SLURM_SUBMIT_DIR"
    train_args = " ".join(q(a) for a in spec.train_args)
    dump = q(spec.dump_folder) if spec.dump_folder else ""
    if spec.fixed:  # not from the environment: a CONFIG exported in the submitting shell must not replace it
        config_lines = (f"CONFIG={q(spec.config)}  # this script's own, not read from the environment\n"
                        f"DUMP_FOLDER={dump or q('')}")
        overridable = "the checkout, GPUS_PER_NODE and PYTHON overridable"
    else:
        config_lines = f"CONFIG=${{CONFIG:-{q(spec.config)}}}\nDUMP_FOLDER=${{DUMP_FOLDER:-{dump}}}"
        overridable = "each overridable"
    body = f'''
set -uo pipefail

# ---- what to run ({overridable} from the submitting shell) ----
cd "${{TESSERA_DIR:-{workdir}}}" || exit 2
{config_lines}
GPUS_PER_NODE=${{GPUS_PER_NODE:-${{SLURM_GPUS_ON_NODE:-{spec.gpus_per_node}}}}}
PYTHON=${{PYTHON:-python3}}
if [ -z "${{VIRTUAL_ENV:-}}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi
if [ -z "$DUMP_FOLDER" ]; then  # the config's job.dump_folder
  DUMP_FOLDER=$("$PYTHON" -c 'import sys; from engine.config import parse_args; print(parse_args(sys.argv[1:]).job.dump_folder)' \\
    --config "$CONFIG" {train_args} "$@") || exit 2
fi
TRAIN_ARGS=(--config "$CONFIG" --job.dump_folder "$DUMP_FOLDER" {train_args} "$@")
NNODES=${{SLURM_NNODES:-{spec.nodes}}}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

# ---- NCCL and PyTorch knobs ----
export NCCL_DEBUG=${{NCCL_DEBUG:-WARN}}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${{TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}}  # a failed collective ends the job
export TORCH_NCCL_AVOID_RECORD_STREAMS=${{TORCH_NCCL_AVOID_RECORD_STREAMS:-1}}
export NCCL_IB_TIMEOUT=${{NCCL_IB_TIMEOUT:-22}}
# Collective timeouts and the NCCL flight recorder (dumps into the run's comm_traces/): [comm] in the config.
# export NCCL_SOCKET_IFNAME=ib0   # the bootstrap interface, when NCCL picks the wrong one
# export NCCL_IB_HCA=mlx5         # the InfiniBand adapters to use
export PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}}  # grace for the SIGTERM checkpoint
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}
export PYTHONUNBUFFERED=1

# ---- logs: one folder per attempt (a requeued job starts a new one) ----
LOG_DIR="$DUMP_FOLDER/slurm/${{SLURM_JOB_ID:-local}}_${{SLURM_RESTART_COUNT:-0}}"
mkdir -p "$LOG_DIR"
echo "job ${{SLURM_JOB_ID:-?}} attempt ${{SLURM_RESTART_COUNT:-0}}: $NNODES node(s) x $GPUS_PER_NODE GPU(s), logs in $LOG_DIR"

# ---- check the configuration once for the whole world: a user error is one line, before any step ----
if ! WORLD_SIZE=$WORLD_SIZE TESSERA_CHECK_ONLY=1 "$PYTHON" -m engine.train "${{TRAIN_ARGS[@]}}"; then
  echo "configuration refused; nothing launched" >&2
  exit 2
fi

# ---- rendezvous on the first node ----
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${{MASTER_PORT:-29500}}
echo "rendezvous: $HEAD_NODE:$MASTER_PORT (c10d, id ${{SLURM_JOB_ID:-0}})"

# ---- SIGTERM (time limit or preemption): forward, let the ranks checkpoint, requeue ----
# Not through srun: srun turns a SIGTERM into SIGKILL for its tasks. scancel --signal reaches every process of
# the job steps (not this shell): USR2, which engine.launch (torchrun) ignores and each node's launch_node.sh
# turns into SIGTERM for the training processes alone.
SRUN_PID=""
TERMINATED=0
forward_term() {{
  TERMINATED=1
  echo "SIGTERM received: telling the training processes (checkpoint at the next step boundary)"
  if [ -n "$SRUN_PID" ]; then scancel --signal=USR2 "$SLURM_JOB_ID"; fi
}}
trap forward_term TERM

# Each node runs torchrun (engine.launch: torchrun with a one-line ending on a user error) under a small shell
# that passes SIGTERM (or the USR2 above) as SIGTERM straight to the training processes (children of torchrun):
# they checkpoint and exit 0, and torchrun, not signalled itself, exits 0 as well.
NODE_LAUNCH="$LOG_DIR/launch_node.sh"
cat > "$NODE_LAUNCH" <<'NODE'
#!/bin/bash
launcher=""  # the trap comes first: a signal right after the launch must not end this shell (USR2's default)
trap '[ -n "$launcher" ] && pkill -TERM -P "$launcher" || true' TERM USR2
TESSERA_PARENT_PID=$$ "$PYTHON" -m engine.launch "$@" &  # torchrun dies with this shell
launcher=$!
status=0
wait "$launcher" || status=$?
while kill -0 "$launcher" 2>/dev/null; do status=0; wait "$launcher" || status=$?; done
exit "$status"
NODE
export PYTHON

# The node's one task (torchrun and its GPUs' training processes) gets every CPU of the node (of the smallest node:
# SLURM_JOB_CPUS_PER_NODE reads like "96(x3),64"): by default a step's task gets one CPU, and on clusters that
# confine tasks to their CPUs every rank of the node would share it (srun does not take --cpus-per-task from
# sbatch since Slurm 22.05).
NODE_CPUS=${{SLURM_CPUS_PER_TASK:-$(echo "${{SLURM_JOB_CPUS_PER_NODE:-1}}" | tr ',' '\\n' | sed 's/(.*//' | sort -n | head -n 1)}}
srun --ntasks-per-node=1 --cpus-per-task="$NODE_CPUS" --kill-on-bad-exit=1 \\
  --output="$LOG_DIR/%N.log" \\
  bash "$NODE_LAUNCH" \\
    --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" \\
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$MASTER_PORT" --rdzv_id="${{SLURM_JOB_ID:-0}}" \\
    --local-ranks-filter=0 --role=rank --tee=3 \\
    -m engine.train "${{TRAIN_ARGS[@]}}" &
SRUN_PID=$!
STATUS=0
wait "$SRUN_PID" || STATUS=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait: wait for the step itself
  STATUS=0
  wait "$SRUN_PID" || STATUS=$?
done

if [ "$TERMINATED" = 1 ] && [ "$STATUS" = 0 ]; then
  echo "training stopped with status 0 after SIGTERM; requeueing job ${{SLURM_JOB_ID:-?}} to resume from the newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [ "$TERMINATED" = 1 ]; then  # no checkpoint was saved at the signal (checkpoint.enable off, or a failure)
  echo "training stopped with status $STATUS after SIGTERM; not requeued (a requeue would start over: set checkpoint.enable = true)"
fi
echo "training finished with status $STATUS"
exit "$STATUS"
'''
    return "\n".join(header) + "\n" + body


def check_config(spec: JobSpec) -> None:
    """The rendered script's configuration check (engine.train.check, as ``TESSERA_CHECK_ONLY=1 python -m
    engine.train`` runs it on the batch node) for ``spec``'s world of nodes x gpus_per_node ranks, run in this
    process: in ``spec.workdir``, where the job's relative paths point, and for the cluster's GPUs (Hopper, as
    a dry run plans). Raises ValueError (ConfigError among them) naming the field."""
    from engine.config.validation import HOPPER
    from engine.train import check

    argv = ["--config", spec.config]
    if spec.dump_folder:
        argv += ["--job.dump_folder", spec.dump_folder]
    argv += spec.train_args
    cwd, world_size = os.getcwd(), os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(spec.nodes * spec.gpus_per_node)  # check() reads the world size from there
    try:
        os.chdir(spec.workdir or cwd)
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the script
            check(argv, HOPPER)
    finally:
        os.chdir(cwd)
        if world_size is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = world_size


TEMPLATES = {
    "single_node.sbatch": JobSpec(nodes=1, job_name="tessera"),
    "multi_node.sbatch": JobSpec(nodes=4, job_name="tessera"),
}
"""The committed templates in slurm/: the renderer's output for these specs."""


def write_templates(folder: str = os.path.join(ROOT, "slurm")) -> list[str]:
    """(Re)write slurm/*.sbatch from TEMPLATES; returns the paths."""
    paths = []
    for name, spec in TEMPLATES.items():
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(render(spec))
        os.chmod(path, 0o755)
        paths.append(path)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = ArgumentParser(prog="python -m tools.slurm",
                       description="Render an sbatch script for Tessera (see the module docstring).")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--config", default=None,
                   help=f"the training config, checked now for the job's world (default: {JobSpec.config}, or "
                        "CONFIG when submitting; a template, checked when the job starts)")
    p.add_argument("--job-name", default="tessera")
    p.add_argument("--dump-folder", default="", help="run folder (default: the config's job.dump_folder)")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--cpus-per-task", type=int, default=0)
    p.add_argument("--workdir", default=ROOT, help="the Tessera checkout on the cluster (default: this one)")
    p.add_argument("--write-templates", action="store_true", help="rewrite slurm/*.sbatch and exit")
    a = p.parse_args(argv)
    if a.write_templates:
        for path in write_templates():
            print(path)
        return 0
    if a.nodes < 1 or a.gpus_per_node < 1:
        print("error: --nodes and --gpus-per-node must be >= 1", file=sys.stderr)
        return 2
    template = a.config is None  # the default config, or CONFIG when submitting: checked when the job starts
    if template:
        a.config = JobSpec.config
    elif not os.path.isdir(a.workdir):
        print(f"error: --workdir: folder '{a.workdir}' not found; the configuration is checked in the checkout the "
              "job runs in: render where it is visible (the cluster's login node)", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.workdir, a.config) if not os.path.isabs(a.config) else a.config):
        print(f"error: --config: file '{a.config}' not found (relative paths are from --workdir {a.workdir})",
              file=sys.stderr)
        return 2
    spec = JobSpec(nodes=a.nodes, gpus_per_node=a.gpus_per_node, config=a.config, job_name=a.job_name,
                   dump_folder=a.dump_folder, partition=a.partition, account=a.account, time=a.time,
                   cpus_per_task=a.cpus_per_task, workdir=a.workdir, train_args=train_args, fixed=not template)
    if not template:
        try:
            check_config(spec)
        except ValueError as e:  # user errors (ConfigError is one) name their field
            print(f"error: {e}", file=sys.stderr)
            return 2
    sys.stdout.write(render(spec))
    return 0


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
