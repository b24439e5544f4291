"""Expert parallelism: a MoE layer's routed experts split over the ``ep`` ranks, tokens sent to them by all-to-all.

Each of the ``ep`` ranks holds ``num_experts / ep`` whole experts (their stacked weights are DTensors sharded on
the expert dimension over the ``ep`` mesh; FSDP2 shards them further over the ranks holding the same experts). In
a forward, every rank routes its own tokens (models/moe.py sorts the token-expert pairs by expert), then:

1. dispatch: the rows for rank r's experts go to rank r (one all-to-all with variable splits; the row counts
   per expert are exchanged first, one small all-to-all and one host sync);
2. the rows received, grouped by source rank, are regrouped by local expert and run as one grouped GEMM;
3. combine: the results go back to the ranks their tokens came from (the reverse all-to-all), in the order they
   were sent, for the MoE layer to weight and add up.

Both all-to-alls are differentiable: the backward sends the gradients the reverse way. They are torch's functional
collectives (``_functional_collectives``, a private module: its public predecessor in torch.distributed.nn is
deprecated); ``_all_to_all`` is the one place that calls them. The split sizes live on the host, so this part of
the forward is left out of compiled graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import Shard, distribute_tensor

from models.moe import MoE


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Rows ``input_splits[r]`` of ``x`` to rank r, ``output_splits[r]`` rows from it; differentiable."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


class AllToAllDispatch:
    """``MoE.run_experts`` under expert parallelism: ``(experts, x, counts) -> y`` where ``x [T, dim]`` holds this
    rank's token-expert pairs sorted by (global) expert, ``counts [num_experts]`` their number per expert, and
    ``y`` the experts' outputs in the rows of ``x``."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        assert num_experts % self.ep == 0, (num_experts, self.ep)
        self.local = num_experts // self.ep
        # Not traced by torch.compile (host-side split sizes); wrapped here, not at import: the decorator loads
        # Dynamo, a second of every process's start-up.
        self._dispatch = torch.compiler.disable(self._dispatch)

    def __call__(self, experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
        return self._dispatch(experts, x, counts)

    def _dispatch(self, experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
        ep, local = self.ep, self.local
        # received[s, e]: the rows rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        sizes = torch.cat([counts.view(ep, local).sum(1), received.view(ep, local).sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        rows = _all_to_all(x, recv, send, self.group)
        # Regroup the rows from (source rank, local expert) order into (local expert, source rank) order.
        segment = torch.arange(ep * local, device=x.device)  # s * local + e
        key = torch.repeat_interleave(segment % local * ep + segment // local, received.view(-1),
                                      output_size=rows.shape[0])
        order = torch.argsort(key, stable=True)
        out = experts(rows[order], received.view(ep, local).sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _all_to_all(out[back], send, recv, self.group)


def apply_ep(moe_layers: list[MoE], ep_mesh) -> None:
    """Shard each layer's routed experts over ``ep_mesh`` (the expert dimension, Shard(0)) and route its tokens to
    them by all-to-all. The layers are on the meta device; parallelize/init.py initializes the shards as one
    process initializes the whole experts."""
    for moe in moe_layers:
        experts = moe.experts
        assert experts.num_experts % ep_mesh.size() == 0, (experts.num_experts, ep_mesh.size())
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]),
                                                          requires_grad=param.requires_grad))
        moe.run_experts = AllToAllDispatch(ep_mesh.get_group(), experts.num_experts)
