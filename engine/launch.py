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
second. Failures without a recorded user error (a crash, with its traceback) keep torchrun's report.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional


class _QuietStops(logging.Filter):
    """Drops torchrun's lines about stopping the workers after one failed (the error line, or the report, says
    what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("failed (exitcode:") or message.startswith("Sending process"))


LAUNCHER_ENV = "TESSERA_LAUNCHER"
"""Set to 1 for the training processes: they record their user error for this launcher, which prints it."""


def user_error(failure: Any) -> Optional[dict]:
    """What a training process recorded about its user error: its line and exit status; None for any other
    failure."""
    message = failure.error_file_data.get("message")
    info = message.get("extraInfo", {}).get("tessera") if isinstance(message, dict) else None
    if not isinstance(info, dict) or "status" not in info:
        return None
    return {**info, "line": message.get("message", "")}


def ignore_step_signal() -> None:
    """Ignore SIGUSR2, in this process and (inherited) the training processes: the SLURM templates send it to
    every process of the job step (scancel --signal), and each node's launch_node.sh turns it into SIGTERM for
    the training processes alone; torchrun itself must not die of it."""
    import signal

    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def main(argv: Optional[list[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ignore_step_signal()
    args = parse_args(argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietStops())
    os.environ[LAUNCHER_ENV] = "1"  # inherited by the training processes
    try:
        run(args)
    except ChildFailedError as e:
        recorded = {rank: user_error(f) for rank, f in e.failures.items()}
        recorded = {rank: info for rank, info in recorded.items() if info is not None}
        if not recorded:
            raise
        rank = 0 if 0 in recorded else min(recorded, key=lambda r: (e.failures[r].timestamp, r))
        line = recorded[rank]["line"] if rank == 0 else f"[rank {rank}] {recorded[rank]['line']}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        return int(recorded[rank]["status"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
