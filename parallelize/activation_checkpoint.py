"""Activation checkpointing: none, full, every N-th block, or per-op selective.

Blocks are wrapped with torch's ``checkpoint_wrapper`` (non-reentrant), whose state-dict hooks keep the
parameter names unchanged, so checkpoints do not depend on the AC setting. Per-op selective AC saves the
outputs of the matmuls (all, or every other one: activation_checkpoint.op_matmuls; a MoE layer's grouped
expert GEMMs), of attention (under context parallelism the ring's output and log-sum-exp, not its partial
results), of the tensor-parallel reduce-scatters and of expert parallelism's all-to-alls (expensive to
recompute) and recomputes everything else (norms, activations, RoPE, elementwise ops) in backward.
"""

from __future__ import annotations

import contextlib
from functools import cache, partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

import parallelize.context_parallel  # noqa: F401  (registers the tessera::ring_attention operator named below)
from models.moe import recomputing  # (and the tessera::grouped_mm_loop operator named below)


@cache
def _save_list() -> frozenset:
    ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten._scaled_mm.default,  # float8 matmuls (torchao)
        torch.ops.aten.max.default,  # float8 tensorwise scales: the amax of each input (a whole-tensor reduction)
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,  # model.attn = flex (document masking)
        torch.ops.tessera.ring_attention.default,  # context parallelism: the whole ring, one operator
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # MoE experts: the grouped GEMMs' exact fallback and expert parallelism's token all-to-alls
        torch.ops.tessera.grouped_mm_loop.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    }
    try:  # the grouped GEMM itself, where this torch has it
        ops.add(torch.ops.aten._grouped_mm.default)
    except (AttributeError, RuntimeError):
        pass
    try:  # model.attn = flash_attn on FlashAttention 4: models/attention.py's operator, registered once the model
        ops.add(torch.ops.tessera.flash_attn.default)  # module is imported (before any AC is applied)
    except (AttributeError, RuntimeError):
        pass
    try:  # FlashAttention 2 registers its kernels as torch ops (flash-attn >= 2.7) when imported, which
        import flash_attn  # noqa: F401  models/attention.py does only at its first call
        ops.add(torch.ops.flash_attn._flash_attn_forward.default)
    except (ImportError, AttributeError, RuntimeError):
        pass
    return frozenset(ops)


# FSDP2 units inside a checkpointed block (a MoE layer's experts under expert parallelism, the MoE layer under TP)
# mark their hooks with profiler ranges, which the recomputation in backward opens a different number of times than
# the forward: per-op checkpointing would find them out of step and fail. They compute nothing: leave them out of
# its bookkeeping (SAC_IGNORED_OPS is torch's public set of such ops).
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})

# Not bmm: the model's linear layers are mm (addmm with a bias); a bmm is attention's math kernel
# (model.sdpa_backend = math), whose [B, H, S, S] scores saved per block would outgrow everything else.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def op_policy(op_matmuls: str):
    """The per-op policy of one block's forward (and of its recomputation): save the ops of ``_save_list``.
    With ``op_matmuls = "alternate"``, torchtitan's per-op policy (0.2.2): only the odd-numbered bf16/fp32
    matmuls of the block are kept (wq, wv, w1, w2 of the llama3 block: wk, wo and w3 are recomputed), counted
    separately in the forward and in the recomputation so that both make the same choices, and the float8
    matmuls (``_scaled_mm``), which torchtitan neither counts nor saves, are all recomputed (their inputs'
    scales, the amax reductions, are kept). A fresh policy per block forward (its counts start at 0)."""
    save_ops, counts = _save_list(), {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op_matmuls == "alternate":
            if op == torch.ops.aten._scaled_mm.default:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if op in _MATMULS:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context(op_matmuls: str, traced: bool):
    forward, recompute = create_selective_checkpoint_contexts(op_policy(op_matmuls))
    return (forward, recompute) if traced else (forward, _both(recompute, recomputing()))


def _full_context():
    return contextlib.nullcontext(), recomputing()


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def wrap_block(block: nn.Module, mode: str, selective_option: str, index: int, op_matmuls: str = "all",
               traced: bool = False) -> nn.Module:
    """The block, wrapped as ``mode`` asks (unchanged when this block is not checkpointed). The recomputation runs
    under models.moe.recomputing (a MoE layer counts its tokens once), except where ``traced``: a per-op wrapper
    that torch.compile traces whole takes torch's selective-checkpoint contexts only."""
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block, context_fn=_full_context, preserve_rng_state=False)
    assert mode == "selective", mode
    if selective_option == "op":
        assert op_matmuls in ("all", "alternate"), op_matmuls
        wrapped = checkpoint_wrapper(block, context_fn=partial(_op_context, op_matmuls, traced),
                                     preserve_rng_state=False)
        wrapped.op_matmuls = op_matmuls  # which policy it applies, for whoever inspects the plan (tests)
        return wrapped
    every = int(selective_option)
    if index % every == 0:
        return checkpoint_wrapper(block, context_fn=_full_context, preserve_rng_state=False)
    return block


def apply_ac(blocks: nn.ModuleDict, mode: str, selective_option: str, op_matmuls: str = "all",
             traced: bool = False) -> None:
    """Wrap the blocks of ``blocks`` (one pipeline stage's, or the whole model's) in place; selective N counts
    from this stage's first block. ``traced``: the blocks will be compiled whole, per-op wrappers included
    (see ``wrap_block``)."""
    for i, (name, block) in enumerate(list(blocks.items())):
        blocks[name] = wrap_block(block, mode, selective_option, i, op_matmuls, traced)
