"""Tensor parallelism: applying a model's plan of parallel styles, loss parallel, async TP.

A model's own ``parallelize.py`` states which module gets which style (colwise and rowwise projections,
sequence-parallel norms, vocabulary-parallel embedding, loss-parallel output); this module applies such a
plan and holds the pieces around it that are the same for every model.
"""

from __future__ import annotations

import contextlib
import warnings

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module


def apply_tp(module: nn.Module, tp_mesh, plan: dict[str, ParallelStyle]) -> None:
    """Apply ``plan`` (module path -> style) to ``module`` over the 1-D ``tp_mesh``."""
    parallelize_module(module, tp_mesh, plan)


def loss_context(enabled: bool):
    """The context the loss and its backward run in: loss parallel over vocabulary-sharded logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def to_local_scalar(t):
    """A loss that loss parallel returns as a replicated DTensor, as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def enable_async_tp(tp_mesh) -> None:
    """Let the compiler overlap TP collectives with matmuls (symmetric-memory micro-pipelining, CUDA)."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # needed on torch 2.11; newer torch deprecates it as a no-op
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
