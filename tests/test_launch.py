"""The launcher's life and death, through ./run_train.sh on gloo: a launcher SIGKILLed at any moment takes its
training processes with it, and the same command then finishes the uninterrupted run's curve bit for bit; a
SIGKILLed rank ends the run with one line naming it; a run folder has one writer (engine/run_owner.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.checkpoint.files import list_steps
from engine.checkpoint.resume import find_resume_point
from engine.config import parse_args
from engine.lifetime import descendants, running
from engine.run_owner import OWNER_FILE, OwnerError, RunOwner, read_owner, this_process
from tests.test_checkpoint import BASE, FOR_LOOP, FSDP2_TP2, curve, metrics, train

ROOT = Path(__file__).resolve().parents[1]


_launched: list[subprocess.Popen] = []


def launch(dump: Path, *args: str, ngpu: int, env: dict | None = None) -> subprocess.Popen:
    """./run_train.sh on ``ngpu`` ranks in a process group of its own (what a terminal, a container or the
    out-of-memory killer stops), with Ctrl-C's default action as in a terminal's foreground job (pytest itself
    may run in the background, where SIGINT is ignored and every child would inherit that); output in
    ``dump``.log."""
    full_env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable}
    full_env.pop("TESSERA_FAULT_AT", None)
    full_env.update(env or {})
    log = open(f"{dump}.log", "a")
    proc = subprocess.Popen(["./run_train.sh", *BASE, *args, "--job.dump_folder", str(dump)], cwd=ROOT,
                            env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _launched.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A failed test's launcher and workers (session leaders of their own) are killed, not left training through
    the rest of the suite."""
    yield
    while _launched:
        proc = _launched.pop()
        if proc.poll() is not None:  # reaped: its pid may be another process's now
            continue
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK="))[5:])


