"""Mixture-of-Experts feed-forward layer that any model family can use.

Token-choice top-k routing: a linear router scores every expert for every token (softmax, or sigmoid as in
DeepSeek-V3); each token goes to its ``top_k`` experts, weighted by their scores (renormalized to sum to 1 when
``route_norm``). Routing is dropless: every expert takes every token routed to it. The experts run as one grouped
GEMM over the tokens sorted by expert (``torch._grouped_mm``; a loop of per-expert matmuls, the same arithmetic,
where it is missing). Optional shared experts see every token.

Load balancing, both optional:
- the auxiliary loss of Switch/GShard, ``E * sum_e f_e * P_e`` (f_e: the fraction of tokens routed to expert e,
  so that the f_e add up to top_k; P_e: its mean router probability), as transformers' load_balancing_loss_func
  computes it, so that a Hugging Face config's router_aux_loss_coef means the same here. It is trained with the
  weight ``aux_loss_weight`` (the trainer's): its gradient enters in backward through the layer's output, as
  Megatron-Core does, so that it trains on any pipeline stage without joining the last stage's loss. Over
  several ranks (``sum_over_ranks``, set when it is trained) f_e and P_e are those of the forward's tokens on
  every rank, as one process computes them on the whole batch: each rank trains the global f_e times its own
  tokens' share of P_e (``aux_loss``), terms that add up over the ranks to the global loss (the value logged);
- DeepSeek-V3's auxiliary-loss-free balancing: an ``expert_bias`` added to the scores for the choice of experts
  only (not to the weights), moved after each optimizer step towards the under-loaded experts
  (``update_expert_bias``, from the tokens each expert received over the step, ``tokens_per_expert``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEArgs:
    """Hyperparameters of a MoE layer."""

    num_experts: int = 8
    """Routed experts."""
    top_k: int = 2
    """Experts each token is routed to."""
    hidden_dim: int = 512
    """SwiGLU hidden size of one expert."""
    num_shared_experts: int = 0
    """Experts every token goes through (one SwiGLU of num_shared_experts x hidden_dim)."""
    score_func: str = "softmax"
    """Router scores: softmax over the experts, or an independent sigmoid per expert."""
    route_norm: bool = False
    """Renormalize each token's top-k weights to sum to 1."""
    route_scale: float = 1.0
    """Factor on the routed experts' weights."""
    load_balance_coeff: Optional[float] = None
    """Step of the auxiliary-loss-free expert bias update; None: no bias."""

    def __post_init__(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: {self.score_func!r} is not one of {', '.join(SCORE_FUNCS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: {self.top_k} must be between 1 and the {self.num_experts} experts")


_RECOMPUTING = {"active": False}  # inside an activation checkpoint's recomputation (see ``recomputing``)


@contextlib.contextmanager
def recomputing():
    """Marks an activation checkpoint's recomputation of a forward in backward: a MoE layer run again there does not
    count its tokens a second time. (Compiled per-op checkpointing recomputes without running the Python forward:
    parallelize/compile.py has Dynamo skip the count there.)"""
    before = _RECOMPUTING["active"]
    _RECOMPUTING["active"] = True
    try:
        yield
    finally:
        _RECOMPUTING["active"] = before


_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}  # grouped_mm_works's answers (a plain dict: compile reads it)


def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (forward and backward) on this device type and dtype in this torch. Only
    bf16 is tried (what its compiled form takes), on CUDA only on compute capability >= 9.0. Probed once;
    MoE.init_weights asks before any compiled forward does."""
    key = (device_type, dtype)
    if key not in _GROUPED_MM:
        works = hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and (
            device_type != "cuda" or torch.cuda.get_device_capability() >= (9, 0))
        if works:
            try:
                x = torch.ones(4, 16, device=device_type, dtype=dtype, requires_grad=True)
                w = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
                offs = torch.tensor([2, 4], device=device_type, dtype=torch.int32)
                torch._grouped_mm(x, w, offs=offs).mul(2).sum().backward()
            except (RuntimeError, NotImplementedError):
                works = False
        _GROUPED_MM[key] = works
    return _GROUPED_MM[key]


@torch.library.custom_op("tessera::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``grouped_matmul`` as a loop of per-group matmuls; an operator, so that compiled code calls it whole (its
    group sizes are read on the host, which would break a compiled graph)."""
    chunks = torch.split(x, counts.tolist())
    return torch.cat([chunk @ w[g].T for g, chunk in enumerate(chunks)])


@_grouped_mm_loop.register_fake
def _(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("tessera::grouped_mm_loop_weight_grad", mutates_args=())
def _grouped_mm_loop_weight_grad(grad: Tensor, x: Tensor, counts: Tensor, groups: int) -> Tensor:
    """The gradient of each group's weight: ``grad_g.T @ x_g``, ``[groups, out, in]``."""
    sizes = counts.tolist()
    return torch.stack([g.T @ c for g, c in zip(torch.split(grad, sizes), torch.split(x, sizes))]) if groups else \
        grad.new_empty(0, grad.shape[1], x.shape[1])


@_grouped_mm_loop_weight_grad.register_fake
def _(grad: Tensor, x: Tensor, counts: Tensor, groups: int) -> Tensor:
    return grad.new_empty(groups, grad.shape[1], x.shape[1])


def _loop_setup(ctx, inputs, output) -> None:
    x, w, counts = inputs
    ctx.save_for_backward(x, w, counts)


def _loop_backward(ctx, grad: Tensor):
    x, w, counts = ctx.saved_tensors
    grad_x = _grouped_mm_loop(grad, w.transpose(1, 2).contiguous(), counts)
    return grad_x, _grouped_mm_loop_weight_grad(grad.contiguous(), x, counts, w.shape[0]), None


_grouped_mm_loop.register_autograd(_loop_backward, setup_context=_loop_setup)


def grouped_matmul(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``x [T, in]`` (rows sorted by group) times each group's ``w [G, out, in]`` transposed: rows of group g are
    ``x[offset_g : offset_g + counts[g]] @ w[g].T``. One grouped GEMM where torch has it for this device and dtype
    (bf16; on CUDA, compute capability >= 9.0), else a loop over the groups. One group (shared experts, one expert
    per rank) is one plain GEMM: no offsets (Inductor folds a constant one into an int64 tensor _grouped_mm refuses)."""
    if w.shape[0] == 1:
        return x @ w[0].T
    if grouped_mm_works(x.device.type, x.dtype):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return _grouped_mm_loop(x, w, counts)


class _AuxLossGradient(torch.autograd.Function):
    """The identity on a MoE layer's output, which gives the layer's auxiliary loss the gradient ``weight`` when the
    output's gradient arrives: the auxiliary loss trains as if ``weight * aux_loss`` had been added to the loss."""

    @staticmethod
    def forward(ctx, out: Tensor, aux_loss: Tensor, weight: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.weight), None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs with stacked weights: w1 (gate) and w3 (up) ``[E, hidden, dim]``, w2 (down)
    ``[E, dim, hidden]``, each expert's slice laid out as an ``nn.Linear`` weight."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``x [T, dim]``, its rows sorted by expert, ``counts [E]`` rows per expert -> ``[T, dim]``. Under expert
        parallelism the weights are DTensors and this rank computes with its own experts (their local shard)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what autocast does for nn.Linear: the GEMMs in its dtype
            dtype = torch.get_autocast_dtype(device)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        h = F.silu(grouped_matmul(x, w1, counts)) * grouped_matmul(x, w3, counts)
        return grouped_matmul(h, w2, counts)


class TokenChoiceRouter(nn.Module):
    """Scores every expert for every token and picks each token's ``top_k``."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)

    def forward(self, x: Tensor, expert_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """``x [T, dim]`` -> (weights ``[T, k]`` fp32, experts ``[T, k]``, fp32 probabilities ``[T, E]`` for the
        auxiliary loss)."""
        a = self.args
        logits = self.gate(x).float()
        scores = torch.softmax(logits, dim=-1) if a.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        _, experts = torch.topk(choice, a.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores if a.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return weights * a.route_scale, experts, probs


class MoE(nn.Module):
    """The MoE feed-forward layer: ``x [B, S, dim] -> [B, S, dim]``. After a forward, ``aux_loss`` holds this
    rank's term of the layer's auxiliary load-balancing loss (the whole loss on one process) and
    ``tokens_per_expert`` has the tokens routed to each expert added."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = (GroupedExperts(dim, args.hidden_dim * args.num_shared_experts, 1)
                               if args.num_shared_experts else None)
        # The choice bias is training state (checkpointed); the counts are the current step's, summed over its
        # microbatches until update_expert_bias (the trainer all-reduces them over the ranks first).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts) if args.load_balance_coeff is not None
                             else None, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # The training forwards' auxiliary losses, summed, and how many forwards: for the log (the trainer resets it).
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)
        self.aux_loss: Optional[Tensor] = None
        # The auxiliary loss's weight in the trained loss (0: not trained); the trainer sets it (see _AuxLossGradient).
        self.aux_loss_weight = 0.0
        # Sums a tensor over the ranks holding the step's other tokens (set by the trainer when the auxiliary loss
        # is trained over several ranks); None: this rank's tokens are the forward's.
        self.sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None
        # How the routed experts run on the sorted token-expert pairs: ``run_experts(experts, x, counts)``; None
        # runs them here (a parallel plan sets it: expert parallelism's all-to-all dispatch).
        self.run_experts: Optional[Callable[[nn.Module, Tensor, Tensor], Tensor]] = None

    def init_weights(self, init_std: float, buffer_device: Optional[torch.device] = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device if buffer_device is not None else self.tokens_per_expert.device
        # Answered now, outside any compiled forward, for the device the forward runs on (the parameters are in CPU
        # memory under FSDP's CPU offload).
        for device_type in {device.type, self.experts.w1.device.type}:
            for dtype in (self.experts.w1.dtype, torch.bfloat16):
                grouped_mm_works(device_type, dtype)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.args.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)
        self.aux_loss_sum = torch.zeros(2, device=device)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        a = self.args
        weights, experts, probs = self.router(x, self.expert_bias)
        flat = experts.reshape(-1)
        # A fixed output size, which compiles without a graph break (bincount's is data-dependent); deterministic
        # on CUDA (histc is not: it fails under debug.deterministic).
        counts = torch.zeros(a.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        training = torch.is_grad_enabled()  # an evaluation's forwards run without gradients
        self.aux_loss, logged = self._aux_loss(counts, probs, training)
        if not _RECOMPUTING["active"]:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
                if training:
                    self.aux_loss_sum.add_(torch.stack([logged, torch.ones_like(logged)]))
        # Dispatch: the token-expert pairs sorted by expert (a stable sort keeps each expert's tokens in order).
        order = torch.argsort(flat, stable=True)
        token = order // a.top_k
        routed = (self.experts(x[token], counts) if self.run_experts is None
                  else self.run_experts(self.experts, x[token], counts))
        routed = routed * weights.reshape(-1)[order, None].to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token, routed.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, torch.tensor([x.shape[0]], device=x.device))
        if self.aux_loss_weight and training:
            out = _AuxLossGradient.apply(out, self.aux_loss, self.aux_loss_weight)
        return out.reshape(shape)

    def _aux_loss(self, counts: Tensor, probs: Tensor, training: bool) -> tuple[Tensor, Tensor]:
        """(this rank's term of the auxiliary loss, the loss's value): ``E * sum_e f_e * P_e`` with f_e the
        fraction of the forward's tokens routed to expert e and P_e the mean of their probabilities for it, summed
        over the ranks by ``sum_over_ranks`` in a training forward. The term, ``E * sum_e f_e * p_e`` with p_e
        this rank's probabilities for e summed and divided by every rank's token count, is what trains: its
        gradient is the global loss's for this rank's tokens."""
        e = self.args.num_experts
        own = probs.sum(dim=0)
        stats = torch.cat([counts.float(), own.detach(), own.new_full((1,), probs.shape[0])])
        if training and self.sum_over_ranks is not None:
            stats = self.sum_over_ranks(stats)
        tokens = stats[2 * e]
        fraction = stats[:e] / tokens
        return e * torch.sum(fraction * own) / tokens, e * torch.sum(fraction * stats[e:2 * e]) / tokens

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After an optimizer step: move the choice bias by ``load_balance_coeff`` towards the experts that got
        fewer tokens than the mean (sign of the difference, centred), and start counting the next step."""
        if self.expert_bias is not None:
            load = self.tokens_per_expert
            delta = self.args.load_balance_coeff * torch.sign(load.mean() - load)
            self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()

    def expert_load(self) -> float:
        """The busiest expert's tokens over the mean (1.0 is perfect balance), from ``tokens_per_expert``."""
        load = self.tokens_per_expert
        mean = load.mean()
        return float(load.max() / mean) if mean > 0 else 0.0
