"""Qwen3's parallel plan: Llama 3's (models/llama3/parallelize.py: TP with sequence and loss parallel -> CP ->
float8 -> activation checkpointing -> compile -> FSDP2/HSDP/DDP, and its pipeline split), with the QK-norms
added to the tensor-parallel plan.

Under TP each rank holds whole heads of q and k (wq/wk colwise), so the QK-norms, which act on one head at a time,
run on the local heads: they are sequence-parallel over the heads dimension (dimension 2 of ``[B, S, heads,
head_dim]``), their weights replicated on the TP mesh, the weights' gradients (partial sums over each rank's
heads) reduced as the other sequence-parallel norms' are. The QK-norm styles are applied first, then Llama's
plan, which does not touch them.

What the family runs on (engine/config/validation.py refuses the rest before anything is built):
- dense and untied (debugmodel, 8B, 14B, 32B): every layout Llama 3 runs on (FSDP/HSDP/DDP, TP, CP, PP, float8, AC,
  compile);
- tied embeddings (0.6B, 1.7B, 4B): every layout; under TP the embedding and the output share one weight sharded
  on the vocabulary; under PP the last stage holds a copy, kept equal (parallelize/pipeline_parallel.py);
- MoE blocks (30B-A3B, 235B-A22B, debugmodel_moe): every layout, expert parallelism (parallelism.ep) included; under
  TP the MoE layers run on each rank's sequence shard and are sharded by FSDP, so TP needs data parallelism.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from models.llama3.parallelize import parallelize_llama, pipeline_stage
from parallelize.mesh import ParallelDims
from parallelize.tensor_parallel import apply_tp

__all__ = ["parallelize_qwen3", "pipeline_stage", "tp_plan_qk_norm"]


def tp_plan_qk_norm() -> dict:
    """The TP styles of a block's QK-norms: over the local heads (dimension 2), plain tensors in and out."""
    return {f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for norm in ("q_norm", "k_norm")}


def parallelize_qwen3(model: nn.Module, dims: ParallelDims, cfg: Any, device_type: str) -> nn.Module:
    """Apply the plan for ``dims`` and ``cfg`` to ``model`` (on the meta device) in place; returns it."""
    if dims.tp_enabled:
        tp_mesh = dims.mesh("tp")
        for block in model.layers.values():
            if block.attention.q_norm is not None:
                apply_tp(block, tp_mesh, tp_plan_qk_norm())
    return parallelize_llama(model, dims, cfg, device_type)
