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
When a failed rank 0 was killed before it could end its ownership of the run folder (engine/run_owner.py), the
launcher ends it. Every rank's output, the ranks LOG_RANK hides included, is kept in the run folder (``RANK_LOGS``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import traceback
import warnings
from typing import Any, Optional

from engine.lifetime import LAUNCHER_ENV, PARENT_ENV, exit_now, exit_with_parent

CHECK_ENV = "TESSERA_CHECK_WORLD_SIZE"
"""run_train.sh sets it to NGPU: before starting any training process, the launcher checks the configuration as
rank 0 of that world (``check_first``)."""


class _QuietStops(logging.Filter):
    """Drops torchrun's lines about stopping the workers after one failed or a signal came (the error line, the
    report or rank 0's line on an interrupt says what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("failed (exitcode:") or message.startswith("Sending process")
                    or "death signal, shutting down workers" in message)


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
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def check_first(argv: list[str], world_size: int) -> int:
    """engine.train.check_before_launch in a process forked from this one, which has torch imported already
    (seconds less than a new interpreter); not in this process itself, which must hold no CUDA state while its
    training processes run. Returns its exit status (0: launch)."""
    with warnings.catch_warnings():  # Python 3.12 warns of fork in a process with threads; the child only reads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.environ[PARENT_ENV] = str(os.getppid())
            exit_with_parent()
            from engine.train import check_before_launch

            status = check_before_launch(argv, world_size)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return status if status >= 0 else 1


RANK_LOGS = "rank_logs"
"""Inside the run folder: torchrun's log folder of each host (``<host>/<run id>_*/attempt_<n>/<local rank>/``:
every rank's stdout, stderr and error file), instead of a new /tmp/torchelastic_* folder per launch that nothing
removes."""


def folders_of(training_args: list[str]) -> list[str]:
    """The folders the training processes own (engine.train.owned_folders), the run folder first; none when the
    configuration cannot be read (the ranks report that)."""
    from engine.config import parse_args
    from engine.train import owned_folders

    try:
        return [folder for folder, _ in owned_folders(parse_args(training_args))]
    except (Exception, SystemExit):
        return []


def end_ownership_of(folders: list[str], failures: dict[int, Any]) -> None:
    """End the ownership of the run's folders when the failed rank 0 that held it could not (torchrun kills a rank
    that does not stop within its grace period), so that they are left as any other ending leaves them."""
    from engine.run_owner import remove_if_ended

    for folder in folders:
        try:
            remove_if_ended(folder, {f.pid for f in failures.values()})
        except Exception:  # an unreadable folder: the ranks' failure is what the launcher reports, never this
            pass           # clean-up's


def remove_if_only_logs(dump_folder: str) -> None:
    """Remove the run folder this launch created when it holds nothing but the ranks' logs: the ranks stopped on a
    user error before writing anything, and a run refused at start-up leaves no folder behind (its line is
    printed)."""
    try:
        if os.listdir(dump_folder) == [RANK_LOGS]:
            shutil.rmtree(dump_folder)
    except OSError:
        pass


def main(argv: Optional[list[str]] = None) -> int:
    exit_with_parent()  # first: importing torch takes seconds
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ignore_step_signal()
    args = parse_args(argv)
    world_size = os.environ.pop(CHECK_ENV, "")
    if world_size:
        assert args.module and args.training_script == "engine.train", args.training_script
        status = check_first(args.training_script_args, int(world_size))
        if status:
            return status
    owned = folders_of(args.training_script_args)
    dump = owned[0] if owned else None
    fresh = False  # this launch creates the run folder, for its ranks' logs
    if args.log_dir is None and dump is not None:
        fresh = not os.path.lexists(dump)
        args.log_dir = os.path.join(dump, RANK_LOGS, socket.gethostname())
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_QuietStops())
    os.environ[LAUNCHER_ENV] = "1"  # inherited by the training processes
    os.environ[PARENT_ENV] = str(os.getpid())  # the training processes die with this one
    try:
        run(args)
    except SignalException as e:  # Ctrl-C, or a signal sent to this process: torchrun has stopped the workers
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        end_ownership_of(owned, e.failures)
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
        if fresh:
            remove_if_only_logs(dump)
        return int(recorded[rank]["status"])
    return 0


if __name__ == "__main__":
    exit_now(main())  # without the interpreter's slow teardown of torch
