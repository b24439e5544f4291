"""Llama 3's whole parallel plan, applied to a model on the meta device: with pipeline parallelism the model is
first split into this rank's stages (``pipeline_stage``, the trainer's call), then each stage gets, in this order:
TP (with sequence and loss parallel) -> EP (MoE experts over the ep ranks, tokens by all-to-all) -> CP (ring
attention) -> float8 -> activation checkpointing -> compile -> FSDP2/HSDP/DDP (over dp_shard x cp; a MoE layer's
experts over the ranks holding the same experts).

float8's one step that must come early is the module swap (nn.Linear -> torchao Float8Linear): it is done
first, because TP installs its hooks on the module object it shards (a later swap would drop them) and
torchao's float8 TP styles accept Float8Linear modules only. The swap allocates and communicates nothing;
TP then picks float8 styles for the converted layers (tensorwise recipe over NCCL: activations all-gathered
in float8), and AC, compile and FSDP (with its float8 weight all-gather when configured) wrap the converted
layers as they wrap any other. See parallelize/float8.py.

Tensor parallel layout (Megatron-style, with sequence parallelism):
- tok_embeddings: vocabulary-parallel (rowwise on the vocabulary), output sharded on the sequence (a tied output
  projection shares its weight, sharded on the vocabulary as the colwise output's would be);
- each block: norms sequence-parallel; the attention and MLP inputs are all-gathered over the sequence;
  wq/wk/wv and w1/w3 colwise (each rank holds whole heads), wo and w2 rowwise with a reduce-scatter back
  to sequence shards;
- a MoE feed-forward (models/moe.py) is not split: it runs on the rank's sequence shard, its weights whole (experts:
  this rank's under EP) and sharded by FSDP over every rank holding other tokens, tp included;
- norm sequence-parallel; output colwise, its logits left sharded on the vocabulary for loss parallel (or
  gathered when loss parallel is off); with the output fused into the loss (training.loss_chunk_tokens) the
  loss is vocabulary-parallel chunk by chunk instead (parallelize/tensor_parallel.py).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from parallelize.activation_checkpoint import apply_ac
from parallelize.compile import apply_compile, set_kernel_autotuning, wait_before_compiled_blocks
from parallelize.context_parallel import context_attention, shard_sequence
from parallelize.expert_parallel import apply_ep
from parallelize.fsdp import apply_fsdp, mixed_precision_policy
from parallelize.float8 import (
    colwise_parallel,
    convert_float8,
    float8_tp_comm_supported,
    prepare_module_input,
    rowwise_parallel,
)
from models.moe import MoE
from parallelize.mesh import ParallelDims
from parallelize.tensor_parallel import apply_tp, enable_async_tp, vocab_parallel_linear_cross_entropy_sum


def tp_plan_root(loss_parallel: bool) -> dict:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def tp_plan_block(block: nn.Module | None = None, float8_comm: bool = False) -> dict:
    """The block's TP plan. With ``float8_comm`` (tensorwise float8 over NCCL), the layers of ``block`` that
    were converted to Float8Linear get torchao's float8 styles: their inputs are cast to float8 before the
    sequence-parallel all-gather (once per module input, shared by wq/wk/wv and by w1/w3). Other layers, and
    every layer without ``block``, get the plain styles."""

    def layer(path: str) -> nn.Module | None:
        return block.get_submodule(path) if block is not None else None

    qkv = [layer(f"attention.{w}") for w in ("wq", "wk", "wv")]
    attention = {
        "attention_norm": SequenceParallel(),
        "attention": prepare_module_input(
            qkv, float8_comm, input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": colwise_parallel(qkv[0], float8_comm),
        "attention.wk": colwise_parallel(qkv[1], float8_comm),
        "attention.wv": colwise_parallel(qkv[2], float8_comm),
        "attention.wo": rowwise_parallel(layer("attention.wo"), float8_comm, output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if block is not None and isinstance(block.feed_forward, MoE):
        # The MoE layer runs on this rank's sequence shard, as data parallelism would: its router and experts are
        # whole here and sharded by FSDP over the ranks holding other tokens, tp included (see parallelize_llama).
        # Its input: the sequence-parallel norm's Shard(1) output as the local tensor; its output is local too, as
        # the rowwise w2's would be.
        return {**attention, "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)}
    return {
        **attention,
        "feed_forward": prepare_module_input(
            [layer("feed_forward.w1"), layer("feed_forward.w3")], float8_comm,
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": colwise_parallel(layer("feed_forward.w1"), float8_comm),
        "feed_forward.w2": rowwise_parallel(layer("feed_forward.w2"), float8_comm, output_layouts=Shard(1)),
        "feed_forward.w3": colwise_parallel(layer("feed_forward.w3"), float8_comm),
    }


def pipeline_stage(model: nn.Module, stage: int, n_stages: int, layers: range) -> nn.Module:
    """Pipeline split (the ModelSpec's pipeline_fn): a copy of ``model`` (meta device) holding only what
    ``stage`` of ``n_stages`` runs: the blocks ``layers``, the embedding on the first stage, the final norm and
    the output projection on the last."""
    part = copy.deepcopy(model)
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    keep = {str(i) for i in layers}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    return part


def apply_cp(model: nn.Module, cp_group, cp_rank: int, cp: int, seq_len: int, rotate: str) -> None:
    """Context parallelism: ring attention in every block, and the RoPE rows of this rank's positions (the
    trainer gives each rank its load-balanced chunks of every sequence, and the whole sequence's document ids)."""
    attn_fn = partial(context_attention, cp_group=cp_group, rotate=rotate)
    for block in model.layers.values():
        block.attention.attn_fn = attn_fn
    model.context_parallel = True
    model.rope_transform = lambda table: shard_sequence(table[:seq_len], 0, cp_rank, cp)


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: Any, device_type: str) -> nn.Module:
    """Apply the plan for ``dims`` and ``cfg`` to ``model`` (on the meta device) in place; returns it."""
    p = cfg.parallelism
    f8 = cfg.float8
    if f8.enable:  # the module swap only (see the module doc); it must precede TP
        convert_float8(
            model,
            recipe=f8.recipe,
            emulate=f8.emulate,
            filter_fqns=f8.filter_fqns,
            fsdp_float8_all_gather=f8.fsdp_float8_all_gather and dims.data_parallel,
            tp=dims.tp,
            skip=[model.output],
        )

    if dims.tp_enabled:
        tp_mesh = dims.mesh("tp")
        float8_comm = f8.enable and f8.recipe == "tensorwise" and float8_tp_comm_supported(tp_mesh)
        root_plan = {k: v for k, v in tp_plan_root(not p.disable_loss_parallel).items() if getattr(model, k) is not None}
        apply_tp(model, tp_mesh, root_plan)
        if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
            # Each style distributed its module's own copy of the shared weight, both on the vocabulary: tie again.
            assert model.output.weight.placements == model.tok_embeddings.weight.placements == (Shard(0),)
            model.output.weight = model.tok_embeddings.weight
        model.linear_loss = vocab_parallel_linear_cross_entropy_sum  # training.loss_chunk_tokens under TP
        model.sequence_shards = dims.tp  # a stage without the embedding gets Shard(1) of the hidden state
        for block in model.layers.values():
            apply_tp(block, tp_mesh, tp_plan_block(block, float8_comm))
        if p.enable_async_tp:
            enable_async_tp(tp_mesh)

    moe_layers = [block.feed_forward for block in model.layers.values() if isinstance(block.feed_forward, MoE)]
    if dims.ep_enabled:
        apply_ep(moe_layers, dims.mesh("ep"))

    if dims.cp_enabled:
        cp_rank, cp = dims.coordinate("cp")
        apply_cp(model, dims.group("cp"), cp_rank, cp, cfg.training.seq_len, p.cp_rotate)

    ac = cfg.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model.layers, ac.mode, ac.selective_option, ac.op_matmuls,
                 traced=cfg.compile.enable and not (dims.ep_enabled and moe_layers))

    if cfg.compile.enable:
        set_kernel_autotuning(cfg.compile.autotune)  # the loss's graph too
        apply_compile(model.layers,
                      inside_checkpoint=ac.mode == "full" or (ac.mode == "selective" and ac.selective_option != "op"),
                      fullgraph=not (dims.ep_enabled and moe_layers), backend=cfg.compile.backend)
        if dims.tp_enabled and model.tok_embeddings is not None:
            wait_before_compiled_blocks(model.tok_embeddings)

    assert dims.data_parallel or not (moe_layers and dims.tp_enabled), "validation: MoE under TP needs FSDP"
    if dims.data_parallel:
        # A MoE layer's experts are sharded over the ranks that hold the same experts (under EP), and under TP the
        # whole layer over every rank holding other tokens, tp included; the rest of its block over the blocks' mesh.
        units = [*((moe.experts, dims.mesh("expert_fsdp")) for moe in moe_layers if dims.ep_enabled),
                 *((moe, dims.mesh("moe_fsdp")) for moe in moe_layers if dims.tp_enabled)]
        apply_fsdp(
            model,
            list(model.layers.values()),
            dims.mesh("fsdp"),
            mixed_precision_policy(cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, device_type),
            reshard_after_forward=p.fsdp_reshard_after_forward,
            cpu_offload=p.fsdp_cpu_offload,
            pipelined=dims.pp_enabled,
            units=tuple(units),
        )
    return model
