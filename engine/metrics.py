"""Training metrics: throughput, TFLOP/s, MFU and peak memory, written to the console, a JSONL file,
tensorboard and Weights & Biases.

The trainer calls ``MetricsLogger.log`` every ``metrics.log_freq`` steps with the global token count and the
training time since the previous call (wall time less validation and checkpoint saves, which print their own
timings; the first step of a run, compile and warm-up included, is logged on its own); the logger derives the
rates, prints one line on rank 0, appends one JSON object to ``<dump_folder>/metrics.jsonl`` and forwards the
numbers to the enabled sinks. Each validation is recorded at its own step by ``MetricsLogger.log_validation``:
in metrics.jsonl a record of its own, ``{"step", "validation_loss", "validation_s", "time"}`` (no ``loss``
key: engine.plot.is_validation_record), written after the training record of the same step.

Definitions (per logging window):

* ``tps``         tokens processed by all ranks / elapsed seconds
* ``tps_per_gpu`` ``tps / world_size``
* ``tflops``      achieved model TFLOP/s of one device: ``num_flops_per_token * tps_per_gpu / 1e12``
* ``mfu``         ``100 * tflops * 1e12 / peak_flops`` (percent), ``None`` where the peak is unknown
* ``memory_gib``  CUDA: peak active bytes since the previous log; CPU: peak RSS of the process (lifetime)
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import string
import sys
import time
from typing import Any, Optional

import torch

from engine.config import ConfigError
from engine.distributed import log_ranks

GIB = 1024**3

# --------------------------------------------------------------------------------------------------------
# Peak FLOP/s
# --------------------------------------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peak FLOP/s per device: (bf16, fp8). fp8 None = no fp8 tensor cores.
# Matched against torch.cuda.get_device_name() upper-cased, first match wins (specific names first).
_PEAK_FLOPS: list[tuple[tuple[str, ...], float, Optional[float]]] = [
    (("H100", "NVL"), 835e12, 1671e12),
    (("H100", "PCIE"), 756e12, 1513e12),
    (("H100",), 989e12, 1979e12),  # SXM5 / HBM3 (e.g. "NVIDIA H100 80GB HBM3")
    (("H200",), 989e12, 1979e12),  # also GH200
    (("A100",), 312e12, None),
    (("L40S",), 362e12, 733e12),
    (("B200",), 2250e12, 4500e12),
]


def peak_flops_for_name(name: str, fp8: bool = False) -> Optional[float]:
    """Peak dense FLOP/s for a CUDA device name, or None when the name is not in the table.

    With ``fp8=True`` the fp8 peak is returned; a device without fp8 tensor cores (A100) gives its bf16 peak,
    since fp8 matmuls cannot run there natively.
    """
    upper = name.upper()
    for keys, bf16, f8 in _PEAK_FLOPS:
        if all(k in upper for k in keys):
            return f8 if (fp8 and f8 is not None) else bf16
    return None


def peak_flops_per_device(device: torch.device, fp8: bool = False, override: float = -1) -> Optional[float]:
    """Peak FLOP/s of one device for MFU.

    ``override > 0`` wins on any device (metrics.peak_flops). Otherwise CUDA devices are looked up in the
    table by name; CPU, other device types and unknown GPUs give None (MFU is then reported as n/a).
    """
    if override is not None and override > 0:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), fp8=fp8)


# --------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------


def _cpu_total_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def device_memory(device: torch.device) -> dict:
    """Peak memory of this process on ``device``.

    Returns ``memory_gib`` and ``memory_pct`` (CUDA: peak active bytes since the last reset; CPU: peak RSS of
    the process), ``memory_reserved_gib`` and ``memory_reserved_pct`` (CUDA: peak reserved by the caching
    allocator; None on CPU) and ``total_gib`` (the device's memory, or the machine's RAM on CPU).
    Percentages are of ``total_gib``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        active = stats.get("active_bytes.all.peak", torch.cuda.max_memory_allocated(device))
        reserved = stats.get("reserved_bytes.all.peak", torch.cuda.max_memory_reserved(device))
        total = torch.cuda.get_device_properties(device).total_memory
        return {
            "memory_gib": active / GIB,
            "memory_pct": 100.0 * active / total,
            "memory_reserved_gib": reserved / GIB,
            "memory_reserved_pct": 100.0 * reserved / total,
            "total_gib": total / GIB,
        }
    rss = _peak_rss_bytes()
    total = _cpu_total_bytes()
    return {
        "memory_gib": rss / GIB,
        "memory_pct": 100.0 * rss / total if total else None,
        "memory_reserved_gib": None,
        "memory_reserved_pct": None,
        "total_gib": total / GIB if total else None,
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window. CUDA: resets the allocator's peak stats. CPU: no-op (the peak RSS
    from getrusage cannot be reset, so it stays the process's lifetime peak)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------------------------------------
# Logger
# --------------------------------------------------------------------------------------------------------


def _to_builtin(value: Any) -> Any:
    """Make tensors and numpy scalars JSON/tensorboard friendly."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (TypeError, ValueError):
            return value
    return value


def _json_default(value: Any) -> Any:
    converted = _to_builtin(value)
    if converted is value:
        return str(value)
    return converted


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{spec}}{suffix}"


_RANK_METRICS = re.compile(r"metrics_rank\d+\.jsonl")
WANDB_RUN_ID_FILE = "wandb_run_id"
"""The run folder's wandb run id (one line): a resumed run goes on in the same wandb run."""


def set_aside_old_metrics(folder: str) -> None:
    """A fresh run starts fresh metrics: an earlier run's metrics.jsonl, metrics_rank<N>.jsonl files, tb/ folder
    and resolved config.toml (which the new run then writes) are kept as metrics.<n>.jsonl,
    metrics_rank<N>.<n>.jsonl, tb.<n> and config.<n>.toml, with one n for all of them (the first that names none
    of them yet)."""
    names = ["metrics.jsonl", *sorted(n for n in os.listdir(folder) if _RANK_METRICS.fullmatch(n)), "tb",
             "config.toml"]
    names = [n for n in names if os.path.exists(os.path.join(folder, n))]
    if not names:
        return

    def aside(name: str, n: int) -> str:
        stem, dot, ext = name.partition(".")
        return os.path.join(folder, f"{stem}.{n}{dot}{ext}")

    n = 1
    while any(os.path.exists(aside(name, n)) for name in names):
        n += 1
    for name in names:
        os.replace(os.path.join(folder, name), aside(name, n))


def last_logged_step(path: str) -> int:
    """The step of the last whole record of a metrics JSONL file (0: no file, or no record with a step)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:  # back a block at a time until a whole record with a step is found
            start = max(0, end - 65536)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            for line in reversed(lines if start == 0 else lines[1:]):  # lines[0] may be cut at the block's start
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    return record["step"]
            tail = lines[0]
    return 0


def _new_wandb_run_id() -> str:
    """A wandb-style run id: 8 lower-case letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def end_torn_record(path: str) -> int:
    """Make a metrics file that a run is about to append to end with a whole line. A last line without its
    newline is a record whose write was cut short (a crash, a full disk): the next record would glue onto it and
    make both unreadable. A tail that is still a whole JSON object only lacks the newline, which is added;
    anything else is cut off. Returns the number of bytes cut off (0: nothing lost; also for a missing file)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        start = size
        while start > 0:  # back to the last newline, a block at a time
            block_start = max(0, start - 65536)
            f.seek(block_start)
            newline = f.read(start - block_start).rfind(b"\n")
            if newline >= 0:
                start = block_start + newline + 1
                break
            start = block_start
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            whole = False
        if whole:
            f.write(b"\n")
            return 0
        f.truncate(start)
    return size - start


class MetricsLogger:
    """Console + JSONL + tensorboard + wandb metrics for one rank.

    Rank 0 prints and writes ``<dump_folder>/metrics.jsonl``, ``<dump_folder>/tb`` (tensorboard) and the wandb
    run (``<dump_folder>/wandb``). With ``metrics.save_for_all_ranks`` every rank N also writes
    ``metrics_rank<N>.jsonl`` (rank 0 included, next to metrics.jsonl) and ranks > 0 write tensorboard events
    to ``<dump_folder>/tb/rank_<N>``; wandb stays on rank 0 (one run per job). Other ranks create no files.
    ``fresh``: a new run (not resumed), whose metrics start empty: rank 0 sets the earlier run's metrics.jsonl,
    metrics_rank<N>.jsonl, tb/ and config.toml aside (set_aside_old_metrics). A resumed run's JSONL files go on
    after their last whole record (end_torn_record), and its tensorboard hides the events of steps from
    ``first_step`` (the first step this run trains) on that earlier runs wrote (SummaryWriter's purge_step: an
    abandoned continuation after a rollback). The JSONL files and event files are opened at the first record, so
    that another rank's never open before rank 0 has set the old ones aside (the trainer's ranks agree on their
    set-up in between). The wandb run's id is kept in ``<dump_folder>/wandb_run_id``: new on a fresh run, the
    same wandb run resumed on a resumed one (rewound to ``first_step - 1`` with metrics.wandb_rewind when it has
    steps from ``first_step`` on, which wandb would otherwise drop: a warning names them). A sink that cannot
    start (wandb without a login) is a ConfigError raised before any file is written.
    """

    def __init__(
        self,
        cfg,
        rank: int,
        world_size: int,
        num_flops_per_token: int,
        device: torch.device,
        fresh: bool = False,
        first_step: int = 1,
    ):
        self.cfg = cfg
        self.rank = rank
        self.world_size = max(1, int(world_size))
        self.num_flops_per_token = num_flops_per_token
        self.device = torch.device(device)
        # The bf16 peak also for float8 runs, as torchtitan reports MFU (metrics.peak_flops overrides it).
        self.peak_flops = peak_flops_per_device(self.device, override=cfg.metrics.peak_flops)
        self.dump_folder = cfg.job.dump_folder
        self.step_width = max(1, len(str(getattr(getattr(cfg, "training", None), "steps", 1))))
        self.fresh = fresh
        self.first_step = int(first_step)

        m = cfg.metrics
        self.is_main = rank == 0
        self.writes_files = self.is_main or m.save_for_all_ranks
        self._files: list = []
        self._opened = False
        self.jsonl_paths: list[str] = []
        self._tb = None
        self._wandb_run = None
        self._closed = False

        if not self.writes_files:
            return
        if m.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ConfigError(
                    f"metrics.enable_tensorboard: tensorboard is not importable ({e}); pip install tensorboard"
                ) from None
        created = not os.path.exists(self.dump_folder)
        os.makedirs(self.dump_folder, exist_ok=True)
        try:  # first the sink that can fail on the user's set-up (no login), while nothing is written yet
            self._start_wandb(cfg)
        except ConfigError:
            if created:
                try:
                    os.rmdir(self.dump_folder)  # still empty: wandb writes nothing when it cannot start
                except OSError:
                    pass
            raise

        names = []
        if self.is_main:
            names.append("metrics.jsonl")
            if fresh:
                set_aside_old_metrics(self.dump_folder)
        if m.save_for_all_ranks:
            names.append(f"metrics_rank{rank}.jsonl")
        self.jsonl_paths = [os.path.join(self.dump_folder, n) for n in names]

    def _start_wandb(self, cfg) -> None:
        m = cfg.metrics
        mode = m.wandb_mode if m.wandb_mode != "auto" else os.environ.get("WANDB_MODE", "").strip()
        if not (m.enable_wandb and self.is_main and mode != "disabled"):
            return
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError(f"metrics.enable_wandb: wandb is not importable ({e}); pip install wandb") from None
        id_path = os.path.join(self.dump_folder, WANDB_RUN_ID_FILE)
        run_id = None
        if not self.fresh and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        # A resumed wandb run that already has steps from first_step on (a crash after the last checkpoint): wandb
        # drops every step at or below its last one, unless the run is rewound to the checkpoint's step.
        logged = last_logged_step(os.path.join(self.dump_folder, "metrics.jsonl")) if run_id else 0
        rewind = m.wandb_rewind and logged >= self.first_step
        run_id = run_id or _new_wandb_run_id()
        # resume="allow": a resumed run goes on in the same wandb run; a new id starts one.
        resume = ({"resume_from": f"{run_id}?_step={self.first_step - 1}"} if rewind
                  else {"id": run_id, "resume": "allow"})
        try:
            self._wandb_run = wandb.init(
                project=m.wandb_project,
                dir=self.dump_folder,  # wandb writes under <dump_folder>/wandb
                mode=m.wandb_mode if m.wandb_mode != "auto" else None,  # None: wandb's own (WANDB_MODE), else online
                config=cfg.to_dict(),
                **resume,
            )
        except Exception as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            field = "metrics.wandb_rewind" if rewind else "metrics.enable_wandb"
            fix = ("set metrics.wandb_rewind = false (W&B's rewind is a preview feature your account may lack)"
                   if rewind else "run `wandb login`, or set metrics.wandb_mode = offline")
            raise ConfigError(f"{field}: wandb.init failed ({reason}); {fix}") from None
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
        if rewind:
            return
        logged = max(logged, int(getattr(self._wandb_run, "starting_step", 0) or 0) - 1)  # online: wandb's own
        if logged >= self.first_step:
            print(f"metrics: warning: wandb run {run_id} already has steps up to {logged}, and this run resumes at "
                  f"step {self.first_step}: wandb drops steps {self.first_step} to {logged} of this run (they are in "
                  "metrics.jsonl and tensorboard); metrics.wandb_rewind = true rewinds the wandb run instead",
                  flush=True)

    def _open(self) -> None:
        """Open the JSONL files and the tensorboard writer (once, at the first record)."""
        if self._opened or self._closed or not self.writes_files:
            return
        self._opened = True
        for path in self.jsonl_paths:
            cut = end_torn_record(path)
            if cut:
                print(f"metrics: {path} ended in an unfinished record (a write cut short by a crash or a full disk); "
                      f"cut off its {cut} bytes, appending after the last whole record", flush=True)
        # Append mode: a resumed run continues the same file (engine.plot reads its segments).
        self._files = [open(p, "a", encoding="utf-8") for p in self.jsonl_paths]
        if self.cfg.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = os.path.join(self.dump_folder, "tb")
            if not self.is_main:
                tb_dir = os.path.join(tb_dir, f"rank_{self.rank}")
            # A resumed run: tensorboard hides the steps from first_step on that an earlier run logged.
            self._tb = SummaryWriter(log_dir=tb_dir, purge_step=None if self.fresh else self.first_step)

    def _write(self, record: dict) -> None:
        """Append ``record`` to the JSONL files and its numbers (but step and time) to tensorboard and wandb."""
        self._open()
        if self._files:
            line = json.dumps(record, default=_json_default) + "\n"
            for f in self._files:
                f.write(line)
                f.flush()
        scalars = {k: v for k, v in record.items() if k not in ("step", "time") and _is_number(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, global_step=record["step"])
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=record["step"])

    # ----------------------------------------------------------------------------------------------------

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        elapsed: float,
        data_wait: float,
        extra: Optional[dict] = None,
    ) -> dict:
        """Compute the window's rates, emit them to every enabled sink and return the logged record.

        ``loss``: the mean training loss over the steps since the previous call; ``grad_norm``: the last
        step's total gradient norm; ``tokens``: tokens processed by all ranks since the previous call; ``elapsed``: wall seconds since the
        previous call; ``data_wait``: seconds of ``elapsed`` spent waiting for data. Rates are None when
        ``elapsed <= 0``. Resets the CUDA peak-memory window afterwards.
        """
        loss = float(_to_builtin(loss))
        grad_norm = float(_to_builtin(grad_norm))
        lr = float(_to_builtin(lr))
        tokens = int(_to_builtin(tokens))
        elapsed = float(elapsed)
        data_wait = float(data_wait)

        if elapsed > 0:
            tps = tokens / elapsed
            tps_per_gpu = tps / self.world_size
            tflops = self.num_flops_per_token * tps_per_gpu / 1e12
            mfu = 100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops else None
            data_wait_pct = 100.0 * data_wait / elapsed
        else:
            tps = tps_per_gpu = tflops = mfu = data_wait_pct = None

        mem = device_memory(self.device)
        reset_peak_memory(self.device)

        record: dict[str, Any] = {
            "step": int(step),
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "tps": tps,
            "tps_per_gpu": tps_per_gpu,
            "tflops": tflops,
            "mfu": mfu,
            "memory_gib": mem["memory_gib"],
            "memory_pct": mem["memory_pct"],
            "memory_reserved_gib": mem["memory_reserved_gib"],
            "memory_reserved_pct": mem["memory_reserved_pct"],
            "data_wait_s": data_wait,
            "data_wait_pct": data_wait_pct,
            "elapsed_s": elapsed,
            "time": time.time(),
        }
        if extra:
            record.update({str(k): _to_builtin(v) for k, v in extra.items()})

        if self.rank in log_ranks():
            print(self.format_line(record), flush=True)
        self._write(record)
        return record

    def log_validation(self, step: int, loss: float, seconds: float) -> dict:
        """Record the validation loss of ``step`` at that step, whether or not the step is a log step: one line
        on the console, a record of its own in the JSONL files (step, validation_loss, validation_s: the seconds
        it took, time) and validation_loss / validation_s at ``step`` in tensorboard and wandb. Call it after
        ``log`` of the same step, so that the files keep their records in step order. Returns the record."""
        record = {"step": int(step), "validation_loss": float(_to_builtin(loss)), "validation_s": float(seconds),
                  "time": time.time()}
        if self.rank in log_ranks():
            print(f"validation: step {record['step']}  loss: {record['validation_loss']:.4f}", flush=True)
        self._write(record)
        return record

    def format_line(self, r: dict) -> str:
        """The one-line, colour-free console summary of a record."""
        mem = f"{r['memory_gib']:.2f}GiB" if r.get("memory_gib") is not None else "n/a"
        if r.get("memory_pct") is not None:
            mem += f" ({r['memory_pct']:.1f}%)"
        if r.get("memory_reserved_gib") is not None:  # CUDA: the caching allocator's peak reserved
            mem += f", reserved {r['memory_reserved_gib']:.2f}GiB"
            if r.get("memory_reserved_pct") is not None:
                mem += f" ({r['memory_reserved_pct']:.1f}%)"
        tps = r.get("tps")
        tps_gpu = r.get("tps_per_gpu")
        parts = [
            f"step: {r['step']:>{self.step_width}d}",
            f"loss: {r['loss']:7.4f}",
            f"grad_norm: {r['grad_norm']:6.2f}",
            f"lr: {r['lr']:.1e}",
            f"tps: {_fmt(None if tps is None else round(tps), ',d'):>9}",
            f"tps/gpu: {_fmt(None if tps_gpu is None else round(tps_gpu), ',d'):>9}",
            f"tflops: {_fmt(r.get('tflops'), '.2f'):>7}",
            f"mfu: {_fmt(r.get('mfu'), '.1f', '%'):>5}",
            f"memory: {mem}",
            f"data_wait: {_fmt(r.get('data_wait_pct'), '.1f', '%')}",
        ]
        if r.get("expert_load_max") is not None:  # a MoE model: the busiest expert over the mean, worst layer
            parts.append(f"expert_load: {r['expert_load_max']:.2f}")
        if r.get("moe_aux_loss") is not None:
            parts.append(f"aux_loss: {r['moe_aux_loss']:.4f}")
        return "  ".join(parts)

    # ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for f in self._files:
            f.close()
        self._files = []
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
