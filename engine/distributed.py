"""The world: process group, device, seeds and determinism.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain ``python -m engine.train`` is a world of one.
NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from engine.config import ConfigError, check_choice


@dataclass
class World:
    rank: int
    """Global rank of this process."""
    local_rank: int
    """Rank of this process on its node (selects the GPU)."""
    world_size: int
    """Number of processes in the job."""
    device: torch.device
    """The device this rank computes on."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def logs(self) -> bool:
        """Whether this rank prints the run's log lines (``log_ranks``)."""
        return self.rank in log_ranks()


def log_ranks() -> frozenset[int]:
    """The ranks that print the run's log lines (start-up, metrics, checkpoints): run_train.sh's LOG_RANK, which it
    passes on as TESSERA_LOG_RANKS; rank 0 by default. Files are written by rank 0 whatever it is."""
    try:
        ranks = frozenset(int(r) for r in os.environ.get("TESSERA_LOG_RANKS", "0").split(",") if r.strip())
    except ValueError:
        ranks = frozenset()
    return ranks or frozenset({0})


def process_group_backend(device_type: str, cpu_offload: bool = False) -> str:
    """nccl on CUDA, gloo elsewhere. Under FSDP's CPU offload (``cpu_offload``) CUDA gets gloo beside nccl: the
    gradients, and so the gradient norm's collectives, live in CPU memory, which NCCL cannot reduce."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def backend_from_env(cuda: bool) -> Optional[str]:
    """TESSERA_BACKEND, the process-group backend chosen instead of process_group_backend's (gloo lets several ranks
    share one GPU, which NCCL refuses: a check of CUDA code paths); None when unset. ``cuda``: CUDA GPUs are
    present. A ConfigError naming it when it is not a backend this machine has."""
    backend = os.environ.get("TESSERA_BACKEND") or None
    if backend is not None:
        check_choice("TESSERA_BACKEND", backend, ["gloo", "nccl"])
        if backend == "nccl" and not cuda:
            raise ConfigError("TESSERA_BACKEND: nccl needs CUDA GPUs; unset it (gloo is the default here) or set gloo")
    return backend


def backend_for(device_type: str, cpu_offload: bool) -> str:
    """The run's process-group backend: gloo when TESSERA_BACKEND says so, else process_group_backend's
    (TESSERA_BACKEND=nccl is its choice on CUDA, with gloo beside it under CPU offload all the same)."""
    chosen = backend_from_env(device_type == "cuda")
    return chosen if chosen == "gloo" else process_group_backend(device_type, cpu_offload)


_terminated = threading.Event()


def defer_sigterm() -> None:
    """SIGTERM (a preemption or time limit under SLURM) is remembered instead of ending this process: the trainer
    then saves at the next step boundary and exits 0, or, when it came during set-up, exits 0 before the first
    step with nothing new to save, so that a requeued job resumes either way. A run that saves checkpoints installs
    it as soon as its configuration is read."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: _terminated.set())


def sigterm_received() -> bool:
    """Whether this process got SIGTERM since ``defer_sigterm``."""
    return _terminated.is_set()


def forget_sigterm() -> None:
    """A new run in this process (the tests' harness runs one after another): no SIGTERM received yet."""
    _terminated.clear()


MAX_WORLD_SIZE = 2**20  # a sanity bound (the dry run simulates 16,384 ranks in seconds): beyond it, a typo


