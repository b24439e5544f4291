"""Launch the training processes of one node: torchrun (``torch.distributed.run``) with its own arguments, and
a one-line ending when the processes stop on a user error.

run_train.sh calls ``python -m engine.launch <torchrun arguments> -m engine.train ...``. A training process
that stops on a user error exits with status 2 (an error of one rank's own: its data shard, at start-up or
mid-run) or 3 (the run diverged), and records its message in torchrun's error file (engine/train.py).
torchrun would add its failure report (the launcher's traceback and a table of the failed ranks), which says
nothing more. Here the launcher exits with that status instead; when no rank whose output the console shows
(``--local-ranks-filter``, run_train.sh's LOG_RANK) has printed the error, it prints the failing rank's line
itself. Any other failure (a crash, with its traceback) keeps torchrun's report.
"""

from __future__ import annotations

import logging
import sys

USER_ERROR_EXIT_CODES = (2, 3)
"""engine/train.py's exit statuses for a user error (its message recorded in the error file)."""


class _QuietUserErrors(logging.Filter):
    """Drops torchrun's log line about a worker that exited with a user-error status (the error line says it
    all), and its lines about stopping the other workers after a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode:") and record.args:
            return record.args[0] not in USER_ERROR_EXIT_CODES
        return not message.startswith("Sending process")  # the other ranks stopped after one failed


def shown_ranks(local_ranks_filter: str | None) -> set[int] | None:
    """The local ranks whose output the console shows (None: all)."""
    if not local_ranks_filter:
        return None
    return {int(r) for r in local_ranks_filter.split(",") if r.strip()}


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietUserErrors())
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode not in USER_ERROR_EXIT_CODES:
            raise
        shown = shown_ranks(args.local_ranks_filter)
        printed = [f for f in e.failures.values() if f.exitcode in USER_ERROR_EXIT_CODES
                   and (shown is None or f.local_rank in shown)]
        if not printed:
            print(f"error: [rank {rank}] {user_message(failure.message)}", file=sys.stderr, flush=True)
        return failure.exitcode
    return 0


def user_message(message) -> str:
    """The error line a training process recorded ("ConfigError: data.path: ..."), without the class name."""
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    head, sep, rest = text.partition(": ")
    return rest if sep and head.isidentifier() else text


if __name__ == "__main__":
    sys.exit(main())
