"""Optimizer and learning-rate schedule.

AdamW with decoupled weight decay on matrices only (norm weights and biases, the 1-D parameters, never
decay), the fused kernel on CUDA, and a warmup-stable-decay (WSD) schedule with linear, cosine or sqrt
decay. Gradient clipping over DTensor gradients on any mesh. With split bf16 weights
(parallelize/bf16_weights.py) the optimizer is ``AdamWWithBf16Weights``: the same update on the fp32 weights
that each bf16 weight and its low half hold, written back as both halves in the same pass.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from engine.config import LRScheduler as LRSchedulerConfig
from engine.config import Optimizer as OptimizerConfig
from parallelize.bf16_weights import local_tensor, master_weight, placed_like, split


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (embeddings and projections) decay, vectors (norms, biases) do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], lows: list[Optional[torch.Tensor]], step_sizes: torch.Tensor,
                 bias_correction2_sqrts: torch.Tensor, decay: torch.Tensor, grad_scale: Optional[torch.Tensor],
                 beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool) -> None:
    """Adam (``decoupled=False``: weight decay added to the gradient) or AdamW, in place, with torch's formulas
    and fp32 numbers: a parameter with a ``lows`` entry is the bf16 high half of its fp32 weight
    (parallelize/bf16_weights.py), which is rebuilt, updated and split again; the others are fp32. Gradients
    of any float dtype are computed on in fp32, divided by ``grad_scale`` (the clip, ``clip_grad_norm_``) if
    given. The scalars come as fp32 tensors (one graph serves every step): ``step_sizes[i]`` and
    ``bias_correction2_sqrts[i]`` per parameter, ``decay`` (1 - lr x weight_decay) for the group. Compiled, each
    parameter's update is one kernel: on a split weight it reads 14 bytes per element (bf16 gradient, both
    halves, the moments) and writes 12, where torch's fused kernel on autocast's fp32 weights reads 16 and writes
    12, besides autocast's casts."""
    for i, (p, g, m, v, low) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, lows)):
        w = master_weight(p, low) if low is not None else p
        g = g.float()
        if grad_scale is not None:
            g = g / grad_scale
        if weight_decay != 0.0:
            if decoupled:
                w = w * decay
            else:
                g = g.add(w, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrts[i]).add_(eps)
        w = w - step_sizes[i] * m / denom
        if low is not None:
            high, new_low = split(w)
            p.copy_(high)
            low.copy_(new_low)
        else:
            p.copy_(w)


