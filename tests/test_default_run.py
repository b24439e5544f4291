"""The README's main job: `./run_train.sh` with its default config trains the debug model offline.

This is acceptance item 1 of the foundation: at least 100 steps, the loss falls by at least 30% from its
first logged value, and metrics.jsonl and the PNG plots are written. Only the dump folder is redirected
(into a temporary folder); everything else is the default config. Timing is not asserted here
(the run's wall time is printed by the run itself and measured in the closing notes).

When other tests run in the same session, the job starts in the background as the session's tests start
(``tests/conftest.py``; under xdist, in the controller, and a worker checks it from its status file) and is checked
last: it runs on one thread at idle scheduling priority, so it takes only the CPU time the other tests leave unused
instead of a minute of its own (docs/testing.md).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReadmeJob:
    """``./run_train.sh --job.dump_folder <folder>/debug_model``, its output in ``<folder>/run.log`` and its exit
    status, once it ends, in ``<folder>/status`` (``finished``)."""

    def __init__(self, background: bool, folder: Optional[str] = None):
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="readme_job_"))
        self.folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHON": sys.executable}
        env.pop("WORLD_SIZE", None)
        env.pop("NGPU", None)
        if background:
            env["OMP_NUM_THREADS"] = "1"  # one thread: a second one would wait on the core the other tests hold
        with open(self.folder / "run.log", "w") as log:
            self.proc = subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(self.folder / "debug_model")],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_idle_priority if background else None)
        # Its exit status, in a file: under xdist the process that checks the run is not the one that started it.
        threading.Thread(target=self._record_status, daemon=True).start()

    def _record_status(self) -> None:
        status = self.proc.wait()
        (self.folder / "status.tmp").write_text(str(status))
        os.replace(self.folder / "status.tmp", self.folder / "status")

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def finished(folder: Path) -> tuple[int, str]:
    """The exit status and output of the job run in ``folder``, once it has ended (by whichever process)."""
    deadline = time.time() + 1800  # a controller that died leaves no status
    while not (folder / "status").exists():
        assert time.time() < deadline, f"the README job in {folder} did not end"
        time.sleep(0.5)
    return int((folder / "status").read_text()), (folder / "run.log").read_text()


def _idle_priority() -> None:
    """In the child, before it runs: Linux's SCHED_IDLE (it runs only on a core nothing else wants); elsewhere the
    lowest nice value."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


BACKGROUND: Optional[ReadmeJob] = None
"""The job conftest started in the background for this session, if it did."""


def start_in_background(folder: Optional[str] = None) -> None:
    """``folder``: where the job runs (under xdist, in the session's folder, for the worker that checks it)."""
    global BACKGROUND
    BACKGROUND = ReadmeJob(background=True, folder=folder)


def _session_job() -> Optional[Path]:
    """Under xdist: the folder of the job the controller started in the background, if it did."""
    from tests import workers

    session = workers.session_folder()
    folder = Path(session) / "readme_job" if session else None
    return folder if folder is not None and folder.is_dir() else None


def discard_background() -> None:
    if BACKGROUND is not None:
        BACKGROUND.discard()


def test_default_run_trains_debug_model():
    session_job = _session_job()
    job = BACKGROUND or (None if session_job else ReadmeJob(background=False))
    folder = job.folder if job is not None else session_job
    try:
        status, out = finished(folder)
        assert status == 0, out[-3000:]

        dump = folder / "debug_model"
        with open(dump / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        steps = [r["step"] for r in rows]
        assert steps[0] == 1 and steps[-1] >= 100, steps
        first, last = rows[0]["loss"], rows[-1]["loss"]
        assert last <= 0.7 * first, f"loss {first:.3f} -> {last:.3f} fell by less than 30%"
        assert (dump / "loss.png").stat().st_size > 0
        assert (dump / "throughput.png").stat().st_size > 0
        assert (dump / "config.toml").exists()
    finally:
        if job is not None and job is not BACKGROUND:
            job.discard()
