"""The training loss: the sum of the token cross-entropies (the trainer divides it by the step's global count
of target tokens).

Two ways to compute it:

* ``cross_entropy_sum(logits, labels)``: from the logits the model returns (the output projection inside the
  model), upcast to float32. At a 128k vocabulary and 8192 tokens the logits are 2 GiB in bf16, 4 GiB once
  upcast, and their gradient as much again.
* ``linear_cross_entropy_sum(h, weight, labels, chunk)``: the output projection fused with the loss, over
  ``chunk`` tokens at a time (``training.loss_chunk_tokens``). The forward computes each chunk's logits,
  its loss and at once its gradients (softmax minus one-hot, then the two matmuls of the projection's
  backward), and keeps only the gradients of the hidden state and of the weight; the backward scales them.
  The logits of the whole batch never exist, and no matmul is recomputed (the same FLOPs as the plain way).
  The matmuls run in autocast's dtype when autocast is on (the hidden state and the weight are float32
  then), else in the hidden state's. The weight's gradient is accumulated over chunks in the weight's dtype:
  float32 on CPU and under autocast; bf16 under FSDP's mixed precision, rounded once per chunk where the
  plain way's single matmul rounds once (docs/configuration.md), because a float32 accumulator would add 2 GiB
  at Llama-3's vocabulary and dimension 4096, at the step's peak. Under tensor parallelism each rank holds a
  slice of the vocabulary and the log-sum-exp is reduced over the TP group (parallelize/tensor_parallel.py
  ``vocab_parallel_linear_cross_entropy_sum``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of the token cross-entropies of ``logits [B, S, V]`` against ``labels [B, S]``, in float32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def _chunk_loss(h: Tensor, weight: Tensor, labels: Tensor, want_grad: bool, vocab_offset: int = 0,
                group: Optional[dist.ProcessGroup] = None):
    """Loss sum of one chunk (``h [c, D]``, ``labels [c]``) and, with ``want_grad``, d(loss)/d(logits) in h's
    dtype (zero on ignored rows).

    With ``group``, ``weight`` holds the rows ``vocab_offset ...`` of a vocabulary sharded over the group's
    ranks (vocabulary-parallel, as TP's colwise output projection holds it): the log-sum-exp and the target
    logits are reduced over the group (two small all-reduces per chunk), every rank returns the same loss, and
    the gradient is that of this rank's logits."""
    logits = (h @ weight.t()).float()
    valid = labels != IGNORE_INDEX
    local = labels - vocab_offset
    mine = valid & (local >= 0) & (local < logits.shape[1])  # the target's logit is on this rank
    safe = torch.where(mine, local, 0)
    target = torch.where(mine, logits.gather(1, safe[:, None]).squeeze(1), 0.0)
    if group is None:
        lse = torch.logsumexp(logits, dim=-1)
        probs = logits.sub_(lse[:, None]).exp_() if want_grad else None  # softmax, in place of the logits
    else:
        top = logits.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        probs = logits.sub_(top[:, None]).exp_()  # exp(logit - max), in place of the logits
        sums = torch.stack([probs.sum(dim=-1), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse, target = top + sums[0].log(), sums[1]
        probs.div_(sums[0][:, None])
    loss = torch.where(valid, lse - target, 0.0).sum()
    if not want_grad:
        return loss, None
    grad = probs
    grad[torch.arange(grad.shape[0], device=grad.device), safe] -= mine.to(grad.dtype)
    grad.mul_(valid[:, None])
    return loss, grad.to(h.dtype)


def _compute_dtype(h: Tensor) -> torch.dtype:
    """The dtype of the matmuls: autocast's when it is on (the hidden state and weight are float32 then),
    else the hidden state's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _chunked(h: Tensor, weight: Tensor, labels: Tensor, chunk: int, grad_h: Optional[Tensor] = None,
             grad_w: Optional[Tensor] = None, vocab_offset: int = 0,
             group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The loss sum of ``h [N, D] @ weight.T`` against ``labels [N]``, ``chunk`` tokens at a time; fills
    ``grad_h`` and accumulates into ``grad_w`` (zeros) when they are given. ``vocab_offset`` and ``group``:
    see ``_chunk_loss``."""
    dtype = _compute_dtype(h)
    w = weight.to(dtype)  # cast once (a no-op without autocast)
    want_grad = grad_h is not None or grad_w is not None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        hc, yc = h[start:start + chunk].to(dtype), labels[start:start + chunk]
        loss, g = _chunk_loss(hc, w, yc, want_grad, vocab_offset, group)
        total += loss
        if grad_h is not None:
            grad_h[start:start + chunk] = g @ w
        if grad_w is not None:
            if grad_w.dtype == dtype:
                grad_w.addmm_(g.t(), hc)
            else:  # autocast: a bf16 product added to the float32 gradient
                grad_w.add_(g.t() @ hc)
    return total


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, chunk: int, vocab_offset: int,
                group: Optional[dist.ProcessGroup]) -> Tensor:
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        # Under autocast the weight's gradient adds up in fp32 (the weight is fp32, or a split bf16 weight,
        # parallelize/bf16_weights.py, whose gradient is this sum rounded to bf16 at the end of the backward).
        acc = torch.float32 if torch.is_autocast_enabled(h.device.type) else weight.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        total = _chunked(h, weight, labels, chunk, grad_h, grad_w, vocab_offset, group)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.scaled_by = None
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if ctx.scaled_by is None:
            # Scaled in place (a second copy of the weight's gradient would cost V x D more bytes at the peak),
            # through .data, so that the saved tensors' version stays as saved: a pipeline schedule that splits
            # the backward (zero-bubble) runs this node again, for the weight after the input.
            for g in (grad_h, grad_w):
                if g is not None:
                    g.data.mul_(grad_out.to(g.dtype))
            ctx.scaled_by = grad_out
        else:  # the second run replays the same incoming gradient: the saved gradients are scaled already
            torch._assert_async(ctx.scaled_by == grad_out, "fused loss: backward run again with another gradient")
        if grad_w is not None and grad_w.dtype != ctx.weight_dtype:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy_sum(h: Tensor, weight: Tensor, labels: Tensor, chunk: int, vocab_offset: int = 0,
                             group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """``cross_entropy_sum(h @ weight.T, labels)`` over ``chunk`` tokens at a time: ``h [B, S, D]`` (the final
    norm's output), ``weight [V, D]`` (the output projection), ``labels [B, S]``. Without gradients (evaluation)
    only the losses are computed.

    Vocabulary-parallel with ``group``: ``weight`` is this rank's rows ``vocab_offset ...`` of the projection,
    ``h`` the whole (replicated) hidden state; the loss is the full one on every rank, and the gradient of
    ``h`` is this rank's part of a sum over the group (parallelize/tensor_parallel.py reduces it)."""
    assert chunk > 0, chunk
    h2, y = h.flatten(0, 1), labels.flatten(0, 1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropySum.apply(h2, weight, y, chunk, vocab_offset, group)
    return _chunked(h2, weight, y, chunk, vocab_offset=vocab_offset, group=group)
