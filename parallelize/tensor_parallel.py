"""Tensor parallelism: applying a model's plan of parallel styles, loss parallel, async TP.

A model's own ``parallelize.py`` states which module gets which style (colwise and rowwise projections,
sequence-parallel norms, vocabulary-parallel embedding, loss-parallel output); this module applies such a
plan and holds the pieces around it that are the same for every model.
"""

from __future__ import annotations

import contextlib
import warnings

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from models.loss import linear_cross_entropy_sum
from parallelize.compile import set_inductor_option


def apply_tp(module: nn.Module, tp_mesh, plan: dict[str, ParallelStyle]) -> None:
    """Apply ``plan`` (module path -> style) to ``module`` over the 1-D ``tp_mesh``."""
    parallelize_module(module, tp_mesh, plan)


def loss_context(enabled: bool):
    """The context the loss and its backward run in: loss parallel over vocabulary-sharded logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def vocab_parallel_linear_cross_entropy_sum(h: DTensor, weight: DTensor, labels: Tensor, chunk: int) -> Tensor:
    """The output projection fused with the loss (models/loss.py) under TP: ``weight`` is the colwise output
    projection (its vocabulary rows sharded over the 1-D TP mesh), ``h`` the final norm's sequence-parallel
    output. ``h`` is all-gathered over the sequence; each rank computes the logits of its vocabulary rows,
    chunk by chunk, with the log-sum-exp reduced over TP, so that neither the whole logits nor a vocabulary
    shard of them exist. ``h``'s gradient is this rank's part of a sum, which the all-gather's backward
    reduce-scatters back to sequence shards. Returns the loss sum (a plain tensor, the same on every rank)."""
    mesh = weight.device_mesh
    assert isinstance(weight, DTensor) and mesh.ndim == 1 and weight.placements == (Shard(0),), weight
    assert isinstance(h, DTensor) and h.device_mesh == mesh, type(h)
    h_full = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    w = weight.to_local()
    vocab, rank = weight.shape[0], mesh.get_local_rank()
    rows = -(-vocab // mesh.size())  # Shard(0) splits as torch.chunk does
    offset = min(rank * rows, vocab)
    assert w.shape[0] == min(rows, vocab - offset) > 0, (w.shape, vocab, rank)
    return linear_cross_entropy_sum(h_full, w, labels, chunk, vocab_offset=offset, group=mesh.get_group())


def reduce_partial_grads(parameters) -> None:
    """Without FSDP, the parameters TP replicates (the sequence-parallel norms' weights) get gradients that are
    Partial DTensors: sums still spread over the TP ranks. Every DTensor op that reads one reduces it again,
    so gradient clipping and AdamW would make about four all-reduces per norm weight and step. Reduce them here
    once, all of a mesh in one all-reduce, and mark them Replicate. (FSDP's reduce-scatter already resolves
    them.)"""
    import torch
    import torch.distributed as dist

    groups: dict = {}
    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((g.device_mesh, g.placements, g.dtype), []).append(p)
    for (mesh, placements, _), params in groups.items():
        local = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                assert placement.reduce_op == "sum", placement
                dist.all_reduce(flat, group=mesh.get_group(dim))
        reduced = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
        for p, t, part in zip(params, local, flat.split([t.numel() for t in local])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, reduced, run_check=False, shape=p.grad.shape,
                                        stride=p.grad.stride())


def to_local_scalar(t):
    """A loss that loss parallel returns as a replicated DTensor, as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def enable_async_tp(tp_mesh) -> None:
    """Let the compiler overlap TP collectives with matmuls (symmetric-memory micro-pipelining, CUDA)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    set_inductor_option("_micro_pipeline_tp", True)
    with warnings.catch_warnings():  # needed on torch 2.11; newer torch deprecates it as a no-op
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