def world_size_from_env() -> int:
    """WORLD_SIZE (run_train.sh sets it from NGPU; torchrun sets it), default 1; a ValueError naming both when
    it is not a positive integer."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        world_size = int(text)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ValueError(f"NGPU (WORLD_SIZE): must be a positive number of processes, got {text!r}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"NGPU (WORLD_SIZE): at most {MAX_WORLD_SIZE:,} ranks, got {text!r}")
    return world_size


def init_distributed(cfg=None) -> World:
    """This process's world; joins the process group when there are several ranks. With ``cfg`` (a Config),
    its [comm] section sets the collective timeout until the first step ends and the NCCL flight recorder
    (writing into job.dump_folder/comm_traces, which the trainer makes once the run's checks have passed)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = world_size_from_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend_for(device.type, cfg is not None and cfg.parallelism.fsdp_cpu_offload)
    timeout = None
    if cfg is not None:
        timeout = timedelta(seconds=cfg.comm.init_timeout_seconds)
        set_flight_recorder_env(cfg.comm.trace_buf_size, cfg.job.dump_folder)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if "nccl" in backend else None, timeout=timeout)
    return World(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


@contextlib.contextmanager
def agree_on_user_errors():
    """Run set-up work whose user errors (ValueError) may differ between ranks (each reads its own data shard),
    then let every rank know: if any rank failed, every rank raises, the ranks that did not fail with the first
    failing rank's message prefixed by its rank. So every rank stops at the same point with exit status 2 and
    rank 0 prints the line, instead of the others waiting in a collective for a rank that is gone. Any other
    exception (an OSError, an internal error) is agreed on too: the failing rank raises its own (traceback),
    the others a RuntimeError naming that rank and the exception, rather than waiting for a timeout."""
    error: Optional[Exception] = None
    try:
        yield
    except Exception as e:  # told to the other ranks, then raised again below
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        told = None if error is None else (isinstance(error, ValueError), f"{type(error).__name__}: {error}",
                                           str(error))
        messages: list[Optional[tuple[bool, str, str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, told)
        failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
        if failed and error is None:
            rank, (user_error, described, message) = failed[0]
            if user_error:
                raise ValueError(f"[rank {rank}] {message}")
            raise RuntimeError(f"[rank {rank}] failed during set-up: {described}")
    if error is not None:
        raise error


_USER_ERROR_KEY = "tessera/user_error"


def _default_store():
    """The default process group's key-value store (torch's private ``_get_default_store``, called here only);
    None outside a process group."""
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def announce_user_error(message: str, status: int) -> None:
    """Tell the other ranks that this rank stops on a user error found mid-run (its data shard), before it
    leaves: a rank whose collective then fails because this one is gone reports this error (peer_user_error)
    instead of its own traceback."""
    store = _default_store()
    if store is not None and dist.get_world_size() > 1:
        import json

        store.set(_USER_ERROR_KEY, json.dumps({"rank": dist.get_rank(), "message": message, "status": status}))


def peer_user_error(wait_seconds: float = 1.0) -> Optional[dict]:
    """The user error another rank announced (``{"rank", "message", "status"}``), waiting up to ``wait_seconds``
    for it; None when none comes (this rank's failure is its own). A short wait: the announcing rank's key is
    stored before it leaves, so before any collective fails for its leaving."""
    store = _default_store()
    if store is None or dist.get_world_size() == 1:
        return None
    import json

    import time

    deadline = time.monotonic() + wait_seconds
    try:  # polled: a timed-out store.wait logs warnings, and most often none comes (a peer was killed)
        while not store.check([_USER_ERROR_KEY]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        return json.loads(store.get(_USER_ERROR_KEY))
    except Exception:  # the store is gone with the job
        return None


def set_flight_recorder_env(trace_buf_size: int, dump_folder: str, environ: Optional[dict] = None) -> None:
    """comm.trace_buf_size into the environment the NCCL flight recorder reads when the process group starts:
    ``trace_buf_size`` entries and a dump on a timeout, or 0: off (torch's own default keeps 2,000 entries).
    torch 2.11 and 2.13 read TORCH_FR_BUFFER_SIZE, then the older TORCH_NCCL_TRACE_BUFFER_SIZE (2.13 warns
    about it); a value the user set under either name wins, as do the user's dump variables."""
    environ = os.environ if environ is None else environ
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    if trace_buf_size > 0:
        environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", comm_trace_prefix(dump_folder))


def comm_trace_prefix(dump_folder: str) -> str:
    """Where the NCCL flight recorder writes on a timeout (rank_<R> files), inside the run's dump folder."""
    return os.path.join(os.path.abspath(dump_folder), "comm_traces", "rank_")


def _process_groups() -> list:
    """Every process group this rank belongs to: the default one, the mesh's dimensions and their
    flattenings, pipeline groups. torch lists them only in distributed_c10d's private state."""
    from torch.distributed import distributed_c10d as c10d

    return [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]


_timeout_now: Optional[float] = None  # what set_collective_timeout set last
_own_timeout_groups: list = []  # groups that keep the timeout they were created with


def set_collective_timeout(seconds: float) -> None:
    """Set the timeout of every collective on every process group of this rank (torch's private
    ``_set_pg_timeout``, called here only), but those of ``keep_own_timeout``."""
    global _timeout_now
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    _timeout_now = seconds
    groups = _process_groups()
    _own_timeout_groups[:] = [own for own in _own_timeout_groups if any(own is group for group in groups)]  # live
    for group in groups:
        if not any(group is own for own in _own_timeout_groups):
            c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def keep_own_timeout(group) -> None:
    """``group`` (a checkpoint writer's, whose collectives wait for file writes) keeps the timeout it was created
    with: set_collective_timeout leaves it alone."""
    if group is not None:
        _own_timeout_groups.append(group)


@contextlib.contextmanager
def longer_collective_timeout(seconds: float):
    """At least ``seconds`` for the collectives issued inside the block (a checkpoint's save and commit), then
    the timeout set before it again."""
    before = _timeout_now
    if not dist.is_initialized() or before is None or before >= seconds:
        yield
        return
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(before)


def collective_timeouts() -> list[float]:
    """The timeout, in seconds, that each process group of this rank applies now (none without a group)."""
    if not dist.is_initialized():
        return []
    return [group._get_backend(device).options._timeout.total_seconds()
            for group in _process_groups() for device in group._device_types]


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every generator; with ``deterministic``, allow only deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
