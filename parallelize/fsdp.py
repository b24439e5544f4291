"""Data parallelism with FSDP2: FSDP (sharded), HSDP (replicated groups of shards) and DDP.

One mechanism serves all three: ``fully_shard`` over the ``fsdp`` view of the mesh, which is 1-D
(dp_shard) for FSDP and 2-D (dp_replicate, dp_shard) for HSDP. DDP is the 2-D case with a shard degree of
1: parameters stay whole on every rank and gradients are all-reduced over dp_replicate, and, because it
is built on DTensor like the rest, it composes with tensor parallelism (torch's DDP and its composable
``replicate`` do not).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def mixed_precision_policy(param_dtype: str, reduce_dtype: str, device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on CUDA (as configured); fp32 throughout on CPU."""
    if device_type != "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pipelined: bool = False,
    units: tuple[tuple[nn.Module, object], ...] = (),
) -> None:
    """``fully_shard`` each of ``units`` over its own mesh, then each block, then the root (which takes the
    parameters no block holds).

    ``units``: (module, mesh) pairs inside the blocks that are sharded over another mesh than ``mesh``: a MoE
    layer's experts (over the ranks holding the same experts, sharded on the expert dimension or, when a rank holds
    fewer experts than that mesh has ranks, on the next one) and, under TP, its router and shared experts (over
    every rank holding other tokens). Their gradients are divided by ``mesh``'s size, as the blocks' are.

    FSDP2 averages gradients over the mesh (it divides their sum by the mesh size); the caller scales
    its loss accordingly (``gradient_divide_factor``).

    ``reshard_after_forward``: "always" frees every block's gathered parameters after its forward;
    "never" keeps them until backward (no second all-gather, more memory); "default" frees all but the
    last block's, whose parameters backward needs first, and the root's. With ``pipelined`` (a pipeline
    stage) "default" frees none: torch's pipeline keeps a stage's parameters gathered from its first
    backward to the end of the step anyway (set_reshard_after_backward(False) until the last microbatch), so
    freeing them after each microbatch's forward would only gather them again, twice per microbatch.
    """
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    # The root casts the model's floating-point inputs to param_dtype; a block's come from the blocks before it
    # (in param_dtype already) and the model's buffers: the fp32 RoPE table, which must stay fp32 (cosines and
    # sines rounded to bf16 no longer rotate without stretching).
    block_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for unit, unit_mesh in units:
        shard_ranks = unit_mesh.size(unit_mesh.ndim - 1)
        fully_shard(unit, mesh=unit_mesh, mp_policy=block_policy, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward == "always" or (reshard_after_forward == "default"
                                                                                and not pipelined),
                    shard_placement_fn=lambda p, n=shard_ranks: Shard(1) if p.ndim > 1 and _rows(p) < n else None)
        unit.set_gradient_divide_factor(gradient_divide_factor(mesh))
        # Over more than one shard: a sum, then a division (the pre-multiplied sum FSDP2 would use for a factor other
        # than the unit's mesh size is missing in gloo). Not over one: there FSDP2 divides as it copies, and a
        # forced sum would divide once more (torch 2.13).
        unit.set_force_sum_reduction_for_comms(shard_ranks > 1)
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            reshard = i < len(blocks) - 1 and not pipelined
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, mesh=mesh, mp_policy=block_policy, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        reshard_after_forward=reshard_after_forward == "always",
    )


def resharded_after_forward(module: FSDPModule) -> Optional[bool]:
    """Whether FSDP2 frees ``module``'s gathered parameters after its forward; None if this torch keeps it where
    this does not look. torch has a setter (set_reshard_after_forward) and no getter, so this reads FSDP2's own
    state: its parameter groups (one attribute in torch 2.11, a list in later releases)."""
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [state._fsdp_param_group] if g is not None]
        return any(g.post_forward_mesh_info is not None for g in groups)
    except AttributeError:
        return None


def _rows(param) -> int:
    """The first dimension of this rank's part of ``param`` (the local experts of an expert-parallel weight)."""
    return (param.to_local() if isinstance(param, DTensor) else param).shape[0]


def set_replica_all_reduce(parts: list[nn.Module], enabled: bool) -> None:
    """Whether the next backward all-reduces gradients over dp_replicate (HSDP, DDP). Off for all but the last
    of a step's gradient-accumulation microbatches: each backward still reduce-scatters over the shard group
    (gradients stay sharded, no memory is added) and FSDP sums the partial results, which the last backward
    all-reduces once. So the replicas, often on other nodes, exchange the gradients once per optimizer step
    rather than once per microbatch, with the same result. Without dp_replicate this changes nothing."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_all_reduce(enabled)


def gradient_divide_factor(mesh) -> int:
    """What FSDP2 divides the summed gradients by: the number of ranks in its mesh."""
    return mesh.size()
