"""The Llama 3 / 3.1 architecture, following Meta's reference implementation and torchtitan's llama3, with the
options other decoder families built on it need: QK-norm, a head width of its own, tied embeddings and a
Mixture-of-Experts feed-forward (models/moe.py; Qwen3 uses all four, models/qwen3/).

Rotary embeddings use Meta's layout: each head's features are taken as ``D/2`` interleaved pairs
``(x[2i], x[2i+1])`` rotated by each position's angles (the table ``rope_table`` holds their cosines and sines; real
arithmetic, not complex numbers, which inductor does not compile). (Hugging Face checkpoints store ``wq``/``wk``
with a permutation that turns this into the rotate-half layout; the state-dict adapter undoes it.)

Build on the meta device, then materialize::

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=None)

``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` and entries of ``layers`` deleted (pipeline
stages); ``forward`` and ``init_weights`` handle that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import BACKENDS, attention, flex_block_mask
from models.loss import linear_cross_entropy_sum
from models.moe import MoE, MoEArgs

__all__ = [
    "TransformerModelArgs",
    "precompute_rope_inv_freq",
    "precompute_rope_table",
    "apply_rotary_emb",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "ffn_hidden_dim",
    "num_params",
    "count_params",
    "flops_per_token",
]

ATTN_MASKS = ("causal", "block_causal")


@dataclass
class TransformerModelArgs:
    """Hyperparameters of a Llama 3 model."""

    dim: int = 4096
    """Model (residual stream) width."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads; the head dimension is ``dim // n_heads`` unless head_dim_override gives it."""
    n_kv_heads: Optional[int] = None
    """Number of key/value heads (grouped-query attention); None means ``n_heads`` (multi-head attention)."""
    vocab_size: int = -1
    """Vocabulary size of the embedding and output layers; -1 = unset, taken from the tokenizer."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: Optional[float] = None
    """Multiplier applied to the SwiGLU hidden size ``int(2 * 4 * dim / 3)`` before rounding; None = 1."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: bool = False
    """Apply Llama 3.1's RoPE frequency scaling (factor rope_scaling_factor, low_freq_factor 1, high_freq_factor 4,
    original max positions 8192)."""
    rope_scaling_factor: float = 8.0
    """With rope_scaling: the factor dividing the low frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table (``rope_table``) covers."""
    attn: str = "sdpa"
    """Attention backend: sdpa, flex or flash_attn (see models.attention)."""
    attn_mask: str = "causal"
    """causal, or block_causal (causal within each document given by ``doc_ids``; needs attn = flex)."""
    head_dim_override: Optional[int] = None
    """Width of each head when it is not ``dim // n_heads`` (Qwen3); None: ``dim // n_heads``."""
    ffn_hidden: Optional[int] = None
    """SwiGLU hidden size given directly (Hugging Face's intermediate_size); None: from multiple_of and
    ffn_dim_multiplier."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The output projection shares the input embedding's weight."""
    moe: Optional[MoEArgs] = None
    """The Mixture-of-Experts feed-forward of the sparse blocks; None: every block is dense."""
    n_dense_layers: int = 0
    """With moe: the first blocks that keep a dense feed-forward."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim_override is None and self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"the head dimension ({self.head_dim}) must be even for RoPE")
        if self.attn not in BACKENDS:
            raise ValueError(
                f"model.attn: unknown attention backend {self.attn!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.attn_mask not in ATTN_MASKS:
            raise ValueError(f"model.attn_mask: unknown mask {self.attn_mask!r}; choose one of {', '.join(ATTN_MASKS)}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override if self.head_dim_override is not None else self.dim // self.n_heads

    @property
    def ffn_hidden_size(self) -> int:
        """The dense SwiGLU hidden size."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has the MoE feed-forward."""
        return self.moe is not None and layer_id >= self.n_dense_layers

    def update_from_config(self, model_cfg: Any, tokenizer_vocab_size: int, seq_len: int) -> "TransformerModelArgs":
        """A copy updated from the job config's ``model`` section and the data pipeline.

        ``model_cfg.attn`` and ``model_cfg.attn_mask`` replace the flavor's; ``model_cfg.vocab_size`` replaces the
        flavor's vocabulary size unless it is -1, in which case a flavor without one (-1) takes
        ``tokenizer_vocab_size``. ``max_seq_len`` grows to at least ``seq_len``.
        """
        vocab_size = self.vocab_size
        if model_cfg.vocab_size != -1:
            vocab_size = model_cfg.vocab_size
        elif vocab_size == -1:
            vocab_size = tokenizer_vocab_size
        if vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be positive, got {vocab_size}")
        if tokenizer_vocab_size > vocab_size:
            whose = "set" if model_cfg.vocab_size != -1 else "the flavor's"
            raise ValueError(
                f"model.vocab_size: {vocab_size} ({whose}) is smaller than the vocabulary of the tokenizer "
                f"(data.tokenizer), {tokenizer_vocab_size}; set model.vocab_size to at least {tokenizer_vocab_size} "
                "or use another tokenizer"
            )
        return dataclasses.replace(
            self,
            attn=model_cfg.attn,
            attn_mask=model_cfg.attn_mask,
            vocab_size=vocab_size,
            max_seq_len=max(self.max_seq_len, seq_len),
        )