class AdamWWithBf16Weights(torch.optim.Optimizer):
    """AdamW (or Adam) over parameters of which some are split bf16 weights (``set_low_halves``;
    parallelize/bf16_weights.py: the matmul weights on one GPU, every FSDP2 shard under
    training.fsdp_bf16_weights, updated shard by shard): each update rebuilds the fp32 weight from the bf16
    parameter and its low half, reads the bf16 gradient, and writes both halves back; the other parameters are
    fp32 as usual. The state is torch's AdamW's (``step``, a float32 tensor on the parameter's device as torch's fused
    kernels keep it, fp32 ``exp_avg`` and ``exp_avg_sq``), made when the optimizer is built, so checkpoints are
    interchangeable with runs without split weights. ``grad_scale`` (a device tensor, set by
    ``clip_grad_norm_``) divides every gradient as the update reads it, as in torch's fused kernels (which also
    write the divided gradient back; this update does not). The scalars of a step (bias corrections, lr x decay)
    are computed on the device in float64 and rounded to fp32, as torch's kernels take Python floats (on CPU the
    same bits as torch's foreach AdamW). ``compiled``: the update runs as torch.compile'd kernels, one per
    parameter (CUDA), else eagerly (tests)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.01,
                 decoupled: bool = True, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled
        self.compiled = compiled
        self.lows: dict[torch.Tensor, torch.Tensor] = {}
        self.grad_scale: Optional[torch.Tensor] = None
        # One launch configuration per kernel (Inductor's default block size), not two benchmarked at the first
        # step: the benchmark runs each kernel on clones of the tensors it writes (the weight halves and moments),
        # which the allocator can place in fresh pages beside the step's freed blocks; those stay reserved.
        self._update = torch.compile(_adam_update, fullgraph=True, dynamic=False,
                                     options={"triton.autotune_pointwise": False}) if compiled else _adam_update
        # The state now: fp32 moments whatever the parameter's dtype (torch's lazy initialization would make them
        # at the first step, and DCP's initialization of an empty state runs a step).
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format),
                }

    def set_low_halves(self, lows: dict[torch.Tensor, torch.Tensor]) -> None:
        """parameter -> low half, for the parameters that hold the bf16 half of a split weight."""
        self.lows = lows

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded moments to their parameter's dtype, bf16 for a split weight: they are put back as
        the fp32 values loaded."""
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        moments = {p: state_dict["state"][i] for i, p in zip(saved, params) if i in state_dict["state"]}
        super().load_state_dict(state_dict)
        for p, state in moments.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    self.state[p][key] = state[key].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, lows, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]  # DTensors (FSDP2): their shards, updated in place
                params.append(local_tensor(p))
                grads.append(local_tensor(p.grad))
                exp_avgs.append(local_tensor(state["exp_avg"]))
                exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
                lows.append(self.lows.get(p))
                steps.append(state["step"])
            if not params:
                continue
            device = params[0].device
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            lr = lr.to(device, torch.float64) if isinstance(lr, torch.Tensor) else \
                torch.full((), lr, dtype=torch.float64, device=device)
            # A few small kernels per group, not per element: float64 math inside the update's kernel would run
            # for every element.
            torch._foreach_add_(steps, 1)
            step = torch.stack(steps).double()
            step_sizes = (lr / (1 - beta1 ** step)).float()
            bias_correction2_sqrts = (1 - beta2 ** step).sqrt().float()
            decay = (1 - lr * group["weight_decay"]).float()
            scale = self.grad_scale.to(device) if self.grad_scale is not None else None
            self._update(params, grads, exp_avgs, exp_avg_sqs, lows, step_sizes, bias_correction2_sqrts, decay,
                         scale, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         decoupled=self.decoupled)
        return loss


class _OnLocalShards:
    """torch's per-tensor Adam/AdamW kernel run on each DTensor parameter's local shard, where the parameter and
    its gradient are placed alike on one mesh (FSDP2's and TP's parameters): the same elementwise update, without
    DTensor's dispatch and sharding propagation for every operation of every tensor (a tenth of a multi-rank
    step's time on CPU, most of it on 2-D meshes). The moments stay DTensors (updated in place through their
    local tensors), so checkpoints hold what torch's own optimizer holds. Other parameters (plain tensors, a
    gradient placed otherwise) take torch's path as they are."""

    @torch.no_grad()
    def step(self, closure=None):
        swapped = []  # (group, index, parameter, its local tensor, its state)
        try:
            for group in self.param_groups:
                for i, p in enumerate(group["params"]):
                    g = p.grad
                    if not (isinstance(p, DTensor) and isinstance(g, DTensor) and g.device_mesh == p.device_mesh
                            and g.placements == p.placements):
                        continue
                    local, held = p.to_local(), self.state.pop(p, {})
                    local.grad = g.to_local()
                    self.state[local] = {k: local_tensor(v) for k, v in held.items()}
                    group["params"][i] = local
                    swapped.append((group, i, p, local, held))
            return super().step(closure)
        finally:
            for group, i, p, local, held in swapped:
                group["params"][i] = p
                local.grad = None
                # The held DTensors were updated in place; moments made on a first step become DTensors.
                made = self.state.pop(local, {})
                self.state[p] = {k: held[k] if k in held else v if k == "step" else placed_like(v, p)
                                 for k, v in made.items()}


class AdamWOnLocalShards(_OnLocalShards, torch.optim.AdamW):
    pass