def workers(proc: subprocess.Popen) -> list[int]:
    pids = []
    for pid in descendants(proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"engine.train" in cmdline and b"engine.launch" not in cmdline:
                pids.append(pid)
        except OSError:
            pass
    return pids


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def kill_launcher(proc: subprocess.Popen, dump: Path, ngpu: int, what: str) -> None:
    """SIGKILL the launcher (``what``: its whole process "group", run_train.sh alone or "torchrun" alone): every
    training process is gone within 10 s, and the run folder does not change after that."""
    ranks = workers(proc)
    assert len(ranks) == ngpu, ranks
    started = descendants(proc.pid)  # the launcher and the training processes
    if what == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    elif what == "run_train.sh":
        proc.kill()
    else:
        assert what == "torchrun", what
        os.kill(next(pid for pid in started if b"engine.launch" in Path(f"/proc/{pid}/cmdline").read_bytes()),
                signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.time()
    wait_until(lambda: not any(running(pid) for pid in started), 10, "the launcher's processes to exit")
    print(f"workers gone {time.time() - t0:.2f}s after the kill")
    before = files(dump) if dump.exists() else {}
    time.sleep(1.0)
    assert (files(dump) if dump.exists() else {}) == before


def records(dump: Path) -> int:
    jsonl = dump / "metrics.jsonl"
    return len(jsonl.read_text().splitlines()) if jsonl.exists() else 0


RUN = [*FOR_LOOP, "--training.steps", "12", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async",
       "--validation.enable", "--validation.freq", "3", "--validation.steps", "1"]


def test_a_launcher_killed_at_any_moment_leaves_nothing_running_and_the_rerun_finishes_the_curve(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(whole, *RUN, ngpu=2)  # the uninterrupted run (harness ranks)
    stalled = tmp_path / "stalled"
    stall = {"TESSERA_FAULT_STALLED": str(stalled)}

    # Start-up: the training processes exist, they have not trained (the launcher alone is killed).
    proc = launch(cut, *RUN, ngpu=2)
    wait_until(lambda: len(workers(proc)) == 2, 120, "the workers to start")
    kill_launcher(proc, cut, 2, "run_train.sh")
    # Training, mid-run (the whole process group).
    proc = launch(cut, *RUN, ngpu=2)
    wait_until(lambda: records(cut) >= 3, 240, "three logged steps")
    kill_launcher(proc, cut, 2, "group")
    # A validation while an async save is written: the writer stalls inside DCP's write of step 6, training goes
    # on, and the validation of step 9 stalls (run_train.sh alone is killed).
    proc = launch(cut, *RUN, ngpu=2, env={"TESSERA_FAULT_AT": "6:dcp_write:stall,9:validation:stall", **stall})
    wait_until(stalled.exists, 240, "the validation of step 9")
    # Meanwhile, a second run into the folder is refused.
    second = subprocess.run(["./run_train.sh", *BASE, *RUN, "--job.dump_folder", str(cut)], cwd=ROOT, text=True,
                            capture_output=True, timeout=120, env={**os.environ, "NGPU": "2", "PYTHON": sys.executable})
    owner = read_owner(str(cut))
    assert second.returncode == 2 and second.stdout == "", second.stdout[-2000:] + second.stderr[-2000:]
    assert second.stderr.splitlines() == [
        f"error: job.dump_folder: {cut} is in use by the run of process {owner['pid']} on host "
        f"{socket.gethostname()} (started {owner['started']}); wait for that run to end or stop it, or give another "
        "job.dump_folder (a run that is gone is taken over)"]
    kill_launcher(proc, cut, 2, "run_train.sh")
    # The same command again: it takes the folder over and resumes from the newest committed step.
    proc = launch(cut, *RUN, ngpu=2)
    assert proc.wait(timeout=300) == 0, Path(f"{cut}.log").read_text()[-3000:]
    log = Path(f"{cut}.log").read_text()
    assert log.count("taking") >= 2 and "its process is gone" in log
    assert "resumed from step 3" in log.split("taking")[-1], log[-3000:]
    assert not (cut / OWNER_FILE).exists()
    assert curve(cut, range(1, 13)) == curve(whole, range(1, 13))


def test_a_launcher_killed_on_four_ranks_under_fsdp2_tp2_then_the_resume_is_bit_identical(tmp_path):
    whole, cut, stalled = tmp_path / "whole", tmp_path / "cut", tmp_path / "stalled"
    args = [*FSDP2_TP2, "--training.steps", "6", "--checkpoint.interval", "3"]
    train(whole, *args, ngpu=4)  # the uninterrupted run (harness ranks)
    assert sorted(metrics(whole)) == list(range(1, 7)) and metrics(whole)[6]["loss"] < metrics(whole)[1]["loss"]
    # Rank 0 stops right after committing step 3; the other ranks wait for it in the next step's collectives.
    # Then torchrun alone is killed (run_train.sh, its parent, is left).
    proc = launch(cut, *args, ngpu=4, env={"TESSERA_FAULT_AT": "3:committed:stall",
                                           "TESSERA_FAULT_STALLED": str(stalled)})
    wait_until(stalled.exists, 300, "step 3's commit")
    kill_launcher(proc, cut, 4, "torchrun")
    assert "dp_shard 2 x cp 1 x tp 2" in Path(f"{cut}.log").read_text()
    resumed = train(cut, *args, ngpu=4)
    assert "resumed from step 3" in resumed.stdout
    assert curve(cut, range(4, 7)) == curve(whole, range(4, 7))


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_the_run_with_one_line_naming_it(tmp_path, killed):
    """Rank 1 killed: rank 0's collective fails and it ends its ownership of the run folder itself. Rank 0 killed
    (the owner): the launcher ends that ownership, as it does when torchrun has to kill a rank 0 that did not
    stop in time."""
    proc = launch(tmp_path / "run", *FOR_LOOP, "--training.steps", "100000", "--checkpoint.interval", "3",
                  "--checkpoint.async_mode", "async", ngpu=2)
    checkpoints = str(tmp_path / "run" / "checkpoint")
    wait_until(lambda: any(ok for _, _, ok in list_steps(checkpoints)), 240, "a committed checkpoint")
    victim = next(pid for pid in workers(proc) if rank_of(pid) == killed)
    if killed == 0:
        assert read_owner(str(tmp_path / "run"))["pid"] == victim
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    status = proc.wait(timeout=120)
    print(f"launcher exited {time.time() - t0:.2f}s after the kill")
    out = Path(f"{tmp_path / 'run'}.log").read_text()
    assert status == 1, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"error: rank {killed} (process {victim} on {socket.gethostname()}) was killed by SIGKILL "
                      "(the out-of-memory killer sends it: see dmesg); the other ranks stopped. Run the same "
                      "command again to resume from the newest committed checkpoint"], out[-3000:]
    assert not (tmp_path / "run" / OWNER_FILE).exists()
    # Every rank's output is kept in the run folder, that of rank 1 (which LOG_RANK hides) too.
    attempts = list((tmp_path / "run" / "rank_logs" / socket.gethostname()).glob("none_*/attempt_0"))
    assert len(attempts) == 1 and sorted(p.name for p in attempts[0].iterdir()) == ["0", "1"], attempts
    assert (attempts[0] / "0" / "stdout.log").read_text().startswith("model llama3/")
    assert (attempts[0] / "1" / "stdout.log").is_file() and (attempts[0] / "1" / "stderr.log").is_file()
    # What a resume would load is whole: the newest step folder with its commit marker.
    steps = list_steps(checkpoints)
    cfg = parse_args([*BASE, "--job.dump_folder", str(tmp_path / "run")])
    newest = max(s for s, _, ok in steps if ok)
    assert find_resume_point(cfg).step == newest


# ------------------------------------------------------------------------------------------------------------
# The owner record
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ngpu", [1, 2])
def test_ctrl_c_stops_every_process_within_seconds_without_a_traceback(tmp_path, ngpu):
    """Ctrl-C (SIGINT to the terminal's process group: run_train.sh and the launcher; torchrun passes it on): every
    process gone within 10 s, exit status 130 and no traceback, only rank 0's line saying where it stopped (or,
    when torchrun passes the interrupt on as SIGTERM, the checkpoint that saves)."""
    import re

    dump = tmp_path / "run"
    proc = launch(dump, *FOR_LOOP, "--training.steps", "100000", "--checkpoint.interval", "3", ngpu=ngpu)
    wait_until(lambda: records(dump) >= 4, 240, "4 logged steps")
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    wait_until(lambda: not any(running(pid) for pid in started), 10, "every process to exit")
    out = Path(f"{dump}.log").read_text()
    assert "Traceback" not in out and "death signal" not in out, out[-3000:]
    assert re.search(r"interrupted \(SIGINT\) after step \d+; the same command resumes from the last committed "
                     r"checkpoint", out) or (ngpu > 1 and "SIGTERM: checkpoint of step" in out), out[-3000:]


def write_owner(folder: Path, **fields) -> dict:
    record = {**this_process(), **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OWNER_FILE).write_text(json.dumps(record))
    return record


def owner(folder: Path, timeout: float = 60.0, lost=None) -> tuple[RunOwner, list[str]]:
    lines: list[str] = []
    return RunOwner(str(folder), timeout, on_lost=lost or (lambda m: lines.append("lost: " + m)),
                    log=lines.append), lines


def test_a_live_owner_on_this_host_is_refused_and_its_folder_left_as_it_is(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        from engine.run_owner import _start_time

        record = write_owner(tmp_path, pid=sleeper.pid, start_time=_start_time(sleeper.pid))
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        before = files(tmp_path)
        run, lines = owner(tmp_path)
        with pytest.raises(OwnerError, match=f"in use by the run of process {sleeper.pid} on host "
                                             f"{record['host']} \\(started {record['started']}\\)"):
            run.acquire()
        assert files(tmp_path) == before and lines == []
    finally:
        sleeper.kill()
        sleeper.wait()
    # Now gone: taken over, and nothing else in the folder changes.
    run, lines = owner(tmp_path)
    run.acquire()
    assert lines == [f"job.dump_folder: taking {tmp_path} over from the run of process {sleeper.pid} on host "
                     f"{record['host']} (started {record['started']}): its process is gone"]
    assert read_owner(str(tmp_path))["token"] == run.record["token"]
    run.release()
    assert files(tmp_path) == {"metrics.jsonl": before["metrics.jsonl"]}


def test_an_owner_whose_pid_runs_another_program_or_whose_host_rebooted_is_gone(tmp_path):
    for fields in ({"pid": 1, "start_time": "0"}, {"pid": 1, "boot_id": "another-boot"}):
        write_owner(tmp_path, **fields)
        run, lines = owner(tmp_path)
        run.acquire()
        assert len(lines) == 1 and lines[0].endswith("its process is gone"), lines
        run.release()


def test_the_launcher_removes_only_the_record_of_its_own_ended_rank(tmp_path):
    from engine.run_owner import remove_if_ended

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        from engine.run_owner import _start_time

        write_owner(tmp_path, pid=sleeper.pid, start_time=_start_time(sleeper.pid))
        assert not remove_if_ended(str(tmp_path), {sleeper.pid})  # it lives
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not remove_if_ended(str(tmp_path), {sleeper.pid + 1})  # not one of the launcher's
    assert (tmp_path / OWNER_FILE).exists()
    assert remove_if_ended(str(tmp_path), {sleeper.pid})
    assert not (tmp_path / OWNER_FILE).exists() and list(tmp_path.iterdir()) == []


def test_an_owner_on_another_host_is_judged_by_its_heartbeat(tmp_path):
    # Its heartbeat advances (another host's run, alive): refused.
    record = write_owner(tmp_path, host="node-17", pid=4242)
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.wait(0.05):
            n += 1
            (tmp_path / OWNER_FILE).write_text(json.dumps({**record, "beat": n}))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        run, _ = owner(tmp_path, timeout=2.0)
        with pytest.raises(OwnerError, match="process 4242 on host node-17"):
            run.acquire()
    finally:
        stop.set()
        beating.join()
    # Its heartbeat stopped (its node died): taken over after job.owner_timeout_seconds.
    t0 = time.time()
    run, lines = owner(tmp_path, timeout=0.5)
    run.acquire()
    assert time.time() - t0 >= 0.5 and lines[0].endswith("its heartbeat did not advance for 0.5 s "
                                                          "(job.owner_timeout_seconds)")
    # The owner's own heartbeat advances while it runs; a run that finds the record replaced stops.
    beat_before = read_owner(str(tmp_path))["beat"]
    time.sleep(0.3)
    assert read_owner(str(tmp_path))["beat"] > beat_before
    lost = threading.Event()
    run.on_lost = lambda message: lost.set()
    write_owner(tmp_path, host="node-18")
    assert lost.wait(5)
    run.release()
    assert read_owner(str(tmp_path))["host"] == "node-18"  # not this run's record: left alone


def test_a_checkpoint_folder_outside_the_run_folder_has_one_writer_too(tmp_path):
    """Two runs in two run folders given one absolute checkpoint.folder would save into the same step folders (and
    each one's keep_latest_k delete the other's): the checkpoint folder is owned as the run folder is. Refused while
    its owner lives, with one line naming checkpoint.folder and nothing created; taken over once it is gone, and
    left without an owner record at the end."""
    shared, dump = tmp_path / "shared_checkpoints", tmp_path / "run_b"
    args = ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder",
            str(shared), "--job.dump_folder", str(dump)]
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable}
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        from engine.run_owner import _start_time

        owner = write_owner(shared, pid=sleeper.pid, start_time=_start_time(sleeper.pid))
        refused = subprocess.run(["./run_train.sh", *BASE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and refused.stderr.splitlines() == [
            f"error: checkpoint.folder: {shared} is in use by the run of process {sleeper.pid} on host "
            f"{owner['host']} (started {owner['started']}); wait for that run to end or stop it, or give another "
            "checkpoint.folder (a run that is gone is taken over)"], refused.stdout[-2000:] + refused.stderr[-2000:]
        assert not dump.exists() and sorted(os.listdir(shared)) == [OWNER_FILE]
    finally:
        sleeper.kill()
        sleeper.wait()
    done = subprocess.run(["./run_train.sh", *BASE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"checkpoint.folder: taking {shared} over from the run of process {sleeper.pid}" in done.stdout
    assert sorted(os.listdir(shared)) == ["step-000002"] and not (dump / "checkpoint").exists()
    assert not (dump / OWNER_FILE).exists()


def test_the_heartbeat_outlives_a_filesystem_error(tmp_path, monkeypatch):
    """A read of the record that fails (EIO, ESTALE on NFS) is a missed beat, not the end of the heartbeat: a dead
    heartbeat would let a run on another host take the folder over while this one still writes there."""
    import errno

    import engine.run_owner as run_owner

    read = run_owner.read_owner
    failures = []

    def flaky(folder):
        if len(failures) < 3:
            failures.append(1)
            raise OSError(errno.EIO, "Input/output error")
        return read(folder)

    run, lines = owner(tmp_path, timeout=0.5)
    run.acquire()
    monkeypatch.setattr(run_owner, "read_owner", flaky)
    deadline = time.monotonic() + 10
    while len(failures) < 3 or read(str(tmp_path))["beat"] < 3:
        assert time.monotonic() < deadline, "the heartbeat stopped after a failed read"
        time.sleep(0.05)
    assert run._thread.is_alive() and lines == []
    run.release()


def test_exit_with_parent_follows_only_its_own_parent():
    """A value naming this process's parent arms the parent-death signal; one naming this process itself (an
    in-process launcher's) or another live process (inherited through a process that did not set it) is ignored;
    one naming a process that is gone (the parent died while this one started) ends this one at once."""
    sleeper = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    code = ("import os, sys; from engine.lifetime import PARENT_ENV, exit_with_parent; "
            "os.environ[PARENT_ENV] = {value}; exit_with_parent(); print('alive')")
    try:
        for value, alive in (("str(os.getppid())", True), ("str(os.getpid())", True), (f"'{sleeper.pid}'", True),
                             (f"'{gone.pid}'", False)):
            proc = subprocess.run([sys.executable, "-c", code.format(value=value)], cwd=ROOT, capture_output=True,
                                  text=True, timeout=120)
            assert (proc.returncode, proc.stdout.strip()) == ((0, "alive") if alive else (-signal.SIGKILL, "")), \
                (value, proc.returncode, proc.stderr[-2000:])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_exit_now_ends_like_the_interpreter_with_an_idle_thread_pool():
    """``exit_now`` (every entry point's end) stops an idle thread pool's workers (Inductor compiles through one:
    a first compiled run never ended), waits for a running non-daemon thread, then runs the exit handlers and
    exits with the status given."""
    code = ("import atexit, concurrent.futures, threading, time; from engine.lifetime import exit_now; "
            "pool = concurrent.futures.ThreadPoolExecutor(2); pool.submit(lambda: 1).result(); "
            "atexit.register(lambda: print('atexit', flush=True)); "
            "threading.Thread(target=lambda: (time.sleep(0.5), print('thread', flush=True))).start(); exit_now(7)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.split()) == (7, ["thread", "atexit"]), proc.stderr[-2000:]
