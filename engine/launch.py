"""Launch the training processes of one node: torchrun (``torch.distributed.run``) with its own arguments, and
a one-line ending when the processes stop on a user error.

run_train.sh calls ``python -m engine.launch <torchrun arguments> -m engine.train ...``. A training process that
stops on a user error exits with status 2 (a bad config or data; a rank's own data shard may fail alone) or 3
(the run diverged), and writes its line to torchrun's error file (engine/train.py ``user_error``) without
printing it (LAUNCHER_ENV): torchrun's ``--tee`` would put ``[rank0]:`` before it, and a rank that
``--local-ranks-filter`` (run_train.sh's LOG_RANK) hides would not be seen. torchrun would add its failure
report (the launcher's traceback and a table of the failed ranks), which says nothing more. Here the launcher
prints the one ``error:`` line instead and exits with that status: rank 0's line when it recorded one (rank 0
reports another rank's error as ``[rank N] ...``), else the first recorded one, prefixed with its rank. Other
ranks often fail as a consequence (killed by torchrun, or a collective whose peer is gone), maybe within the same
second. A rank killed by a signal (the out-of-memory killer's SIGKILL, a user's kill) is named in one line too,
exit status 1: the others, whose collectives then fail, record their tracebacks without printing them. Other
failures (a crash, with its traceback) keep torchrun's report.

Every process dies with the one that launched it (``exit_with_parent``): run_train.sh's launcher with
run_train.sh, the training processes with the launcher, each by a SIGKILL from the kernel, so a killed launcher
(the out-of-memory killer, a container stopping) never leaves orphans training, writing into the run folder and
holding GPUs. torchrun starts its workers as session leaders, out of reach of a signal to its process group.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional


class _QuietStops(logging.Filter):
    """Drops torchrun's lines about stopping the workers after one failed (the error line, or the report, says
    what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("failed (exitcode:") or message.startswith("Sending process"))


LAUNCHER_ENV = "TESSERA_LAUNCHER"
"""Set to 1 for the training processes: they record their user error for this launcher, which prints it."""

PARENT_ENV = "TESSERA_PARENT_PID"
"""The process id of the process that launched this one, which this one must not outlive (``exit_with_parent``):
run_train.sh sets it for the launcher, the launcher for the training processes."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def exit_with_parent() -> None:
    """When PARENT_ENV names this process's parent: die (SIGKILL) as soon as that parent dies, as a kernel
    parent-death signal on Linux, else from a thread that watches the parent. A parent that is gone already (it died
    while this process started) ends this process now. A value that names another live process (inherited through
    a process that did not set it) is ignored."""
    text = os.environ.get(PARENT_ENV, "")
    if not text.isdigit():
        return
    parent = int(text)
    if parent == os.getpid() or (os.getppid() != parent and _running(parent)):
        return
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="tessera-exit-with-parent", daemon=True).start()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def user_error(failure: Any) -> Optional[dict]:
    """What a training process recorded about its user error: its line and exit status; None for any other
    failure."""
    message = failure.error_file_data.get("message")
    info = message.get("extraInfo", {}).get("tessera") if isinstance(message, dict) else None
    if not isinstance(info, dict) or "status" not in info:
        return None
    return {**info, "line": message.get("message", "")}


def killed_rank_line(failures: dict[int, Any]) -> Optional[str]:
    """The line naming the rank a signal killed first (the others' failures follow from it); None when no rank
    was killed by a signal."""
    killed = {rank: f for rank, f in failures.items() if f.exitcode is not None and f.exitcode < 0}
    if not killed:
        return None
    rank = min(killed, key=lambda r: (killed[r].timestamp, r))
    f = killed[rank]
    hint = " (the out-of-memory killer sends it: see dmesg)" if f.exitcode == -signal.SIGKILL else ""
    return (f"rank {rank} (process {f.pid} on {socket.gethostname()}) was killed by {f.signal_name()}{hint}; "
            "the other ranks stopped. Run the same command again to resume from the newest committed checkpoint")


def ignore_step_signal() -> None:
    """Ignore SIGUSR2, in this process and (inherited) the training processes: the SLURM templates send it to
    every process of the job step (scancel --signal), and each node's launch_node.sh turns it into SIGTERM for
    the training processes alone; torchrun itself must not die of it."""
    import signal

    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def main(argv: Optional[list[str]] = None) -> int:
    exit_with_parent()  # first: importing torch takes seconds
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ignore_step_signal()
    args = parse_args(argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietStops())
    os.environ[LAUNCHER_ENV] = "1"  # inherited by the training processes
    os.environ[PARENT_ENV] = str(os.getpid())  # the training processes die with this one
    try:
        run(args)
    except ChildFailedError as e:
        recorded = {rank: user_error(f) for rank, f in e.failures.items()}
        recorded = {rank: info for rank, info in recorded.items() if info is not None}
        if not recorded:
            line = killed_rank_line(e.failures)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr, flush=True)
            return 1
        rank = 0 if 0 in recorded else min(recorded, key=lambda r: (e.failures[r].timestamp, r))
        line = recorded[rank]["line"] if rank == 0 else f"[rank {rank}] {recorded[rank]['line']}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        return int(recorded[rank]["status"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
