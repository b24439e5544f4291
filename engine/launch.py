"""Launch the training processes of one node: torchrun (``torch.distributed.run``) with its own arguments, and
a one-line ending when the processes stop on a user error.

run_train.sh calls ``python -m engine.launch <torchrun arguments> -m engine.train ...``. A training process that
stops on a user error exits with status 2 (a bad config or data; a rank's own data shard may fail alone) or 3
(the run diverged), and writes its line, and whether it printed it, to torchrun's error file
(engine/train.py ``user_error``). torchrun would add its failure report (the launcher's traceback and a table
of the failed ranks), which says nothing more. Here the launcher exits with that status instead, and when no
rank shown on the console (``--local-ranks-filter``, run_train.sh's LOG_RANK) printed the line, it prints it.
Other ranks often fail as a consequence (killed by torchrun, or a collective whose peer is gone), maybe within
the same second: a recorded user error is taken as the cause. Failures without one (a crash, with its
traceback) keep torchrun's report.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional


class _QuietStops(logging.Filter):
    """Drops torchrun's lines about stopping the workers after one failed (the error line, or the report, says
    what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("failed (exitcode:") or message.startswith("Sending process"))


def shown_ranks(local_ranks_filter: Optional[str]) -> Optional[set[int]]:
    """The local ranks whose output the console shows (None: all)."""
    if not local_ranks_filter:
        return None
    return {int(r) for r in local_ranks_filter.split(",") if r.strip()}


def user_error(failure: Any) -> Optional[dict]:
    """What a training process recorded about its user error: its line, exit status and whether it printed it;
    None for any other failure."""
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
    try:
        run(args)
    except ChildFailedError as e:
        recorded = ((f.timestamp, rank, f, user_error(f)) for rank, f in e.failures.items())
        user = sorted(r for r in recorded if r[3] is not None)
        if not user:
            raise
        _, rank, _, info = user[0]
        shown = shown_ranks(args.local_ranks_filter)
        if not any(i["printed"] and (shown is None or f.local_rank in shown) for _, _, f, i in user):
            print(f"error: [rank {rank}] {info['line']}", file=sys.stderr, flush=True)
        return int(info["status"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
