"""Load balancing of a model's Mixture-of-Experts layers (models/moe.py) over a training run.

The layers' mean auxiliary loss, weighted by model.moe_aux_loss_coeff, is trained as if added to each microbatch's
loss (not to the logged loss, which stays the cross-entropy): each layer gets its share of that weight and adds
the gradient in backward (models/moe.py), on whichever pipeline stage it is. Over several ranks, each forward's
loss is that of its tokens on every rank, as one process computes it on the whole batch (each layer sums its
expert counts and probabilities over the ranks holding the other tokens: one small all-reduce per layer and
forward, only when the loss is trained). Per optimizer step: the tokens each expert
received are summed over the ranks holding other tokens, each layer's expert bias (when its flavor balances
without an auxiliary loss) moves towards its less loaded experts, and the step's expert load (per layer: the
busiest expert's tokens over the mean) is kept for the next log.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.moe import MoE


class LoadBalance:
    """The MoE layers of this rank's model parts, and what the loop does with them (nothing for a dense model)."""

    def __init__(self, parts: list[nn.Module], aux_loss_coeff: float, groups: list[dist.ProcessGroup],
                 device: torch.device, total_layers: int, microbatches: int, loss_scale: float,
                 pp_group: Optional[dist.ProcessGroup] = None):
        """``groups``: process groups whose ranks together hold every token of a step (dp x cp, and tp when the
        MoE layers run on sequence shards); the expert counts and, when it is trained, the auxiliary loss's
        statistics are summed over them.
        The auxiliary loss is the mean over the model's ``total_layers`` MoE layers (every pipeline stage's) and
        over a step's ``microbatches`` forwards; backward runs the loss times ``loss_scale``. ``pp_group``: the
        pipeline stages' group, over which the logged auxiliary loss is averaged."""
        self.layers = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
        self.groups = groups
        self.total_layers = total_layers
        self.pp_group = pp_group
        self.device = device
        if aux_loss_coeff:  # the ranks' gradients are summed, as are their terms of each layer's loss
            weight = aux_loss_coeff * loss_scale / (total_layers * microbatches)
            for layer in self.layers:
                layer.aux_loss_weight = weight
                layer.sum_over_ranks = self._sum_over_ranks if groups else None
        self._load: Optional[Tensor] = None
        self.last_counts: Optional[Tensor] = None
        """The last step's tokens per expert, summed over the ranks: ``[layers, experts]``."""

    def _sum_over_ranks(self, t: Tensor) -> Tensor:
        """``t`` (a fresh tensor: a layer's statistics, the step's counts) summed over the token groups, in place;
        compiled forwards trace the all-reduce."""
        for group in self.groups:
            dist.all_reduce(t, group=group)
        return t

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer step: the step's expert counts summed over the ranks, each layer's bias update, the
        step's load kept for the log (device tensors: no host sync here)."""
        if not self.layers:
            return
        counts = self._sum_over_ranks(torch.stack([layer.tokens_per_expert for layer in self.layers]))
        self.last_counts = counts.clone()
        mean = counts.mean(dim=1).clamp(min=1e-9)
        self._load = counts.max(dim=1).values / mean
        for layer, count in zip(self.layers, counts):
            layer.tokens_per_expert.copy_(count)
            layer.update_expert_bias()

    def discard_counts(self) -> None:
        """Forget the tokens counted since the last step (an evaluation's)."""
        for layer in self.layers:
            layer.tokens_per_expert.zero_()

    def log_values(self) -> dict:
        """The metrics of the window since the previous log: ``moe_aux_loss`` (the mean over every MoE layer, on
        every pipeline stage, and the window's training forwards; an untrained loss, each rank's own, also over
        the ranks), ``expert_load`` (the last step's, per layer of this rank) and ``expert_load_max``; {} for a
        dense model. Every rank calls it, after the same steps."""
        if not self.total_layers:
            return {}
        sums = torch.zeros(2, device=self.device)  # [auxiliary losses, forwards], over this rank's layers
        for layer in self.layers:
            sums += layer.aux_loss_sum
            layer.aux_loss_sum.zero_()
        for group in [*self.groups, *([self.pp_group] if self.pp_group is not None else [])]:
            dist.all_reduce(sums, group=group)  # a stage may hold no MoE layer: every rank of the group joins
        total, forwards = sums.tolist()
        values = {"moe_aux_loss": total / forwards} if forwards else {}
        if self._load is not None:
            load = self._load.tolist()
            values.update(expert_load=load, expert_load_max=max(load))
        return values
