"""One run folder, one writer: the run training into job.dump_folder owns it while it lives (and its
checkpoint.folder, when that lies elsewhere).

Rank 0 creates ``<dump_folder>/OWNER.json`` before the run writes anything there: the host, the process id and
the process's start time, the machine's boot id and process namespace, and a heartbeat counter it advances
every tenth of job.owner_timeout_seconds. It removes the file when the run ends, however it ends short of a
kill. A run that finds the file refuses (one ``error:`` line naming the owner) while the owner lives, and takes
the folder over, deleting nothing else, once the owner is gone:

- on this machine (same host, boot and process namespace): the process is gone, or another process reuses its
  id (its start time differs);
- elsewhere (another host sharing the filesystem, as under SLURM): its heartbeat has not advanced for
  job.owner_timeout_seconds. The counter is compared with itself, never with this host's clock.

The file is created with ``os.link`` of a finished temporary file, which fails when the name exists, also on
NFS, so two runs starting at once cannot both own the folder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

OWNER_FILE = "OWNER.json"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (/proc/<pid>/stat, field 22); None when the
    process does not exist or has exited (a zombie not yet reaped), "" where /proc does not tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        stat = ""
    if stat:
        fields = stat[stat.rindex(")") + 2:].split()
        return None if fields[0] == "Z" else fields[19]
    try:  # no /proc: whether the process exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def this_process() -> dict:
    """The record of this process as an owner (the heartbeat starts at 0)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_time": _start_time(pid) or "", "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": uuid.uuid4().hex, "beat": 0}


def read_owner(folder: str) -> Optional[dict]:
    """The owner record of ``folder``; None when there is none. A file that is not a record (damaged) reads as an
    owner that is gone."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        assert isinstance(record, dict) and isinstance(record.get("pid"), int)
        return record
    except (ValueError, AssertionError):
        return {"damaged": True, "token": text}


def describe(record: dict) -> str:
    return f"process {record.get('pid')} on host {record.get('host')} (started {record.get('started')})"


def _same_machine(record: dict, me: dict) -> bool:
    return all(record.get(key) == me[key] for key in ("host", "boot_id", "pid_namespace"))


def local_owner_alive(record: dict) -> Optional[bool]:
    """Whether the owner ``record`` lives, when it ran on this machine; None when it ran elsewhere (its heartbeat
    tells, ``heartbeat_advances``). This process's own earlier run (a test's) is gone."""
    if record.get("damaged"):
        return False
    me = this_process()
    if not _same_machine(record, me):
        if record.get("host") == me["host"] and record.get("boot_id") != me["boot_id"] and record.get("boot_id"):
            return False  # this host, booted since
        return None
    if record["pid"] == me["pid"]:
        return False
    started = _start_time(record["pid"])
    return started is not None and (started == record.get("start_time") or "" in (started, record.get("start_time")))


def heartbeat_advances(folder: str, record: dict, timeout: float, poll: float = 0.2) -> bool:
    """Whether the owner ``record`` (on another machine) advances its heartbeat within ``timeout`` seconds, or is
    replaced by another owner meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(poll)
        now = read_owner(folder)
        if now is None:
            return False  # it ended and removed its record
        if now.get("token") != record.get("token") or now.get("beat") != record.get("beat"):
            return True
    return False


class OwnerError(ValueError):
    """The run folder belongs to a live run (a user error: its message names the field, job.dump_folder or
    checkpoint.folder)."""


def refusal(folder: str, record: dict, field: str = "job.dump_folder") -> OwnerError:
    return OwnerError(f"{field}: {folder} is in use by the run of {describe(record)}; wait for that run "
                      f"to end or stop it, or give another {field} (a run that is gone is taken over)")


def check_free(folder: str, field: str = "job.dump_folder") -> None:
    """Refuse a folder whose owner lives on this machine (no waiting: a check before anything starts); an owner
    elsewhere is judged by ``RunOwner.acquire``."""
    record = read_owner(folder)
    if record is not None and local_owner_alive(record):
        raise refusal(folder, record, field)


