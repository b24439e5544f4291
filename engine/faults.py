"""Fault injection for tests: TESSERA_FAULT_AT=<step>:<point>[,...] kills this process at a named point of the run
(engine/events.py) with SIGKILL, or with SIGTERM for the point "sigterm" (the middle of every training step, a
preemption signal arriving mid-step) and at any point with ``<step>:<point>:sigterm``. ``<step>:<point>:stall``
stops the thread there for good instead, and once the last stall of the list is reached it creates the file
TESSERA_FAULT_STALLED names (a test then kills the launcher); ``<step>:<point>:enospc`` raises the OSError of a
full disk there (ENOSPC). The points: "set_up" (the trainer built, its checkpoint loaded; the step it goes on
from), "mid_step" (named "sigterm" here), "validation"; in a checkpoint save "begin", "small_files", "dcp_write",
"dcp_data_written", "dcp_before_metadata" (inside DCP's write), "dcp_done", "before_commit" and "committed".
Installed by the entry point only when the variable is set: the training path never reads it."""

from __future__ import annotations

import errno
import os
import signal
import time

from torch.distributed.checkpoint import FileSystemWriter

from engine import events

FAULT_ENV = "TESSERA_FAULT_AT"
STALLED_ENV = "TESSERA_FAULT_STALLED"
_NAMES = {"mid_step": "sigterm"}  # a run's point -> its name in TESSERA_FAULT_AT


def install_from_env() -> None:
    """Install the faults of TESSERA_FAULT_AT when it is set (else none): a run's entry point calls it."""
    if os.environ.get(FAULT_ENV):
        events.install(fault_point, _FaultyWriter)
    else:
        events.install(None)


def fault_point(step: int, point: str) -> None:
    """Kill or stall this process here when TESSERA_FAULT_AT names ``point`` of ``step``."""
    faults = os.environ.get(FAULT_ENV, "").split(",")
    name = _NAMES.get(point, point)
    if f"{step}:{name}" in faults:
        os.kill(os.getpid(), signal.SIGTERM if name == "sigterm" else signal.SIGKILL)
    elif f"{step}:{name}:sigterm" in faults:
        os.kill(os.getpid(), signal.SIGTERM)
    elif f"{step}:{name}:enospc" in faults:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif f"{step}:{name}:stall" in faults:
        if faults[-1] == f"{step}:{name}:stall":
            open(os.environ[STALLED_ENV], "a").close()
        while True:
            time.sleep(1)


class _FaultyWriter(FileSystemWriter):
    """FileSystemWriter with fault points inside DCP's write."""

    def __init__(self, path: str, step: int, **kwargs):
        super().__init__(path, **kwargs)
        self._step = step

    def write_data(self, plan, planner):
        fault_point(self._step, "dcp_write")
        fut = super().write_data(plan, planner)
        fut.wait()
        fault_point(self._step, "dcp_data_written")
        return fut

    def finish(self, metadata, results):
        fault_point(self._step, "dcp_before_metadata")
        super().finish(metadata, results)
