"""Context parallelism: each sequence split over the ``cp`` ranks of a group, with ring attention.

Data layout (causal load balancing)
    A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks. Rank ``r`` holds chunks ``r`` and
    ``2 * cp - 1 - r``, concatenated in that order: ``S_local = S / cp`` tokens, a "head" chunk and the
    mirror "tail" chunk. Under causal attention a late chunk costs more than an early one; pairing them gives
    every rank the same work (``2 * cp + 1`` chunk-sized blocks each). ``shard_sequence`` cuts a tensor this
    way, ``unshard_sequence`` puts the ranks' pieces back together, ``local_positions`` says which global
    positions a rank holds (for RoPE).

Attention (``context_attention``)
    Every rank's queries must see the keys and values of every earlier position, which live on other ranks.
    The k/v chunks of every rank reach every rank, one source rank at a time, and each (query chunk, key/value
    chunk) pair is one block of attention:
        key chunk index <  query chunk index: full (non-causal) attention;
        key chunk index == query chunk index: causal attention (the square diagonal block);
        key chunk index >  query chunk index: skipped (all masked).
    Each block gives an output and the log-sum-exp ``lse`` of its scaled scores per query row; the blocks of a
    query chunk merge exactly with ``lse = logsumexp_i(lse_i)``, ``out = sum_i exp(lse_i - lse) * out_i``.
    The backward recomputes each block with the attention kernel's own backward, given the *final* output and
    the *final* lse (with them each block's softmax is the true full-row softmax, so the block gradients are
    exact pieces of the full gradient): dq accumulates locally, dk/dv contributions go back to the rank that
    owns the keys and values.

    How the k/v chunks travel (``parallelism.cp_rotate``):
        allgather: one all-gather of every rank's k/v; the backward gathers them again and reduce-scatters the
            dk/dv contributions to their owners.
        alltoall: k/v pass around the ring (to the next rank, from the previous one) with point-to-point sends,
            the next transfer overlapping the current block's compute; in the backward a dk/dv accumulator
            travels with each rank's k/v and ends back at its owner.

    Kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; on CUDA with
    fp16/bf16, ``aten._scaled_dot_product_flash_attention`` and its backward; elsewhere (e.g. fp32 on CUDA,
    which the flash kernel does not take) a plain matmul/softmax implementation of the same block. Merging and
    gradient accumulation run in fp32. Grouped-query attention: k/v travel with their own (fewer) heads and
    are repeated to the query heads per block; their gradients are summed back over the repeats.

Document masking (``model.attn_mask = block_causal``, ``doc_ids`` given)
    A query also attends only to keys of its own document. Every rank is given the document ids of the *whole*
    sequence (they are small, and the same on every rank of the group), so each block's mask (same document,
    and key not after query on the diagonal) is built locally and nothing more travels. The same blocks are
    skipped as without masking; a block may now hold query rows with no visible key (a document that starts
    after the key chunk ends): such a row's lse is -inf and its output 0, and the merge gives it no weight. The
    CPU kernel takes the mask as an additive bias; on CUDA the flash kernel takes no mask, so masked blocks use
    the matmul/softmax kernel (it materializes the fp32 scores of at most ``MATH_TILE_BYTES`` at a time: a
    block's query rows in tiles).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from models.attention import dense_causal_mask

__all__ = [
    "ROTATE_METHODS",
    "shard_sequence",
    "unshard_sequence",
    "local_positions",
    "context_attention",
]

ROTATE_METHODS = ("allgather", "alltoall")
"""Valid values of ``parallelism.cp_rotate``."""

# torch 2.13 renamed these collectives (the old names warn there); torch 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Point-to-point tags of the ring, so that k/v and gradient transfers between the same two ranks never mix.
_KV_TAG, _GRAD_TAG = 0, 1


# ----------------------------------------------------------------------------------------------------------------
# sequence layout
# ----------------------------------------------------------------------------------------------------------------


def _chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """Global indices of the two chunks rank ``rank`` holds, in local order."""
    return rank, 2 * cp_size - 1 - rank


def shard_sequence(t: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """Rank ``cp_rank``'s part of ``t`` along ``dim``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of
    ``2 * cp_size`` equal chunks, concatenated in that order."""
    assert t.shape[dim] % (2 * cp_size) == 0, (
        f"context parallelism: length {t.shape[dim]} (dim {dim}) is not divisible by 2 x cp = {2 * cp_size}"
    )
    chunks = t.chunk(2 * cp_size, dim=dim)
    head, tail = _chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def unshard_sequence(chunks_by_rank: list[Tensor], dim: int) -> Tensor:
    """The whole sequence from every rank's ``shard_sequence`` result (``chunks_by_rank[r]`` from rank ``r``)."""
    halves = [t.chunk(2, dim=dim) for t in chunks_by_rank]
    heads = [h[0] for h in halves]  # global chunks 0 .. cp - 1
    tails = [h[1] for h in reversed(halves)]  # global chunks cp .. 2 cp - 1
    return torch.cat(heads + tails, dim=dim)


