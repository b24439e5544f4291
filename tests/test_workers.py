"""The lock two pytest-xdist workers share (tests/workers.py): tests that run one process run side by side, a test
that starts ranks waits for the other worker's test to end and then holds the machine alone, and torchrun's
workers among a test's processes are seen."""

import os
import subprocess
import sys
import threading
import time

from tests import workers


def _shares(tmp_path, monkeypatch, count: int) -> list:
    """``count`` workers' hold on a lock of their own (not the session's)."""
    monkeypatch.setenv(workers.SESSION_ENV, str(tmp_path))
    monkeypatch.delenv(workers.TIMELINE_ENV, raising=False)
    return [workers._Share() for _ in range(count)]


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_one_process_tests_share_and_a_test_with_ranks_waits_then_holds_the_machine_alone(tmp_path, monkeypatch):
    a, b = _shares(tmp_path, monkeypatch, 2)
    a.begin("a")
    b.begin("b")  # both shared at once: this returns
    alone = _in_thread(a.hold_alone)
    alone.join(0.5)
    assert alone.is_alive()  # b's test still runs
    b.end()
    alone.join(5)
    assert not alone.is_alive() and a.alone
    nxt = _in_thread(lambda: b.begin("b"))  # b's next test waits for a's to end
    nxt.join(0.5)
    assert nxt.is_alive()
    a.end()
    nxt.join(5)
    assert not nxt.is_alive()
    b.end()


def test_both_workers_asking_to_hold_the_machine_alone_take_turns(tmp_path, monkeypatch):
    a, b = _shares(tmp_path, monkeypatch, 2)
    a.begin("a")
    b.begin("b")
    first, second = _in_thread(a.hold_alone), _in_thread(b.hold_alone)
    deadline = time.time() + 5
    while not (a.alone or b.alone):
        assert time.time() < deadline, "neither worker got the machine"
        time.sleep(0.05)
    winner, loser = (a, b) if a.alone else (b, a)
    time.sleep(0.3)
    assert not loser.alone
    winner.end()
    for thread in (first, second):
        thread.join(5)
        assert not thread.is_alive()
    assert loser.alone
    loser.end()


def _sleepers(world_size: int, count: int = 2, env: dict | None = None) -> list[subprocess.Popen]:
    """``count`` processes with the environment of ranks of ``world_size`` (or ``env``), once they run their own
    program (until exec, /proc shows the parent's environment)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=env or {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size)})
             for rank in range(count)]
    deadline = time.time() + 10
    while not all(b"time.sleep" in open(f"/proc/{p.pid}/cmdline", "rb").read() for p in procs):
        assert time.time() < deadline, "the processes did not start"
        time.sleep(0.01)
    return procs


def test_two_ranks_of_a_world_among_a_tests_processes_make_it_hold_the_machine_alone(tmp_path, monkeypatch):
    (a,) = _shares(tmp_path, monkeypatch, 1)
    singles = _sleepers(1)  # two one-process runs (RANK 0, WORLD_SIZE 1): no world
    singles += _sleepers(1, 1, env={**os.environ, "RANK": "0"})  # RANK alone: no world either
    try:
        assert workers.ranks_among([p.pid for p in singles]) == 0
        assert set(p.pid for p in singles) <= set(workers.descendants(os.getpid()))
        a.begin("a")
        time.sleep(3 * workers._POLL_SECONDS)
        assert not a.alone
        ranks = _sleepers(2)
        try:
            assert workers.ranks_among([p.pid for p in ranks]) == 2
            deadline = time.time() + 5
            while not a.alone:
                assert time.time() < deadline, "the watcher did not see the ranks"
                time.sleep(0.05)
        finally:
            for p in ranks:
                p.kill()
                p.wait()
        a.end()
        assert not a.alone
    finally:
        for p in singles:
            p.kill()
            p.wait()


BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.5:\n    pass"


def test_the_timeline_counts_the_cpu_time_of_the_processes_a_test_started(tmp_path, monkeypatch):
    """A test's CPU time is its worker's and every process it started, reaped ones included; while it holds the
    machine alone, the machine's busy time is recorded too."""
    import json

    (a,) = _shares(tmp_path, monkeypatch, 1)
    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(workers.TIMELINE_ENV, str(timeline))
    a.begin("idle")
    a.end()
    a.begin("burns")
    a.hold_alone()
    subprocess.run([sys.executable, "-c", BURN], check=True)  # half a second of CPU, in a child reaped here
    a.end()
    idle, burns = (json.loads(line) for line in timeline.read_text().splitlines())
    assert idle["cpu"] < 0.3 and "busy_alone" not in idle, idle
    assert burns["cpu"] >= 0.45 and burns["busy_alone"] >= 0.45, burns