def remove_record(folder: str, gone: dict) -> bool:
    """Remove the owner record ``gone`` of ``folder``, unless another run replaced it meanwhile; whether it did."""
    path = os.path.join(folder, OWNER_FILE)
    aside = f"{path}.{uuid.uuid4().hex}.gone"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        with open(aside) as f:
            text = f.read()
        try:
            taken = json.loads(text).get("token")
        except (ValueError, AttributeError):
            taken = text
        if taken != gone.get("token"):  # a new owner came first: put its record back
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            return False
        return True
    finally:
        os.unlink(aside)


def remove_if_ended(folder: str, pids: set[int]) -> bool:
    """Remove the owner record of ``folder`` when one of ``pids`` (processes this one launched, now ended) wrote
    it on this machine: a rank 0 killed before it could end its ownership. Whether it did."""
    record = read_owner(folder)
    if record is None or record.get("damaged") or record.get("pid") not in pids:
        return False
    if local_owner_alive(record) is not False:
        return False
    return remove_record(folder, record)


class RunOwner:
    """This run's ownership of ``folder``: ``acquire`` it, a thread keeps the heartbeat, ``release`` ends it.
    ``on_lost(message)`` is called, from the heartbeat thread, when another run has replaced the record."""

    def __init__(self, folder: str, timeout: float, on_lost: Callable[[str], None],
                 log: Callable[[str], None] = print, field: str = "job.dump_folder"):
        self.folder = folder
        self.field = field  # the setting that named the folder, for the messages
        self.path = os.path.join(folder, OWNER_FILE)
        self.timeout = timeout
        self.on_lost = on_lost
        self.log = log
        self.record = this_process()
        self._tmp = os.path.join(folder, f".{OWNER_FILE}.{self.record['token']}")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._created: Optional[str] = None

    def _write_tmp(self) -> None:
        with open(self._tmp, "w") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())

    def acquire(self) -> None:
        """Own the folder, or raise OwnerError naming the live owner. An owner that is gone is taken over."""
        created = os.path.abspath(self.folder)  # the folders made here, removed again if the run writes nothing
        while not os.path.lexists(os.path.dirname(created)) and os.path.dirname(created) != created:
            created = os.path.dirname(created)
        self._created = None if os.path.lexists(created) else created
        os.makedirs(self.folder, exist_ok=True)
        self._write_tmp()
        try:
            for _ in range(5):
                try:
                    os.link(self._tmp, self.path)
                    break
                except FileExistsError:
                    pass
                record = read_owner(self.folder)
                if record is None:
                    continue  # it ended meanwhile
                alive = local_owner_alive(record)
                if alive is None:
                    alive = heartbeat_advances(self.folder, record, self.timeout)
                    why = f"its heartbeat did not advance for {self.timeout:g} s (job.owner_timeout_seconds)"
                else:
                    why = "its process is gone"
                if alive:
                    raise refusal(self.folder, record, self.field)
                if remove_record(self.folder, record):
                    what = "a damaged owner record" if record.get("damaged") else f"the run of {describe(record)}"
                    self.log(f"{self.field}: taking {self.folder} over from {what}: {why}")
            else:
                raise OwnerError(f"{self.field}: {self.folder}: another run keeps taking it over at the same time; "
                                 "start one run per folder")
        finally:
            os.unlink(self._tmp)
        self._thread = threading.Thread(target=self._beat, name="tessera-run-owner", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = self.timeout / 10
        while not self._stop.wait(interval):
            try:
                record = read_owner(self.folder)
            except OSError:  # a filesystem hiccup (EIO, ESTALE on NFS): the next beat reads again
                continue
            if record is None or record.get("token") != self.record["token"]:
                taker = f"the run of {describe(record)}" if record and not record.get("damaged") else "another run"
                self.on_lost(f"{self.field}: {self.folder} was taken over by {taker} (this run's heartbeat "
                             f"did not reach it for job.owner_timeout_seconds = {self.timeout:g}); this run stops "
                             "so that one run writes there")
                return
            self.record["beat"] += 1
            try:
                self._write_tmp()
                os.replace(self._tmp, self.path)
            except OSError:  # a filesystem hiccup: the next beat tries again
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the record, if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        record = read_owner(self.folder)
        if record is not None and record.get("token") == self.record["token"]:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
        if self._created is not None:  # a run that stopped on a user error leaves no empty folders behind
            folder = os.path.abspath(self.folder)
            try:
                while True:
                    os.rmdir(folder)
                    if folder == self._created:
                        break
                    folder = os.path.dirname(folder)
            except OSError:  # not empty: the run wrote there
                pass