class AdamOnLocalShards(_OnLocalShards, torch.optim.Adam):
    pass


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """Which optimizer and which kernel updates the weights, as built (for the run's log)."""
    if isinstance(optimizer, AdamWWithBf16Weights):
        name = "AdamW" if optimizer.decoupled else "Adam"
        return f"{name} on split bf16 weights ({'compiled' if optimizer.compiled else 'eager'})"
    group = optimizer.param_groups[0]
    kernel = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    name = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")).__name__
    return f"{name} {kernel}"


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device,
                    bf16_weights: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; ``bf16_weights``: one that updates split bf16
    weights (``AdamWWithBf16Weights``: compiled on CUDA; on CPU only with optimizer.implementation fused)."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    if bf16_weights:  # its own kernel, compiled on CUDA whatever optimizer.implementation says
        return AdamWWithBf16Weights(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.eps, weight_decay=cfg.weight_decay, decoupled=cfg.name == "AdamW",
                                     compiled=device.type == "cuda" or impl == "fused")
    kwargs = dict(
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    groups = param_groups(model, cfg.weight_decay)
    per_tensor = impl == "for-loop"
    if cfg.name == "AdamW":
        return (AdamWOnLocalShards if per_tensor else torch.optim.AdamW)(groups, **kwargs)
    assert cfg.name == "Adam", cfg.name
    # Adam couples weight decay into the gradient (L2); kept for users who ask for it explicitly.
    return (AdamOnLocalShards if per_tensor else torch.optim.Adam)(groups, **kwargs)


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (1-based: the first update is step 1).

    Warmup: step / warmup_steps, rising linearly to 1 at the end of warmup. Stable: 1. Decay: the last
    ``decay_ratio`` of the steps (every step after warmup when decay_ratio is -1) fall from 1 to
    min_lr_factor along the chosen curve, never into the warmup. A warmup as long as the run or longer (a short
    test of a long run's config) ramps up to the last step, every step at the lr it has in the long run: the
    peak comes only if the run reaches the end of the warmup, and nothing decays.
    """
    warmup = cfg.warmup_steps
    if warmup and step <= warmup:
        return step / warmup
    after_warmup = max(total_steps - warmup, 0)  # a warmup longer than the run leaves no steps, not fewer
    decay = after_warmup if cfg.decay_ratio == -1.0 else round(cfg.decay_ratio * total_steps)
    decay = min(decay, after_warmup)
    decay_start = total_steps - decay
    if step <= decay_start or decay == 0:
        return 1.0
    progress = (step - decay_start) / decay  # in (0, 1]
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        assert cfg.decay_type == "sqrt", cfg.decay_type
        shape = 1.0 - math.sqrt(progress)
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    # LambdaLR evaluates the lambda at 0 on construction: that lr is the one the first update uses.
    return LambdaLR(optimizer, lambda i: lr_factor(i + 1, total_steps, cfg))


def load_lr_scheduler_state(scheduler: LambdaLR, state: dict) -> None:
    """Put ``scheduler`` (built from this run's config) at the step of a saved ``state``. Only the position
    comes from the checkpoint: the peak lr and the schedule's shape are this run's (optimizer.lr,
    lr_scheduler.*, training.steps), so a resumed run may lower the lr or train longer. The optimizer's lr is
    set to the one its next update uses."""
    last = int(state["last_epoch"])
    lrs = [base * fn(last) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler.load_state_dict({**state, "base_lrs": list(scheduler.base_lrs), "_last_lr": lrs})
    for group, lr, base in zip(scheduler.optimizer.param_groups, lrs, scheduler.base_lrs):
        group["lr"], group["initial_lr"] = lr, base


def scales_gradients(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer`` divides the gradients by its ``grad_scale`` tensor as it reads them: torch's fused
    Adam and AdamW kernels do (the hook GradScaler uses), in the pass that updates the parameters."""
    if isinstance(optimizer, AdamWWithBf16Weights):
        return True
    return (
        isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        and all(group.get("fused") for group in optimizer.param_groups)
    )


def _fp32_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of plain tensors of any float dtypes, each tensor's norm computed and returned in fp32
    (torch's ``get_total_norm`` returns a bf16 tensor's norm in bf16: 3 significant digits). On CPU each norm is
    accumulated in fp64: torch's CPU norm kernels lose digits on large fp32 tensors (most when a few large values
    sit among many small ones, as in an embedding's gradient), which moved gradient norms with the layout."""
    by_kind: dict = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(i)
    norms: list = [None] * len(tensors)
    for (device, _), indices in by_kind.items():
        group = [tensors[i] for i in indices]
        if device.type == "cpu":
            found = [torch.linalg.vector_norm(t, dtype=torch.float64).float() for t in group]
        else:
            found = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        for i, n in zip(indices, found):
            norms[i] = n.to(tensors[0].device)
    return torch.linalg.vector_norm(torch.stack(norms))  # in the tensors' order, as torch's


def _sharded_squares(mesh, grads: list) -> torch.Tensor:
    """The squared L2 norm of DTensor gradients on ``mesh``: each rank's shards' squares summed over the mesh
    dimensions they are sharded on (a replicated dimension holds the same values on every rank: counted once).
    Done here rather than by DTensor, which reduces over several mesh dimensions at once by flattening them and
    cannot when their ranks are not in the root mesh's order (an expert-parallel weight sharded by FSDP over
    edp x tp and by EP over the ep ranks between them)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial

    by_dims: dict = {}
    for g in grads:
        assert not any(isinstance(p, Partial) for p in g.placements), g.placements
        dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())  # Shard, FSDP's strided shard
        by_dims.setdefault(dims, []).append(g.to_local())
    total = None
    for dims, local in by_dims.items():
        sq = _fp32_norm(local) ** 2
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq
    return total


def clip_grad_norm_(parameters, max_norm: float, pp_group=None,
                    optimizer: Optional[torch.optim.Optimizer] = None, scale_in_optimizer: bool = True,
                    uncounted=()) -> torch.Tensor:
    """Clip the gradients to a total L2 norm of ``max_norm``; returns the total norm before clipping.

    Gradients may be DTensors sharded or replicated over any mesh dimensions (FSDP, TP, ...), on several
    meshes at once: each mesh's squared norm is summed over the dimensions its gradients are sharded on
    (replicated ones counted once), then the meshes are combined. With pipeline stages
    (``pp_group``) every stage holds different parameters, so their squared norms are summed over it;
    ``uncounted`` parameters (a copy of a weight another stage holds: a tied output projection) are clipped
    but left out of the norm.

    With a fused Adam/AdamW ``optimizer`` (``scales_gradients``) the gradients are not scaled here: the
    optimizer's kernel divides each one by ``optimizer.grad_scale`` (set here to the inverse of the clip
    factor) as it reads it for the update (torch's fused kernels also write the clipped gradient back;
    ``AdamWWithBf16Weights`` does not). That saves a read and a write of every gradient per step. The gradients
    are then clipped only once the optimizer has stepped: ``scale_in_optimizer=False`` scales them here, for a
    caller that reads them in between.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    by_mesh: dict = {}
    for p in params:
        if id(p) in skip:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
    squares = []
    for mesh, grads in by_mesh.items():
        # plain tensors, bf16 ones (split bf16 weights' gradients) included: fp32 norms
        squares.append(_fp32_norm(grads) ** 2 if mesh is None else _sharded_squares(mesh, grads))
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    # Scale the local shards in place: multiplying by one scalar is the same on every placement (sharded,
    # replicated or partial), and a foreach op on the DTensors themselves would cost DTensor's sharding
    # propagation over every gradient at once (seconds per process on the first step).
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if optimizer is not None:
        optimizer.grad_scale = None  # nothing left from an earlier step
        if scale_in_optimizer and scales_gradients(optimizer):
            optimizer.grad_scale = 1.0 / coef
            return total
    by_device: dict = {}
    with torch.no_grad():
        for p in params:
            g = local_tensor(p.grad)
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))
    return total
