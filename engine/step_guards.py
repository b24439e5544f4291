"""What the training loop checks and tidies between steps: divergence (a nan or inf loss or gradient norm),
Python's garbage collection, and the CUDA caching allocator's free memory."""

from __future__ import annotations

import contextlib
import gc
import math

import torch


@contextlib.contextmanager
def scheduled_gc(every: int):
    """Python's automatic garbage collection off for the loop; ``collect(step)`` runs it (the young
    generations) every ``every`` steps, between steps. ``every`` 0: automatic collection for the loop (the
    entry point turns it off for set-up). Either way the collector is left as it was found."""
    was_enabled = gc.isenabled()

    def collect(step: int) -> None:
        if every and step % every == 0:
            gc.collect(1)

    if every:
        gc.disable()
        gc.collect()  # start clean: what set-up left behind
    else:
        gc.enable()
    try:
        yield collect
    finally:
        (gc.enable if was_enabled else gc.disable)()


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (CUDA: torch.cuda.empty_cache; with
    expandable segments every free page is unmapped). Nothing on CPU. The whole device is synchronized first:
    a block freed on one stream may still be read by work queued on another (FSDP2's all-gather and
    reduce-scatter streams, NCCL's own), and unmapping its pages under that work is an illegal memory access."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became nan or inf (every rank sees the same, so every rank raises it)."""


def check_finite(step: int, loss: float, grad_norm: float, nonfinite: float) -> None:
    """Raise TrainingDiverged unless ``loss`` (a window's mean) is finite and no step of the window had a nan or
    inf gradient norm (``nonfinite`` counts them): before a log, and before any save of the step."""
    if nonfinite or not math.isfinite(loss):
        what = ": nan or inf"
        if math.isfinite(loss) and math.isfinite(grad_norm):  # an earlier step of the window had the nan or inf
            what = f", nan or inf at {int(nonfinite)} earlier step{'s' if nonfinite > 1 else ''} of its window"
        raise TrainingDiverged(
            f"optimizer.lr: training diverged by step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g}{what}); "
            "this step is not saved. Restart from the last checkpoint with a lower optimizer.lr, more "
            "lr_scheduler.warmup_steps or a smaller training.max_norm"
        )