# ----------------------------------------------------------------------------------------------------------------
# Rotary embeddings
# ----------------------------------------------------------------------------------------------------------------

# Llama 3.1 frequency scaling constants (the factor is the default of TransformerModelArgs.rope_scaling_factor).
ROPE_SCALE_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_MAX_POS = 8192


def precompute_rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: bool = False, scale_factor: float = ROPE_SCALE_FACTOR
) -> Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` (fp32), with Llama 3.1 scaling by ``scale_factor`` when
    ``rope_scaling``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    low_freq_wavelen = ROPE_ORIGINAL_MAX_POS / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelen = ROPE_ORIGINAL_MAX_POS / ROPE_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by the factor, short ones kept, and the band between
    # interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scale_factor, inv_freq)
    smooth = (ROPE_ORIGINAL_MAX_POS / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / scale_factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def precompute_rope_table(
    head_dim: int, end: int, theta: float, rope_scaling: bool = False, scale_factor: float = ROPE_SCALE_FACTOR
) -> Tensor:
    """The rotations of positions ``0 .. end - 1``: ``[end, head_dim // 2, 2]`` fp32, the cosine and the sine of
    ``position * inv_freq`` for each pair of features."""
    inv_freq = precompute_rope_inv_freq(head_dim, theta, rope_scaling, scale_factor)
    t = torch.arange(end, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(t, inv_freq)
    return torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1)


def rope_complex(xq: Tensor, xk: Tensor, rope_table: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_emb`` as a product of complex numbers ``(a + ib) e^(i angle)`` in fp32 (Meta's reference):
    three kernels per tensor eagerly, but inductor generates no code for complex operators, so compiled it runs
    as separate eager kernels over fp32 copies of q and k."""
    seqlen, pairs = rope_table.shape[0], rope_table.shape[1]
    cis = torch.view_as_complex(rope_table).view(1, seqlen, 1, pairs)

    def rotate(x: Tensor) -> Tensor:
        pairs_complex = torch.view_as_complex(x.float().unflatten(-1, (pairs, 2)))
        return torch.view_as_real(pairs_complex * cis).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def rope_real(xq: Tensor, xk: Tensor, rope_table: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_emb`` written out in real arithmetic in fp32, ``(a cos - b sin, a sin + b cos)``: a compiled
    block fuses it with its neighbours; eagerly its separate multiplies and adds are slower than the complex
    product."""
    seqlen, pairs = rope_table.shape[0], rope_table.shape[1]
    cos = rope_table[..., 0].view(1, seqlen, 1, pairs)
    sin = rope_table[..., 1].view(1, seqlen, 1, pairs)

    def rotate(x: Tensor) -> Tensor:
        x2 = x.float().unflatten(-1, (pairs, 2))
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def apply_rotary_emb(xq: Tensor, xk: Tensor, rope_table: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``xq [B, S, Hq, D]`` and ``xk [B, S, Hkv, D]`` by ``rope_table [S, D/2, 2]`` (Meta's interleaved
    layout): each pair ``(a, b) = (x[2i], x[2i+1])`` becomes ``(a cos - b sin, a sin + b cos)`` in fp32. Traced
    by torch.compile in real arithmetic (``rope_real``, which inductor fuses; it has no code generation for complex
    operators), else as a complex product (``rope_complex``, faster eagerly; figures in docs/performance.md)."""
    return (rope_real if torch.compiler.is_compiling() else rope_complex)(xq, xk, rope_table)


# ----------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; the kernel is chosen by ``args.attn``."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.attn_backend = args.attn
        # Set by a parallel plan to replace the kernel call (context parallelism's ring attention):
        # attn_fn(q, k, v, doc_ids=...) -> out, all [B, H, S, D]; doc_ids as the model's forward got them.
        self.attn_fn: Optional[Callable] = None
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self, x: Tensor, rope_table: Tensor, doc_ids: Optional[Tensor] = None, block_mask: Any = None
    ) -> Tensor:
        bs, seqlen, _ = x.shape
        rope_table = rope_table[:seqlen]  # the whole table comes in: under sequence parallelism only here is x whole
        # -1 heads rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:  # in v's dtype: under autocast, newer torch computes RMSNorm in fp32
            xq, xk = self.q_norm(xq).to(xv.dtype), self.k_norm(xk).to(xv.dtype)
        xq, xk = apply_rotary_emb(xq, xk, rope_table)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if self.attn_fn is not None:
            out = self.attn_fn(q, k, v, doc_ids=doc_ids)
        else:
            out = attention(q, k, v, backend=self.attn_backend, doc_ids=doc_ids, block_mask=block_mask)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """SwiGLU hidden size: ``int(2 * 4 * dim / 3)``, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def memory_shapes(args: TransformerModelArgs) -> dict[str, int]:
    """The sizes the memory estimate reads (ModelSpec.shapes); ``args.vocab_size`` must be set."""
    moe = args.moe
    return dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                head_dim=args.head_dim, ffn_hidden=args.ffn_hidden_size, vocab_size=args.vocab_size,
                qk_norm=bool(args.qk_norm), tied=bool(args.tie_embeddings),
                experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
                expert_hidden=moe.hidden_dim if moe else 0,
                shared_hidden=moe.hidden_dim * moe.num_shared_experts if moe else 0)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``; ``h + feed_forward(ffn_norm(h))``."""

    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = (MoE(args.dim, args.moe) if args.is_moe_layer(layer_id)
                             else FeedForward(args.dim, args.ffn_hidden_size))
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the output projections (torchtitan's depth_init).
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: Tensor, rope_table: Tensor, doc_ids: Optional[Tensor] = None, block_mask: Any = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_table, doc_ids=doc_ids, block_mask=block_mask)
        return h + self.feed_forward(self.ffn_norm(h))


def _no_materialize(module: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class Transformer(nn.Module):
    """Llama 3 decoder: ``tok_embeddings -> layers["0".."n-1"] -> norm -> output`` (logits, no loss)."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(f"model.vocab_size: must be set (positive) to build the model, got {args.vocab_size}")
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: recomputed by init_weights (the model is usually built on the meta device).
        self.register_buffer("rope_table", self._precompute_rope_table(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by a parallel plan when each rank holds only some positions of a sequence (context
        # parallelism): maps the RoPE table to the rows of this rank's tokens, in their local order.
        self.rope_transform: Optional[Callable[[Tensor], Tensor]] = None
        # Set by a parallel plan under context parallelism: tokens then hold this rank's chunks of each sequence
        # while doc_ids stay whole (the blocks' ring attention masks every chunk pair locally).
        self.context_parallel = False
        # Set by a parallel plan under sequence parallelism (TP): the hidden state a pipeline stage without the
        # embedding receives holds 1/sequence_shards of the positions (the blocks gather them for attention).
        self.sequence_shards = 1
        # The output projection fused with the loss (forward with labels): (h, weight, labels, chunk) -> loss
        # sum. A parallel plan replaces it when the projection is sharded (tensor parallelism).
        self.linear_loss: Callable[[Tensor, Tensor, Tensor, int], Tensor] = linear_cross_entropy_sum
        # Tokens per chunk of the fused loss (training.loss_chunk_tokens; the trainer sets it). An attribute, not
        # a forward argument: a pipeline schedule hands every forward keyword to autograd as a stage input.
        self.loss_chunk_tokens = 2048

    def _precompute_rope_table(self) -> Tensor:
        a = self.args
        return precompute_rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, a.rope_scaling_factor)

    def init_weights(
        self,
        buffer_device: Optional[torch.device] = None,
        materialize: Callable[[Any], Any] = _no_materialize,
        seed: Optional[int] = None,
    ) -> None:
        """Initialize every parameter and recompute ``rope_table`` on ``buffer_device`` (default: where it is).

        Embedding ~ N(0, 0.02); wq/wk/wv/w1 ~ truncN(0, 0.02); wo/w2/w3 ~ truncN(0, 0.02 / sqrt(2 (layer_id + 1)));
        output ~ truncN(0, dim^-0.5) cut at 3 std; norms = 1. Each unit (embedding, block, norm, output) is
        initialized inside ``materialize(unit)``: parallelize.init.materialize gives a parallelized model the
        weights of a single-process one. With ``seed``, each unit draws from its own seed (derived from ``seed``
        and the unit's place in the model), so a pipeline stage holding some of the units draws the same
        weights for them as the whole model does.
        """
        n = self.args.n_layers

        def unit(module: Any, index: int):
            if seed is not None:
                torch.manual_seed(seed * 100_003 + index)
            return materialize(module)

        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None and \
                self.output.weight is not self.tok_embeddings.weight:  # to_empty unties them
            self.output.weight = self.tok_embeddings.weight
        buffer_device = buffer_device if buffer_device is not None else self.rope_table.device
        with torch.device(buffer_device):
            self.rope_table = self._precompute_rope_table()
        if self.rope_transform is not None:
            self.rope_table = self.rope_transform(self.rope_table)
        if self.tok_embeddings is not None:
            with unit(self.tok_embeddings, 0):
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            if layer is not None:
                # An activation-checkpoint wrapper passes attribute lookups on to the block it wraps.
                with unit(layer, 1 + layer.layer_id):
                    layer.init_weights()
        if self.norm is not None:
            with unit(self.norm, n + 1):
                self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:  # a tied one is the embedding's
            std = self.args.dim**-0.5
            with unit(self.output, n + 2):
                nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        elif self.output is not None and self.tok_embeddings is None:
            # A pipeline's last stage holds its own copy of the tied weight: drawn as the embedding is.
            with unit(self.output, 0):
                nn.init.normal_(self.output.weight, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor, doc_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None) -> Tensor:
        """``tokens [B, S]`` (or the hidden state ``[B, S, dim]`` when ``tok_embeddings`` is None) -> logits
        ``[B, S, vocab_size]`` (or the hidden state when ``output`` is None).

        ``doc_ids [B, S]`` gives each token's document; it is used when ``attn_mask = block_causal`` (and required
        then) and ignored for ``causal``. Under context parallelism (``self.context_parallel``) it covers the whole
        sequence while ``tokens`` hold this rank's chunks. With ``labels [B, S]`` the model returns the sum of the token
        cross-entropies instead of the logits, the output projection fused with the loss over
        ``self.loss_chunk_tokens`` tokens at a time (models/loss.py), so that the logits never exist whole.
        """
        # The whole sequence's length: tokens are whole before the embedding; a later pipeline stage's hidden state
        # holds a slice of the positions under sequence parallelism.
        seqlen = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
        if seqlen > self.rope_table.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {self.rope_table.shape[0]}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens

        if self.args.attn_mask == "block_causal":
            if doc_ids is None:
                raise ValueError("model.attn_mask = block_causal needs doc_ids in the forward call")
        else:
            doc_ids = None
        block_mask = None
        grad_on_cpu = h.device.type == "cpu" and torch.is_grad_enabled()
        if self.args.attn == "flex" and not grad_on_cpu and not self.context_parallel:
            # One BlockMask per forward, shared by all layers (on CPU with grad flex falls back to a dense mask).
            block_mask = flex_block_mask(doc_ids, seqlen, h.device)

        for layer in self.layers.values():
            h = layer(h, self.rope_table, doc_ids=doc_ids, block_mask=block_mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            if labels is not None:
                return self.linear_loss(h, self.output.weight, labels, self.loss_chunk_tokens)
            h = self.output(h)
        return h


# ----------------------------------------------------------------------------------------------------------------
# Parameter and FLOP counts
# ----------------------------------------------------------------------------------------------------------------


def num_params(args: TransformerModelArgs, exclude_embedding: bool = False, active: bool = False) -> int:
    """Parameter count of ``Transformer(args)``, computed from the shapes (no model built).

    ``exclude_embedding`` leaves out the input embedding ``tok_embeddings`` (an untied output projection is
    counted); ``active`` counts the experts one token uses (top_k routed experts and the shared ones) instead of
    all of them.
    """
    if args.vocab_size <= 0:
        raise ValueError(f"model.vocab_size: must be set (positive) to count parameters, got {args.vocab_size}")
    dim, hd = args.dim, args.head_dim
    attn = dim * args.n_heads * hd * 2 + dim * args.n_kv_heads * hd * 2  # wq, wo; wk, wv
    attn += 2 * hd if args.qk_norm else 0
    dense = 3 * dim * args.ffn_hidden_size
    blocks = 0
    for layer_id in range(args.n_layers):
        if args.is_moe_layer(layer_id):
            m = args.moe
            experts = m.top_k if active else m.num_experts
            ffn = 3 * dim * m.hidden_dim * (experts + m.num_shared_experts) + dim * m.num_experts  # + router
        else:
            ffn = dense
        blocks += attn + ffn + 2 * dim
    embedding = args.vocab_size * dim
    output = 0 if args.tie_embeddings else args.vocab_size * dim
    total = blocks + dim + output + embedding  # + final norm
    return total - embedding if exclude_embedding else total


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters of ``model`` (global sizes for DTensor parameters; works on meta).

    ``exclude_embedding`` leaves out ``model.tok_embeddings`` when the model has one.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        emb = getattr(model, "tok_embeddings", None)
        if emb is not None:
            total -= sum(p.numel() for p in emb.parameters())
    return total


def flops_per_token(args: TransformerModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (torchtitan's count): ``6 x`` the active parameters a token's matmuls use (the
    blocks with top_k experts, the output projection, tied or not) ``+ 12 * n_layers * n_heads * head_dim *
    seq_len`` (attention scores, causality not discounted)."""
    matmul_params = num_params(args, exclude_embedding=True, active=True)
    if args.tie_embeddings:
        matmul_params += args.vocab_size * args.dim
    return 6 * matmul_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
