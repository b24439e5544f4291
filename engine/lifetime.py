"""A process that must not outlive the one that launched it (run_train.sh -> launcher -> training processes), and
the environment the launcher hands its training processes."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "TESSERA_LAUNCHER"
"""Set to 1 for the training processes: they record their user error for this launcher, which prints it."""

PARENT_ENV = "TESSERA_PARENT_PID"
"""The process id of the process that launched this one, which this one must not outlive (``exit_with_parent``):
run_train.sh sets it for the launcher, the launcher for the training processes."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def running(pid: int) -> bool:
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


def descendants(pid: int) -> list[int]:
    """Every live process started by ``pid`` (its children, theirs, ...), from /proc: the training processes are
    session leaders of their own, so no process group holds them with their launcher."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            children.setdefault(int(parent), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found_now = children.get(todo.pop(), [])
        found += found_now
        todo += found_now
    return found


def exit_with_parent() -> None:
    """When PARENT_ENV names this process's parent: die (SIGKILL) as soon as that parent dies, as a kernel
    parent-death signal on Linux, else from a thread that watches the parent. A parent that is gone already (it died
    while this process started) ends this process now. A value that names another live process (inherited through
    a process that did not set it) is ignored."""
    text = os.environ.get(PARENT_ENV, "")
    if not text.isdigit():
        return
    parent = int(text)
    if parent == os.getpid() or (os.getppid() != parent and running(parent)):
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


_interrupted = False


def watch_interrupt() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt as Python's default does, and is remembered: torch's writers can
    turn it into another error (an interrupted write of a checkpoint file is a short write to its zip writer, and
    DCP wraps whatever a save raises), which ``interrupted`` then still tells apart. Kept as is where SIGINT is
    ignored (a process started in the background)."""
    def on_sigint(signum, frame):
        global _interrupted
        _interrupted = True
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)


def interrupted(e: BaseException | None = None) -> bool:
    """Whether this process got SIGINT (``watch_interrupt``), or ``e`` is a KeyboardInterrupt."""
    return _interrupted or isinstance(e, KeyboardInterrupt)


def _shut_threads_down() -> None:
    """What the interpreter does first at exit: the threading module's exit hooks, among them concurrent.futures'
    (which tells idle thread-pool workers, such as Inductor's compile pool's, to stop), then a join of every
    non-daemon thread. ``threading._shutdown`` is private: this is the one place that calls it."""
    threading._shutdown()


def exit_now(status: int | None) -> None:
    """End this process with ``status`` (None: 0), as ``sys.exit`` would but without the interpreter tearing its
    modules down one by one, which takes torch's a second or more in every process. Threads are shut down as at
    the interpreter's exit and exit handlers run first, and the standard streams are flushed."""
    _shut_threads_down()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status or 0)
