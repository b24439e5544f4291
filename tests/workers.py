"""Two pytest-xdist workers on one machine (the README's test command starts two): tests that run one process at a
time run side by side, and a test that starts ranks holds the machine alone from that moment to its end.

Most of the suite's time with one worker is either multi-rank (2 to 16 processes that wait on each other in every
collective, and keep both cores busy) or one process (a core left idle). Two workers fill the idle core; ranks
beside another test's processes lose more than the other test gains (docs/testing.md), hence the lock.

The lock is a file every worker of a run opens (``flock``): a test holds it shared, and converts its hold to an
exclusive one to hold the machine alone (Linux drops the shared hold first, so two workers asking at once take
turns). A test holds the machine alone once it forks harness ranks (``hold_alone``, from
``parallel_harness.start_method``) or once two processes of a distributed world (``RANK`` set and ``WORLD_SIZE``
above 1 in their environment: torchrun's workers) are among its descendants. Without xdist every call here does
nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Optional

SESSION_ENV = "TESSERA_TEST_SESSION"
"""A folder the xdist controller makes for the session's shared files (the lock, the README job); its workers
inherit the variable."""

TIMELINE_ENV = "TESSERA_TEST_TIMELINE"
"""A file: each worker appends one JSON line per test (when it asked for the machine, got it, asked for and got it
alone, ended; the CPU time its processes took; the machine's busy CPU time while it held it alone), to see where a
run's time goes (scripts/test_timeline.py, docs/testing.md)."""

_POLL_SECONDS = 0.2


def start_session() -> str:
    """(The xdist controller, before it starts the workers.) The session's folder."""
    folder = os.environ[SESSION_ENV] = tempfile.mkdtemp(prefix="tessera-tests-")
    return folder


def end_session() -> None:
    folder = os.environ.pop(SESSION_ENV, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def session_folder() -> Optional[str]:
    """The session's folder, in the controller and in its workers; None without xdist."""
    return os.environ.get(SESSION_ENV)


class _Share:
    def __init__(self):
        self.machine = os.open(os.path.join(os.environ[SESSION_ENV], "machine"), os.O_RDWR | os.O_CREAT, 0o600)
        self.alone = False
        self.mutex = threading.Lock()  # the test's thread and the watcher's
        self.stop = threading.Event()
        self.watcher: threading.Thread | None = None

    def begin(self, test: str) -> None:
        self.times = {"worker": os.environ.get("PYTEST_XDIST_WORKER"), "test": test, "asked": time.time()}
        self.timeline = os.environ.get(TIMELINE_ENV)
        fcntl.flock(self.machine, fcntl.LOCK_SH)  # waits while the other worker's test holds the machine alone
        self.times["got"] = time.time()
        self.cpu = tree_cpu_seconds(os.getpid()) if self.timeline else 0.0
        self.alone = False
        self.stop.clear()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def hold_alone(self) -> None:
        with self.mutex:
            if self.alone:
                return
            self.times["asked_alone"] = time.time()
            fcntl.flock(self.machine, fcntl.LOCK_EX)  # waits for the other worker's test to end
            self.times["got_alone"] = time.time()
            self.busy = machine_busy_seconds() if self.timeline else 0.0
            self.alone = True

    def end(self) -> None:
        self.stop.set()
        if self.watcher is not None:
            self.watcher.join()
        with self.mutex:
            if self.timeline:
                self.times["cpu"] = tree_cpu_seconds(os.getpid()) - self.cpu
                if self.alone:
                    self.times["busy_alone"] = machine_busy_seconds() - self.busy
            fcntl.flock(self.machine, fcntl.LOCK_UN)
            self.alone = False
        if self.timeline:
            with open(self.timeline, "a") as f:
                f.write(json.dumps({**self.times, "ended": time.time()}) + "\n")

    def _watch(self) -> None:
        while not self.stop.wait(_POLL_SECONDS):
            if ranks_among(descendants(os.getpid())) >= 2:
                self.hold_alone()
                return


def descendants(pid: int) -> list[int]:
    """The live processes ``pid`` started, theirs, and so on (Linux's /proc/PID/task/TID/children). The watcher runs
    it every 0.2 s: ``engine.lifetime.descendants`` reads every process's /proc/PID/stat (ms per call, not µs)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) of ``pid`` and of its live descendants, each with the time of the children
    it has reaped: the difference over a test is what its processes took (forked ranks are reaped by their
    forkserver, a descendant that lives on; a process whose parent died before reaping it is lost)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / _TICKS


def machine_busy_seconds() -> float:
    """The CPU time the machine's cores have spent busy since it booted: user, nice, system, irq and softirq time
    (not idle, I/O wait or time the hypervisor stole)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICKS


def ranks_among(pids: list[int]) -> int:
    """How many of ``pids`` are ranks of a distributed world of more than one process (their environment as they
    started: ``RANK`` set and ``WORLD_SIZE`` above 1; a dry run's single process sets no ``RANK``)."""
    count = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        world = env.get(b"WORLD_SIZE", b"1")
        if b"RANK" in env and world.isdigit() and int(world) > 1:
            count += 1
    return count


_SHARE: _Share | None = None


def begin_test(test: str) -> None:
    global _SHARE
    if not (os.environ.get("PYTEST_XDIST_WORKER") and session_folder()):
        return
    if _SHARE is None:
        _SHARE = _Share()
    _SHARE.begin(test)


def hold_alone() -> None:
    """This test holds the machine alone until it ends (it is about to start ranks)."""
    if _SHARE is not None:
        _SHARE.hold_alone()


def end_test() -> None:
    if _SHARE is not None:
        _SHARE.end()