def local_positions(
    seq_len: int, cp_rank: int, cp_size: int, device: Optional[torch.device | str] = None
) -> Tensor:
    """Global positions (``LongTensor [seq_len // cp_size]``) of rank ``cp_rank``'s tokens, in local order."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp_rank, cp_size)


# ----------------------------------------------------------------------------------------------------------------
# per-block kernels: forward(q, k, v, is_causal, scale, mask) -> (out, lse [B, H, Sq] fp32);
# backward(dout, q, k, v, out, lse, is_causal, scale, mask) -> (dq, dk, dv). q, k, v have the same number of
# heads. ``mask`` (bool ``[B, 1, Sq, Sk]``, True = may attend) or None; a mask already holds the causal part, and
# a row it leaves empty gets lse -inf and output 0.
# ----------------------------------------------------------------------------------------------------------------


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The bool mask as the additive bias the CPU kernel takes (it refuses bool masks)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cpu_block_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float], mask=None):
    if mask is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale
    )
    # The kernel gives an empty row output 0 but lse 0 (not -inf), which would weigh that 0 in the merge.
    return out, lse.masked_fill(~mask.any(-1), float("-inf"))


def _cpu_block_backward(dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], mask=None):
    if mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale
    )


def _cuda_block_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float], mask=None):
    assert mask is None, "the CUDA flash kernel takes no mask"
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)
    return out, lse


def _cuda_block_backward(dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], mask=None):
    assert mask is None, "the CUDA flash kernel takes no mask"
    # Dense (not nested) inputs: no cumulative sequence lengths (None = undefined, as the forward returns them);
    # without dropout the philox seed and offset are never read (the forward returns empty ones too).
    unused = torch.empty((), dtype=torch.long)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal, unused, unused,
        scale=scale,
    )
    return dq, dk, dv


MATH_TILE_BYTES = 256 * 2**20
"""At most this many bytes of fp32 scores at a time in the matmul/softmax kernels: a block's query rows are
processed in tiles of ``MATH_TILE_BYTES / (B * H * Sk * 4)`` rows (at 128k tokens over cp 8 a whole
``[1, 32, 8192, 8192]`` block would be 8 GiB)."""


def _row_tiles(q: Tensor, k: Tensor) -> list[tuple[int, int]]:
    """``(first, end)`` query rows of each tile of a block of ``q`` against ``k``."""
    batch, heads, rows_total, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    rows = max(1, MATH_TILE_BYTES // (batch * heads * keys * 4))
    return [(first, min(first + rows, rows_total)) for first in range(0, rows_total, rows)]


def _math_scores(q: Tensor, k: Tensor, is_causal: bool, scale: float, mask, first: int) -> Tensor:
    """Scaled fp32 scores of the query rows ``q`` (block rows ``first`` on) against all of ``k``; ``mask`` the
    same rows of the block's mask."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    elif is_causal:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first)
        s = s.masked_fill(later, float("-inf"))
    return s


