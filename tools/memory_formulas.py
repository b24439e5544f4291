"""Per-rank GPU memory of a training layout: the formulas (shapes, parameter shards, activation bytes per token).

tools/memory.py adds them up per pipeline rank (its command line prints the table); the dry run
(tools/dry_run.py) prints the same table with the parameter shard sizes read from the real parallelized model on
the meta device, and the planner (tools/planner.py) ranks layouts with it. The shapes come from the model
family's ModelSpec (``shapes``); the activation formulas follow the Llama 3 block. What is counted, the formulas
and their assumptions (CUDA with the configured mixed precision; active memory, not the allocator's reserve) are
written out in docs/scale.md ("The formulas").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from models.registry import get_model_spec

GIB = 1024**3
DEFAULT_GPU_MEMORY_GIB = 80.0


# --------------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys (Qwen3): two head_dim weights per block."""
    tied: bool = False
    """The output projection is the embedding's weight (one parameter, held with the embedding; a pipeline's last
    stage holds a copy)."""
    experts: int = 0
    """Routed experts of each block's Mixture-of-Experts feed-forward; 0: a dense SwiGLU of ffn_hidden."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_hidden: int = 0
    """SwiGLU hidden size of one expert."""
    shared_hidden: int = 0
    """SwiGLU hidden size of the shared experts (0: none)."""

    @classmethod
    def from_args(cls, args, name: str = "llama3") -> "ModelShape":
        """From the args (vocab_size set) of the model family ``name``, through its ModelSpec's ``shapes``."""
        spec = get_model_spec(name)
        if spec.shapes is None:
            raise ValueError(f"model.name: the memory estimate needs the sizes of {name!r}, whose ModelSpec gives "
                             "no shapes")
        return cls(**spec.shapes(args))

    @property
    def hq(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def hkv(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class PartSizes:
    """Parameter elements of one part of the model (the embedding, one block, or the final norm + output)
    as one rank holds them."""

    local: int = 0
    """Elements stored on this rank: after tensor-parallel and FSDP sharding (the fp32 master shard)."""
    tp: int = 0
    """Elements after tensor-parallel sharding only: what FSDP's all-gather makes whole on this rank."""
    matmul_tp: int = 0
    """Of ``tp``, the elements of matmul weights (those bf16 autocast casts)."""

    def __add__(self, other: "PartSizes") -> "PartSizes":
        return PartSizes(self.local + other.local, self.tp + other.tp, self.matmul_tp + other.matmul_tp)

    def times(self, n: int) -> "PartSizes":
        return PartSizes(self.local * n, self.tp * n, self.matmul_tp * n)


@dataclass
class StageParams:
    """One pipeline stage as one of its ranks holds it."""

    stage: int
    """Global index of the stage."""
    layers: int
    """Transformer blocks in the stage."""
    block: PartSizes
    """One block (all blocks have the same shapes)."""
    embedding: Optional[PartSizes] = None
    """The token embedding (first stage only)."""
    final: Optional[PartSizes] = None
    """The final norm and the output projection (last stage only)."""

    @property
    def total(self) -> PartSizes:
        total = self.block.times(self.layers)
        for part in (self.embedding, self.final):
            if part is not None:
                total = total + part
        return total

    @property
    def root(self) -> PartSizes:
        """What FSDP's root unit holds: the embedding and the final norm + output."""
        root = PartSizes()
        for part in (self.embedding, self.final):
            if part is not None:
                root = root + part
        return root


def _shard(rows: int, n: int) -> int:
    """Rows on the first rank when ``rows`` are split in ``n`` chunks (torch.chunk, as DTensor and FSDP do)."""
    return -(-rows // n)


def _part(tensors: list[tuple[int, int, bool]], fsdp_shard: int) -> PartSizes:
    """Sizes of a part from its tensors (rows after TP, columns, is a matmul weight); FSDP shards dim 0."""
    part = PartSizes()
    for rows, cols, matmul in tensors:
        part = part + PartSizes(_shard(rows, fsdp_shard) * cols, rows * cols, rows * cols if matmul else 0)
    return part


def block_tensors(shape: ModelShape, tp: int) -> list[tuple[int, int, bool]]:
    """A block's weights after TP that FSDP shards over the blocks' mesh, as (rows, columns, matmul): colwise
    layers shard their rows (output features), rowwise layers their columns, norms are replicated (parallelize
    plan of models/llama3). A MoE feed-forward's weights are not among them: ``moe_part``."""
    d, f = shape.dim, shape.ffn_hidden
    tensors = [
        (_shard(shape.hq, tp), d, True),  # wq
        (_shard(shape.hkv, tp), d, True),  # wk
        (_shard(shape.hkv, tp), d, True),  # wv
        (d, _shard(shape.hq, tp), True),  # wo
        (d, 1, False),  # attention_norm
        (d, 1, False),  # ffn_norm
    ]
    if shape.qk_norm:
        tensors += [(shape.head_dim, 1, False)] * 2  # q_norm, k_norm
    if not shape.experts:
        tensors += [(_shard(f, tp), d, True), (d, _shard(f, tp), True), (_shard(f, tp), d, True)]  # w1, w2, w3
    return tensors


def moe_part(shape: ModelShape, tp: int, fsdp_shard: int, ep: int) -> PartSizes:
    """A MoE feed-forward as one rank holds it: the router and the shared experts whole (never TP-split) and sharded
    by FSDP over every rank holding other tokens (the blocks' mesh, tp included); this rank's ``experts / ep``
    routed experts sharded over the ranks holding the same ones (``fsdp_shard x tp / ep``) on the expert
    dimension, or on the next one when there are fewer local experts than those ranks (parallelize/fsdp.py)."""
    d, h, local = shape.dim, shape.expert_hidden, shape.experts // ep
    part = _part([(shape.experts, d, True)]  # router.gate
                 + ([(shape.shared_hidden, d, True), (d, shape.shared_hidden, True),
                     (shape.shared_hidden, d, True)] if shape.shared_hidden else []), fsdp_shard * tp)
    efsdp = fsdp_shard * tp // ep
    for rows, cols in ((h, d), (d, h), (h, d)):  # w1 [E, h, d], w2 [E, d, h], w3 [E, h, d]
        whole = local * rows * cols
        held = _shard(local, efsdp) * rows * cols if local >= efsdp else local * _shard(rows, efsdp) * cols
        part = part + PartSizes(held, whole, whole)
    return part


@functools.lru_cache(maxsize=4096)
def stage_params(shape: ModelShape, stage: int, n_stages: int, layers: int, tp: int, fsdp_shard: int,
                 ep: int = 1) -> StageParams:
    """What the first rank of a stage holds, computed from the shapes (the dry run measures the same)."""
    embedding = final = None
    if stage == 0:  # vocabulary-parallel embedding: rows sharded over tp
        embedding = _part([(_shard(shape.vocab_size, tp), shape.dim, False)], fsdp_shard)
    if stage == n_stages - 1:  # final norm (replicated) and the colwise output projection: tied, the embedding's
        # weight, or its copy when a pipeline puts the embedding on another stage
        output = [] if shape.tied and n_stages == 1 else [(_shard(shape.vocab_size, tp), shape.dim, True)]
        final = _part([(shape.dim, 1, False), *output], fsdp_shard)
    block = _part(block_tensors(shape, tp), fsdp_shard)
    if shape.experts:
        block = block + moe_part(shape, tp, fsdp_shard, ep)
    return StageParams(stage, layers, block, embedding, final)


# --------------------------------------------------------------------------------------------------------
# The layout, as the estimate needs it
# --------------------------------------------------------------------------------------------------------


@dataclass
class Precision:
    """How the compute runs: bytes of the compute dtype and of the residual stream, and the copies of a
    normalized input that the projections save."""

    name: str
    compute: int
    """Bytes per element of matmul outputs and attention (c)."""
    residual: int
    """Bytes per element of the residual stream and the norms' inputs (r)."""
    attn_input_copies: int
    """Copies of the normalized input kept by wq/wk/wv (autocast casts it once per projection)."""
    mlp_input_copies: int
    """The same for w1/w3."""
    working: int
    """Bytes per element of the compute copy of a weight (FSDP all-gather output or autocast cast)."""
    casts_weights: bool = False
    """Autocast casts the fp32 matmul weights to bf16 in each forward (its cache can keep the copies)."""
    split_weights: bool = False
    """The matmul weights are split bf16 weights (parallelize/bf16_weights.py): no casts, bf16 gradients."""
    bf16_grads: bool = False
    """Every sharded gradient is bf16 (FSDP2 on split bf16 weights, training.fsdp_bf16_weights)."""


def precision_for(param_dtype: str, data_parallel: bool, bf16_weights: bool = False,
                  fsdp_bf16_weights: bool = False) -> Precision:
    """The compute precision on CUDA: FSDP2 mixed precision when the model is data parallel (its shards split
    where ``fsdp_bf16_weights``), else autocast, on split bf16 weights where ``bf16_weights``
    (parallelize/bf16_weights.py)."""
    if param_dtype != "bfloat16":
        return Precision("fp32", 4, 4, 1, 1, 4)
    if data_parallel and fsdp_bf16_weights:
        return Precision("bf16 (FSDP mixed precision, bf16 weights)", 2, 2, 1, 1, 2, bf16_grads=True)
    if data_parallel:
        return Precision("bf16 (FSDP mixed precision)", 2, 2, 1, 1, 2)
    if bf16_weights:
        return Precision("bf16 (autocast, bf16 weights)", 2, 4, 3, 2, 2, split_weights=True)
    return Precision("bf16 (autocast)", 2, 4, 3, 2, 2, casts_weights=True)


def layout_precision(cfg, dims) -> Precision:
    """The Precision a validated config runs with on CUDA (split bf16 weights as the trainer decides them)."""
    from engine.config.validation import grad_accumulation_steps
    from parallelize.bf16_weights import bf16_weights_apply

    t = cfg.training
    split = bf16_weights_apply(t.bf16_weights, dims.distributed, grad_accumulation_steps(cfg, dims.dp))
    return precision_for(t.mixed_precision_param, dims.data_parallel, split, t.fsdp_bf16_weights)


@dataclass
class RankLayout:
    """Everything about one rank's work that memory depends on, besides the parameter shapes."""

    seq_len: int
    microbatch_samples: int
    """Samples per forward/backward pass (local_batch_size, divided by the pipeline microbatches)."""
    grad_accum: int
    tp: int
    cp: int
    pp: int
    pp_rank: int
    pp_schedule: str
    microbatches: int
    """Pipeline microbatches of one schedule step: per local batch x gradient accumulation steps, as the trainer
    runs the whole optimizer step in one schedule step (1 without PP)."""
    virtual_stages: int
    """Stages this pp rank runs."""
    fsdp: bool
    """Wrapped in FSDP2 (FSDP, HSDP, DDP or FSDP on one rank)."""
    reshard_after_forward: str
    cpu_offload: bool
    loss_parallel: bool
    ac_mode: str
    ac_option: str
    precision: Precision
    optimizer_states: int = 2
    loss_chunk_tokens: int = 0
    """training.loss_chunk_tokens: the output projection fused with the loss, this many tokens at a time."""
    compiled: bool = False
    """compile.enable: the blocks and the loss compiled."""
    ac_op_matmuls: str = "all"
    """activation_checkpoint.op_matmuls: the matmul outputs per-op AC keeps, all or alternate."""
    ep: int = 1
    """parallelism.ep: the MoE layers' tokens exchanged by all-to-all."""

    @property
    def tokens(self) -> int:
        """T: tokens of one microbatch on this rank."""
        return self.microbatch_samples * self.seq_len // self.cp


def rank_layout(cfg, dims, pp_rank: int) -> RankLayout:
    """The RankLayout of pipeline rank ``pp_rank`` for a validated config and its ParallelDims."""
    from engine.config.validation import grad_accumulation_steps, pp_microbatches
    from parallelize.pipeline_parallel import stage_ids

    p, t = cfg.parallelism, cfg.training
    micro = pp_microbatches(cfg, dims) if dims.pp > 1 else 1
    local_stages = len(stage_ids(pp_rank, dims.pp, p.pp_schedule, p.pp_virtual_stages)) if dims.pp > 1 else 1
    return RankLayout(
        seq_len=t.seq_len,
        microbatch_samples=t.local_batch_size // micro,
        grad_accum=grad_accumulation_steps(cfg, dims.dp),
        tp=dims.tp,
        cp=dims.cp,
        pp=dims.pp,
        pp_rank=pp_rank,
        pp_schedule="csv" if p.pp_schedule_csv else p.pp_schedule,
        microbatches=micro * grad_accumulation_steps(cfg, dims.dp) if dims.pp > 1 else 1,
        virtual_stages=local_stages,
        fsdp=dims.data_parallel,
        reshard_after_forward=p.fsdp_reshard_after_forward,
        cpu_offload=p.fsdp_cpu_offload,
        loss_parallel=dims.tp > 1 and not p.disable_loss_parallel,
        ac_mode=cfg.activation_checkpoint.mode,
        ac_option=cfg.activation_checkpoint.selective_option,
        precision=layout_precision(cfg, dims),
        loss_chunk_tokens=t.loss_chunk_tokens,
        compiled=cfg.compile.enable,
        ac_op_matmuls=cfg.activation_checkpoint.op_matmuls,
        ep=dims.ep,
    )


# --------------------------------------------------------------------------------------------------------
# Activation bytes per token
# --------------------------------------------------------------------------------------------------------


def moe_bytes_per_token(shape: ModelShape, lay: RankLayout, kind: str) -> float:
    """What a MoE feed-forward keeps for backward per token of T, beyond its normalized input (counted with the
    block's): kind none or op (docs/scale.md). It runs on the rank's sequence shard under TP (1/t of the tokens).
    Per token routed to k experts: the router's logits (and, without AC, their fp32 probabilities); the k rows
    gathered for the experts and, under EP, the rows the all-to-all delivers and returns; the experts' SwiGLU
    (w1 and w3 outputs, and without AC silu(w1) and the product; compiled, one fewer); their w2 output; the
    shared experts' the same way."""
    c, t, k, e = lay.precision.compute, lay.tp, shape.top_k, shape.experts
    d, h, hs = shape.dim, shape.expert_hidden, shape.shared_hidden
    exchanged = 2 * k * d * c if lay.ep > 1 else 0
    if kind == "op":  # per-op AC keeps the matmuls' (grouped ones included) and the all-to-alls' outputs
        return (c * e + exchanged + k * (2 * h + d) * c + (2 * hs + d) * c * bool(hs)) / t
    swiglu = 3 if lay.compiled else 4
    return ((c + 8) * e + 4 * k + 2 * k * d * c + exchanged + swiglu * k * h * c + (swiglu * hs + d) * c * bool(hs)) / t


def block_bytes_per_token(shape: ModelShape, lay: RankLayout, kind: str) -> float:
    """Bytes one block keeps for backward per token of T (docs/scale.md): kind none/full/op."""
    c, r, t = lay.precision.compute, lay.precision.residual, lay.tp
    d, hq, hkv, h, f = shape.dim, shape.hq, shape.hkv, shape.n_heads, shape.ffn_hidden
    if kind == "full":
        return r * d / t
    if shape.experts:  # the attention half of the dense formula (f = 0), then the MoE feed-forward's
        dense = block_bytes_per_token(dataclasses.replace(shape, experts=0, ffn_hidden=0), lay, kind)
        return dense + moe_bytes_per_token(shape, lay, kind)
    if kind == "op":
        # hq-wide tensors kept per token (q, the attention output); compiled, one fewer (tests/test_dry_run.py)
        hq_tensors = 1 if lay.compiled else 2
        reduce_scatter = 2 * c * d / t if t > 1 else 0
        kept = r * d / t + 2 * c * d + (hq_tensors * c * hq + 2 * c * hkv + 4 * h) / t + 2 * c * f / t + reduce_scatter
        if lay.ac_op_matmuls == "alternate":  # wk, wo and w3 recomputed: their outputs are not kept
            kept -= c * hkv / t + c * d + c * f / t
        return kept
    assert kind == "none", kind
    if lay.compiled:  # one cast per input, no attention residual, the attention output twice, no silu(w1)
        residuals, copies, hq_tensors, ffn = 1, 2, 3, 3
    else:
        copies = lay.precision.attn_input_copies + lay.precision.mlp_input_copies
        residuals, hq_tensors, ffn = 2, 2, 4
    return ((residuals * r * d + 8) / t + copies * c * d + (hq_tensors * c * hq + 2 * c * hkv + 4 * h) / t
            + ffn * c * f / t)


def block_backward_bytes_per_token(shape: ModelShape, lay: RankLayout) -> float:
    """Gradients in flight during one block's backward, per token (a MoE block: of its experts' k rows)."""
    c, r, t = lay.precision.compute, lay.precision.residual, lay.tp
    if shape.experts:
        k = shape.top_k
        return (3 * c * k * shape.expert_hidden + 2 * c * k * shape.dim) / t + c * shape.dim + 2 * r * shape.dim / t
    return 3 * c * shape.ffn_hidden / t + c * shape.dim + 2 * r * shape.dim / t


def block_kinds(layers: int, lay: RankLayout) -> dict[str, int]:
    """How many blocks of a stage keep what: {none, full, op: count} (activation_checkpoint.mode and
    selective_option; selective N checkpoints blocks 0, N, 2N, ... of the stage fully)."""
    if lay.ac_mode == "none":
        return {"none": layers}
    if lay.ac_mode == "full":
        return {"full": layers}
    if lay.ac_option == "op":
        return {"op": layers}
    full = -(-layers // int(lay.ac_option))
    return {"full": full, "none": layers - full}


def _saved_blocks(shape: ModelShape, lay: RankLayout, kinds: dict[str, int]) -> float:
    """Bytes per token the blocks counted in ``kinds`` keep."""
    return sum(n * block_bytes_per_token(shape, lay, kind) for kind, n in kinds.items())


def final_bytes_per_token(shape: ModelShape, lay: RankLayout) -> float:
    """The final norm's input and rstd, and the output projection's (whole-sequence) input."""
    c, r, t = lay.precision.compute, lay.precision.residual, lay.tp
    return (r * shape.dim + 4) / t + c * shape.dim


def loss_bytes(shape: ModelShape, lay: RankLayout, tokens: int) -> float:
    """The loss at the start of backward: fp32 log-softmax output, its incoming gradient and the result;
    compiled, the kept logits and log-sum-exp and the logits' gradient; or, fused with the output projection
    (training.loss_chunk_tokens), one chunk's fp32 logits and their compute-dtype gradient, the hidden state's
    gradient and the weight's (fp32 under autocast, split bf16 weights included; else the weight's dtype),
    over this rank's vocabulary slice under TP."""
    if lay.loss_chunk_tokens:
        chunk = min(lay.loss_chunk_tokens, tokens)
        c = lay.precision.compute
        weight = lay.precision.working if lay.fsdp else 4
        vocab = shape.vocab_size / lay.tp
        return chunk * vocab * (4 + c) + c * shape.dim * tokens + weight * vocab * shape.dim
    if lay.loss_parallel:
        return 16 * shape.vocab_size / lay.tp * tokens
    if lay.compiled:
        return 2 * lay.precision.compute * shape.vocab_size * tokens + 8 * tokens
    return 12 * shape.vocab_size * tokens


def in_flight_chunks(lay: RankLayout) -> int:
    """Microbatch-stage chunks whose activations this pp rank holds at once (docs/scale.md)."""
    m, p, v, rank = lay.microbatches, lay.pp, lay.virtual_stages, lay.pp_rank
    if p == 1:
        return 1
    if lay.pp_schedule == "GPipe":
        return m
    if lay.pp_schedule == "1F1B":
        return min(m, p - rank)
    if lay.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)
    if lay.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        return min(m * v, 2 * p)
    return m * v  # LoopedBFS and CSV schedules: every chunk at worst
