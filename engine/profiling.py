"""Profiling of training steps (the [profiling] section): torch.profiler traces and CUDA memory snapshots.

The trainer enters one ``StepProfiler`` around its loop and calls ``step(n)`` after each training step n.

- Traces (profiling.enable_profiling): the profiler is off for most steps; before every multiple of
  profile_freq it warms up for profiler_warmup steps, then records profiler_active steps, the last of which is
  the multiple. Each rank writes its window as a Chrome trace to
  <dump_folder>/<save_traces_folder>/iteration_<step>/rank<R>_trace.json. The windows follow the step count,
  so a resumed run traces the same steps an uninterrupted one would.
- Memory snapshots (profiling.enable_memory_snapshot, CUDA): the caching allocator records the Python stack of
  every allocation from the start; every profile_freq steps, and on an out-of-memory error, each rank writes its
  history to <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>[_oom]/rank<R>_memory_snapshot.pickle
  for pytorch.org/memory_viz. torch has this recorder only as private functions of torch.cuda.memory; they
  are called here and nowhere else.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

MEMORY_SNAPSHOT_ENTRIES = 100_000
"""Allocation events the allocator keeps for a snapshot (the newest ones)."""


@contextlib.contextmanager
def _one_trace_per_window():
    """torch warns that each profiling cycle starts afresh: one trace per window is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        yield


def _folder(dump_folder: str, name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(dump_folder, name)


class StepProfiler:
    """Traces and memory snapshots of a run's steps; a no-op when both are off."""

    def __init__(self, cfg, rank: int, start_step: int, device: torch.device):
        p = cfg.profiling
        self.rank = rank
        self.freq, self.warmup, self.active = p.profile_freq, p.profiler_warmup, p.profiler_active
        self.start_step = start_step
        self.step_done = start_step
        self.trace_folder = _folder(cfg.job.dump_folder, p.save_traces_folder) if p.enable_profiling else None
        self.snapshot_folder = (_folder(cfg.job.dump_folder, p.save_memory_snapshot_folder)
                                if p.enable_memory_snapshot else None)
        assert self.snapshot_folder is None or device.type == "cuda", "validate() refuses snapshots without CUDA"
        self.device = device
        self._profiler: Optional[profile] = None
        self._closing = False

    def _window_has_steps(self) -> bool:
        """Whether a finished training step was recorded in the window open now (the run ending mid-window):
        the step after the last one done records, and so did the last one, without closing its own window."""
        n = self.step_done - self.start_step  # the profiler's index of the step that would come next
        recording = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        return n > 0 and self._action(n) in recording and self._action(n - 1) == ProfilerAction.RECORD

    # The profiler's own step count n starts at 0 on entering: step n is training step start_step + 1 + n.
    def _action(self, n: int) -> ProfilerAction:
        into = (self.start_step + n) % self.freq + 1  # 1 .. freq within the current window
        if into == self.freq:
            return ProfilerAction.RECORD_AND_SAVE
        if into > self.freq - self.active:
            return ProfilerAction.RECORD
        if into > self.freq - self.active - self.warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _save_trace(self, prof: profile) -> None:
        if self._closing and not self._window_has_steps():
            return  # torch stopping mid-window: it recorded the shutdown only, no training step
        folder = os.path.join(self.trace_folder, f"iteration_{self.step_done}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))

    def __enter__(self) -> "StepProfiler":
        if self.trace_folder is not None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profiler = profile(activities=activities, schedule=self._action, on_trace_ready=self._save_trace,
                                     record_shapes=True, with_stack=False)
            with _one_trace_per_window():
                self._profiler.__enter__()
        if self.snapshot_folder is not None:
            # Python frames only: C++ frames are symbolized when a snapshot is written, which can take minutes.
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_ENTRIES, stacks="python")
        return self

    def step(self, step: int) -> None:
        """Training step ``step`` has finished."""
        assert step == self.step_done + 1, (step, self.step_done)
        self.step_done = step
        if self._profiler is not None:
            with _one_trace_per_window():
                self._profiler.step()
        if self.snapshot_folder is not None and step % self.freq == 0:
            self.dump_memory_snapshot(f"iteration_{step}")

    def dump_memory_snapshot(self, name: str) -> Optional[str]:
        """Write the allocator history recorded so far (CUDA, when enabled); returns the file."""
        if self.snapshot_folder is None:
            return None
        folder = os.path.join(self.snapshot_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        return path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
            path = self.dump_memory_snapshot(f"iteration_{self.step_done + 1}_oom")
            if path:
                print(f"out of memory: allocator history written to {path}", flush=True)
        if self._profiler is not None:
            self._closing = True  # a window cut short by the run's end is saved only if it holds a step
            self._profiler.__exit__(exc_type, exc, tb)
            self._profiler = None
        if self.snapshot_folder is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