def _math_block_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float], mask=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for first, end in _row_tiles(q, k):
        tile_mask = None if mask is None else mask[..., first:end, :]
        s = _math_scores(q[..., first:end, :], k, is_causal, scale, tile_mask, first)
        lse = s.logsumexp(-1)
        finite_lse = lse.masked_fill(lse.isneginf(), 0.0)  # an empty row: exp(-inf - 0) = 0, not nan
        outs.append(((s - finite_lse.unsqueeze(-1)).exp() @ v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _math_block_backward(dout, q, k, v, out, lse, is_causal: bool, scale: Optional[float], mask=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dqs = []
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for first, end in _row_tiles(q, k):
        rows = slice(first, end)
        tile_mask = None if mask is None else mask[..., rows, :]
        p = (_math_scores(q[..., rows, :], k, is_causal, scale, tile_mask, first)
             - lse[..., rows].unsqueeze(-1)).exp()
        dout_t = dout[..., rows, :].float()
        dv += p.transpose(-1, -2) @ dout_t
        dp = dout_t @ v.float().transpose(-1, -2)
        ds = p * (dp - (dout_t * out[..., rows, :].float()).sum(-1, keepdim=True)) * scale
        dqs.append((ds @ k.float()).to(q.dtype))
        dk += ds.transpose(-1, -2) @ q[..., rows, :].float()
    return torch.cat(dqs, dim=2), dk.to(k.dtype), dv.to(v.dtype)


def _block_kernels(q: Tensor, masked: bool) -> tuple[Callable, Callable]:
    """The (forward, backward) block kernels for ``q``'s device and dtype, and whether blocks carry masks."""
    if q.device.type == "cpu":
        return _cpu_block_forward, _cpu_block_backward
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and not masked:
        return _cuda_block_forward, _cuda_block_backward
    return _math_block_forward, _math_block_backward


def _block_pairs(rank: int, src: int, cp_size: int) -> Iterator[tuple[int, int, int, int]]:
    """``(local q chunk, local k/v chunk of rank src, global q chunk, global k/v chunk)`` for each block of rank
    ``rank``'s queries against rank ``src``'s keys that causality does not mask entirely."""
    for qi, q_chunk in enumerate(_chunk_ids(rank, cp_size)):
        for ki, kv_chunk in enumerate(_chunk_ids(src, cp_size)):
            if kv_chunk <= q_chunk:
                yield qi, ki, q_chunk, kv_chunk


def _document_mask(doc_ids: Optional[Tensor], q_chunk: int, kv_chunk: int, cp_size: int) -> Optional[Tensor]:
    """The block's bool mask ``[B, 1, L, L]`` (True: may attend) under document masking: same document, and on
    the diagonal block key not after query. None without ``doc_ids`` (whole-sequence ``[B, S]``)."""
    if doc_ids is None:
        return None
    chunks = doc_ids.chunk(2 * cp_size, dim=1)
    return _allowed(chunks[q_chunk], chunks[kv_chunk], diagonal=q_chunk == kv_chunk)


def _allowed(doc_q: Tensor, doc_k: Tensor, diagonal: bool) -> Tensor:
    """``[B, 1, Lq, Lk]``: query i may see key j (same document; on a diagonal block also ``j <= i``)."""
    allowed = doc_q.unsqueeze(-1) == doc_k.unsqueeze(-2)
    if diagonal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return allowed.unsqueeze(1)


def _repeat_heads(x: Tensor, rep: int) -> Tensor:
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _sum_heads(g: Tensor, rep: int) -> Tensor:
    return g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else g


def _merge(acc: Optional[tuple[Tensor, Tensor]], out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Fold one block's ``(out, lse)`` into the running fp32 ``(out, lse)`` of a query chunk."""
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    # Rows still empty under document masking (both lse -inf) keep weight 0 instead of exp(-inf + inf) = nan.
    finite_lse = new_lse.masked_fill(new_lse.isneginf(), 0.0)
    new_out = (acc_out * (acc_lse - finite_lse).exp().unsqueeze(-1)
               + out.float() * (lse - finite_lse).exp().unsqueeze(-1))
    return new_out, new_lse


# ----------------------------------------------------------------------------------------------------------------
# moving k/v to the queries and dk/dv back to their owners
# ----------------------------------------------------------------------------------------------------------------


class _AllGather:
    """``cp_rotate = allgather``: every rank's k/v gathered at once; dk/dv contributions reduce-scattered."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.grads: list[Tensor] = []

    def kv_blocks(self, kv: Tensor) -> Iterator[tuple[int, Tensor]]:
        """``(source rank, its k/v)`` for every rank, this rank's first. ``kv``: ``[2, B, H, S_local, D]``."""
        gathered = kv.new_empty((self.size * kv.shape[0], *kv.shape[1:]))
        _all_gather_single(gathered, kv.contiguous(), group=self.group)
        gathered = gathered.unflatten(0, (self.size, kv.shape[0]))
        for step in range(self.size):
            src = (self.rank - step) % self.size
            yield src, gathered[src]

    def send_grad(self, dkv: Tensor) -> None:
        """This rank's dk/dv contribution for the k/v ``kv_blocks`` last yielded."""
        self.grads.append(dkv)

    def finish_grads(self) -> Tensor:
        """The sum over all ranks of the contributions to this rank's k/v."""
        # Contributions in source-rank order: step s held rank (rank - s).
        by_src = [self.grads[(self.rank - src) % self.size] for src in range(self.size)]
        total = torch.cat(by_src)
        out = total.new_empty(by_src[0].shape)
        _reduce_scatter_single(out, total, group=self.group)
        return out


class _Ring:
    """``cp_rotate = alltoall``: k/v travel around the ring, one step at a time, and so do the dk/dv
    accumulators, each ending at the rank that owns those k/v."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.pending_grad: Optional[tuple[Tensor, list, Tensor]] = None

    def _shift(self, t: Tensor, tag: int) -> tuple[Tensor, list, Tensor]:
        """Start sending ``t`` to the next rank and receiving the previous rank's; ``_wait`` gives the latter."""
        t = t.contiguous()
        recv = torch.empty_like(t)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ])
        return recv, works, t  # t is kept referenced until the send is waited on

    @staticmethod
    def _wait(pending: tuple[Tensor, list, Tensor]) -> Tensor:
        recv, works, _ = pending
        for work in works:
            work.wait()
        return recv

    def kv_blocks(self, kv: Tensor) -> Iterator[tuple[int, Tensor]]:
        """``(source rank, its k/v)`` for every rank, this rank's first; the next k/v arrive while the caller
        computes on the current ones."""
        for step in range(self.size):
            pending = self._shift(kv, _KV_TAG) if step < self.size - 1 else None
            yield (self.rank - step) % self.size, kv
            if pending is not None:
                kv = self._wait(pending)

    def send_grad(self, dkv: Tensor) -> None:
        """Add this rank's contribution for the k/v ``kv_blocks`` last yielded to the accumulator that arrived
        with them, and pass it on."""
        if self.pending_grad is not None:
            dkv = dkv + self._wait(self.pending_grad)
        self.pending_grad = self._shift(dkv, _GRAD_TAG)

    def finish_grads(self) -> Tensor:
        """This rank's k/v gradient accumulator, back after visiting every rank."""
        return self._wait(self.pending_grad)


def _rotation(rotate: str, group: dist.ProcessGroup):
    return _AllGather(group) if rotate == "allgather" else _Ring(group)


# ----------------------------------------------------------------------------------------------------------------
# ring attention
# ----------------------------------------------------------------------------------------------------------------


def _resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group called ``group_name`` (torch keeps the name -> group registry of its functional
    collectives privately; this is the one place Tessera reads it)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


# Ring attention is one operator (with its own backward operator) rather than a Python autograd function, so
# that whatever looks at the operators of a block's forward sees it whole: per-op activation checkpointing
# (parallelize/activation_checkpoint.py) saves its output and log-sum-exp, as it saves a plain attention kernel's,
# instead of every block kernel's partial output inside the ring, and does not rerun its collectives when the
# block is recomputed; torch.compile keeps it opaque (its fake implementation gives the output shapes).


@torch.library.custom_op("tessera::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, rotate: str, scale: Optional[float],
                   doc_ids: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Causal attention of the local load-balanced q chunks against the whole sequence (see the module doc).

    q ``[B, Hq, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` -> out ``[B, Hq, S_local, D]`` and the fp32
    log-sum-exp of each query row ``[B, Hq, S_local]``; ``doc_ids``: None, or the whole sequence's document ids
    ``[B, S]`` (document masking); ``group_name`` names the cp group.
    """
    group = _resolve_group(group_name)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    block_forward, _ = _block_kernels(q, masked=doc_ids is not None)
    rep = q.shape[1] // k.shape[1]
    q_chunks = q.chunk(2, dim=2)
    merged: list[Optional[tuple[Tensor, Tensor]]] = [None, None]
    for src, kv in _rotation(rotate, group).kv_blocks(torch.stack([k, v])):
        k_chunks, v_chunks = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for qi, ki, q_chunk, kv_chunk in _block_pairs(rank, src, size):
            out, lse = block_forward(
                q_chunks[qi], _repeat_heads(k_chunks[ki], rep), _repeat_heads(v_chunks[ki], rep),
                kv_chunk == q_chunk, scale, _document_mask(doc_ids, q_chunk, kv_chunk, size),
            )
            merged[qi] = _merge(merged[qi], out, lse)
    out = torch.cat([m[0] for m in merged], dim=2).to(q.dtype)
    return out, torch.cat([m[1].float() for m in merged], dim=2)


@ring_attention.register_fake
def _(q, k, v, group_name, rotate, scale, doc_ids):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tessera::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            group_name: str, rotate: str, scale: Optional[float],
                            doc_ids: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ``ring_attention`` given the gradient of its output, its output and log-sum-exp."""
    group = _resolve_group(group_name)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    _, block_backward = _block_kernels(q, masked=doc_ids is not None)
    rep = q.shape[1] // k.shape[1]
    q_chunks, out_chunks = q.chunk(2, dim=2), out.chunk(2, dim=2)
    lse_chunks = [c.contiguous() for c in lse.chunk(2, dim=2)]
    dout_chunks = dout.contiguous().chunk(2, dim=2)
    dq = [torch.zeros_like(c, dtype=torch.float32) for c in q_chunks]
    rotation = _rotation(rotate, group)
    for src, kv in rotation.kv_blocks(torch.stack([k, v])):
        k_chunks, v_chunks = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        dk_chunks, dv_chunks = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
        for qi, ki, q_chunk, kv_chunk in _block_pairs(rank, src, size):
            gq, gk, gv = block_backward(
                dout_chunks[qi], q_chunks[qi], _repeat_heads(k_chunks[ki], rep),
                _repeat_heads(v_chunks[ki], rep), out_chunks[qi], lse_chunks[qi], kv_chunk == q_chunk, scale,
                _document_mask(doc_ids, q_chunk, kv_chunk, size),
            )
            dq[qi].add_(gq)
            dk_chunks[ki].add_(_sum_heads(gk, rep))
            dv_chunks[ki].add_(_sum_heads(gv, rep))
        rotation.send_grad(dkv)
    dkv = rotation.finish_grads()
    # Fresh tensors each (an operator's outputs may not alias one another).
    return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group_name, rotate, scale, doc_ids):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, rotate, scale, doc_ids = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_ids)
    ctx.group_name, ctx.rotate, ctx.scale = group_name, rotate, scale


def _ring_backward(ctx, dout: Tensor, _dlse: Optional[Tensor]):
    q, k, v, out, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.group_name, ctx.rotate, ctx.scale, doc_ids)
    return dq, dk, dv, None, None, None, None


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup_context)


def context_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: Optional[dist.ProcessGroup],
    rotate: str = "allgather",
    scale: Optional[float] = None,
    doc_ids: Optional[Tensor] = None,
) -> Tensor:
    """Causal attention of this rank's queries against the whole sequence, split over ``cp_group``.

    ``q [B, Hq, S_local, D]``, ``k, v [B, Hkv, S_local, D]`` (``Hq`` a multiple of ``Hkv``) are this rank's
    ``shard_sequence`` parts of the sequence (two chunks); returns ``[B, Hq, S_local, D]``, this rank's part of
    the causal attention over the whole sequence, and is differentiable in q, k and v. ``rotate`` is how k/v
    reach the other ranks: ``allgather`` or ``alltoall`` (a point-to-point ring); ``scale`` defaults to
    ``D ** -0.5``. ``doc_ids [B, S]`` (the *whole* sequence's document ids, the same on every rank; not
    sharded) restricts each query to keys of its own document. With a group of one rank this is plain
    ``scaled_dot_product_attention``.

    The ring is one operator, ``tessera::ring_attention`` (its backward another): ``torch.compile(fullgraph=True)``
    traces it with either rotation, as an opaque call, and per-op activation checkpointing saves its output.
    """
    if rotate not in ROTATE_METHODS:
        raise ValueError(
            f"parallelism.cp_rotate: unknown rotation {rotate!r}; choose one of {', '.join(ROTATE_METHODS)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    size = dist.get_world_size(cp_group)
    if doc_ids is not None:
        assert doc_ids.shape == (q.shape[0], q.shape[2] * size), (
            f"doc_ids {tuple(doc_ids.shape)}: expected the whole sequence's, {(q.shape[0], q.shape[2] * size)}"
        )
    if size == 1:
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        mask = dense_causal_mask(doc_ids, q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = cp_group if cp_group is not None else dist.group.WORLD
    return ring_attention(q, k, v, group.group_name, rotate, scale, doc_ids)[0]
