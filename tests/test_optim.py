"""Optimizer parameter groups and the warmup-stable-decay schedule."""

import copy
import math

import pytest
import torch

from engine.config import LRScheduler, Optimizer
from engine.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_no_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, Optimizer(weight_decay=0.1), torch.device("cpu"))
    decay = [g for g in opt.param_groups if g["weight_decay"] > 0]
    no_decay = [g for g in opt.param_groups if g["weight_decay"] == 0]
    assert [p.shape for p in decay[0]["params"]] == [torch.Size([4, 4])]
    assert sorted(p.numel() for p in no_decay[0]["params"]) == [4, 4, 4]
    assert isinstance(opt, torch.optim.AdamW)


def test_warmup_stable_decay_shapes():
    cfg = LRScheduler(warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0)
    f = [lr_factor(s, 100, cfg) for s in range(1, 101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # warmup reaches the peak at step 10
    assert all(x == 1.0 for x in f[10:80])  # stable until the last 20 steps
    assert f[80] == pytest.approx(1 - 1 / 20) and f[99] == pytest.approx(0.0)
    cos = LRScheduler(warmup_steps=0, decay_ratio=-1, decay_type="cosine", min_lr_factor=0.1)
    assert lr_factor(50, 100, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, 100, cos) == pytest.approx(0.1)
    sq = LRScheduler(warmup_steps=0, decay_ratio=1.0, decay_type="sqrt", min_lr_factor=0.0)
    assert lr_factor(25, 100, sq) == pytest.approx(1 - math.sqrt(0.25))


def test_scheduler_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4, decay_type="linear"), total_steps=8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert seen[4:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize("decay_ratio", [-1.0, 0.0, 0.5, 1.0])
def test_warmup_as_long_as_the_run_or_longer(decay_type, decay_ratio):
    """A short run of a long run's config (warmup_steps >= training.steps) ramps up to its last step: every step
    at its lr of the warmup, the peak at most, with every decay shape; past the warmup (the scheduler's own
    look-ahead, or a step beyond a warmup longer than the run) the lr stays at the peak."""
    for total, warmup in ((2, 10), (5, 5), (1, 1), (3, 4)):
        cfg = LRScheduler(warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=decay_type, min_lr_factor=0.1)
        factors = [lr_factor(s, total, cfg) for s in range(1, total + 1)]
        assert factors == pytest.approx([s / warmup for s in range(1, total + 1)]), (total, warmup)
        for step in (warmup + 1, warmup + 7):
            assert lr_factor(step, total, cfg) == 1.0, (total, warmup, step)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=10, decay_ratio=decay_ratio, decay_type=decay_type),
                               total_steps=2)
    seen = []
    for _ in range(2):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    """engine.optim.clip_grad_norm_ against torch's own on plain tensors: the same total norm and, clipping
    (0.5) or not (1e6), the same gradients; parameters without a gradient are left out."""
    from engine.optim import clip_grad_norm_

    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (7,), (2, 2, 2))]
    theirs = [torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (7,), (2, 2, 2))]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    no_grad = torch.nn.Parameter(torch.zeros(3))
    total = clip_grad_norm_([*ours, no_grad], max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total > 0.5 and total.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    if max_norm == 0.5:
        assert torch.cat([p.grad.flatten() for p in ours]).norm().item() == pytest.approx(0.5, rel=1e-4)


def test_clip_grad_norm_on_cpu_is_exact_for_an_embedding_sized_gradient():
    """A gradient of a million elements with a few large rows among many small ones (an embedding's): the norm is
    the fp64 one to 1e-7 (torch's CPU norm kernels, one fp32 running sum, are off by about 4e-4 on it)."""
    from engine.optim import clip_grad_norm_

    grad = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)) * 1e-3
    grad[:5] = 1.0
    exact = grad.double().norm().item()
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    assert clip_grad_norm_([p], 1e6).item() == pytest.approx(exact, rel=1e-7)
    assert abs(grad.norm().item() / exact - 1) > 1e-5  # what torch's kernel gives: the case is a hard one


def test_clip_leaves_uncounted_gradients_out_of_the_norm_and_still_scales_them():
    """``uncounted`` (a pipeline's copy of a tied weight, whose gradient another stage counts): not in the norm,
    clipped by the same factor as the others."""
    from engine.optim import clip_grad_norm_

    counted, copy = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    counted.grad, copy.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    assert clip_grad_norm_([counted, copy], 1.0, uncounted=[copy]).item() == pytest.approx(5.0)
    torch.testing.assert_close(copy.grad, torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(counted.grad, torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_folded_into_the_fused_optimizer(max_norm):
    """With fused AdamW the clip factor is applied inside the optimizer's kernel (optimizer.grad_scale): three
    steps give the parameters, moments and (clipped) gradients of scaling the gradients first, and a foreach
    optimizer, or a caller that reads the clipped gradients first (scale_in_optimizer=False), gets them scaled
    before the step, with no grad_scale left from an earlier step."""
    from engine.optim import clip_grad_norm_, scales_gradients

    cfg = Optimizer(lr=0.1, weight_decay=0.1, implementation="fused")
    g = torch.Generator().manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    models = [init, *(copy.deepcopy(init) for _ in range(2))]
    folded, explicit = (build_optimizer(m, cfg, torch.device("cpu")) for m in models[:2])
    foreach = build_optimizer(models[2], Optimizer(lr=0.1, weight_decay=0.1, implementation="foreach"),
                              torch.device("cpu"))
    assert scales_gradients(folded) and not scales_gradients(foreach)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in init.parameters()]
        for m in models:
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.clone()
        norms = [clip_grad_norm_(models[0].parameters(), max_norm, optimizer=folded)]
        if max_norm == 0.5:  # not scaled yet: the kernel does it
            assert all(torch.equal(p.grad, grad) for p, grad in zip(models[0].parameters(), grads))
        norms.append(clip_grad_norm_(models[1].parameters(), max_norm, optimizer=explicit,
                                     scale_in_optimizer=False))
        norms.append(clip_grad_norm_(models[2].parameters(), max_norm, optimizer=foreach))
        assert explicit.grad_scale is None and foreach.grad_scale is None
        assert norms[0].item() == norms[1].item() == norms[2].item()
        for opt in (folded, explicit, foreach):
            opt.step()
        for p, q, r in zip(*(m.parameters() for m in models)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)  # written back, clipped
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(folded.state[p][key], explicit.state[q][key], rtol=1e-6, atol=1e-9)
    # A later step that must scale before the optimizer clears the factor the folded ones set.
    clip_grad_norm_(models[0].parameters(), max_norm, optimizer=folded, scale_in_optimizer=False)
    assert folded.grad_scale is None


@pytest.mark.parametrize("argv", [
    ["--optimizer.implementation", "for-loop"],
    ["--optimizer.implementation", "foreach"],
    ["--optimizer.implementation", "fused"],
    ["--optimizer.name", "Adam"],
], ids=["for-loop", "foreach", "fused", "adam"])
def test_betas_and_eps_reach_every_param_group(argv):
    """optimizer.beta1 / beta2 / eps, from the command line, reach every parameter group (with and without weight
    decay) of every optimizer the engine builds, and the AdamW step uses them: one step from zero moments, where
    eps = 1 (instead of 1e-8) shrinks the update of a unit gradient from lr to lr / 2."""
    from engine.config import parse_args

    cfg = parse_args(["--optimizer.beta1", "0.8", "--optimizer.beta2", "0.99", "--optimizer.eps", "1.0",
                      "--optimizer.weight_decay", "0", *argv]).optimizer
    assert (cfg.beta1, cfg.beta2, cfg.eps) == (0.8, 0.99, 1.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    assert len(opt.param_groups) == 2
    for group in opt.param_groups:
        assert group["betas"] == (0.8, 0.99) and group["eps"] == 1.0, group.keys()
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    # Adam's first step: lr * m_hat / (sqrt(v_hat) + eps) = lr * 1 / (1 + 1) with unit gradients.
    for p, p0 in zip(model.parameters(), before):
        torch.testing.assert_close(p0 - p.detach(), torch.full_like(p0, cfg.lr / 2))


def test_betas_and_eps_reach_the_bf16_weights_optimizer():
    from engine.config import parse_args
    from engine.optim import AdamWWithBf16Weights

    cfg = parse_args(["--optimizer.beta1", "0.8", "--optimizer.beta2", "0.99", "--optimizer.eps", "1e-6",
                      "--optimizer.implementation", "for-loop"]).optimizer
    opt = build_optimizer(torch.nn.Linear(4, 4), cfg, torch.device("cpu"), bf16_weights=True)
    assert isinstance(opt, AdamWWithBf16Weights)
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in opt.param_groups)


ADAMW = {"lr": 0.1, "weight_decay": 0.1, "foreach": False}


def local_shards_job(world_size: int, rank: int) -> dict:
    """(A harness job, one rank.) Three AdamW steps on DTensor parameters, on their local shards and through
    DTensor, from the same values; which operations of the local-shard steps saw a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from engine.optim import AdamWOnLocalShards

    class DTensorOps(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {}))):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        g = torch.Generator().manual_seed(0)
        values = {"w": (torch.randn(4, 3, generator=g), [Shard(0)]), "b": (torch.randn(3, generator=g), [Replicate()])}
        runs = {}
        for name in ("local", "dtensor"):
            params = {k: torch.nn.Parameter(distribute_tensor(v.clone(), mesh, pl)) for k, (v, pl) in values.items()}
            # A gradient placed unlike its parameter (a pending sum) takes DTensor's path in either.
            params["p"] = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Replicate()]))
            if name == "local":  # the parameters placed like their gradients, watched; the other one on its own
                opts = [(AdamWOnLocalShards([params["w"], params["b"]], **ADAMW), True),
                        (AdamWOnLocalShards([params["p"]], **ADAMW), False)]
            else:  # torch's per-tensor kernel updates each tensor on its own: one optimizer for all is the same
                opts = [(torch.optim.AdamW(params.values(), **ADAMW), False)]
            seen = []
            for step in range(3):
                for k, p in params.items():
                    grad = torch.full(p.shape, float(step + 1)) * (torch.arange(p.numel()).view(p.shape) - 1.5)
                    p.grad = DTensor.from_local(grad, mesh, [Partial()]) if k == "p" else \
                        distribute_tensor(grad, mesh, p.placements)
                for opt, watched in opts:
                    if watched:
                        with DTensorOps() as mode:
                            opt.step()
                        seen += mode.seen
                    else:
                        opt.step()
            state = {p: v for opt, _ in opts for p, v in opt.state.items()}
            runs[name] = {"params": {k: p.full_tensor() for k, p in params.items()},
                          "state": {k: {s: (v.full_tensor() if isinstance(v, DTensor) else v, type(v).__name__,
                                            getattr(v, "placements", None) == params[k].placements)
                                        for s, v in state[params[k]].items()} for k in params},
                          "seen": seen}
        return runs
    finally:
        dist.destroy_process_group()


def test_adamw_on_local_shards_is_torchs_adamw_on_dtensors(tmp_path):
    """optimizer.implementation for-loop steps FSDP2's and TP's DTensor parameters on their local shards: the same
    values as torch's AdamW stepping the DTensors (parameters and moments, bit for bit, over three steps), the
    moments still DTensors placed like their parameters (what checkpoints hold), and no operation of the update
    dispatched through DTensor; a gradient placed unlike its parameter takes torch's path."""
    from tests.parallel_harness import run_jobs

    runs = run_jobs(1, local_shards_job, {"runs": ()}, str(tmp_path))["runs"]
    local, reference = runs["local"], runs["dtensor"]
    for k in ("w", "b", "p"):
        assert torch.equal(local["params"][k], reference["params"][k]), k
        assert local["state"][k].keys() == reference["state"][k].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for s, (value, kind, placed) in local["state"][k].items():
            want, want_kind, _ = reference["state"][k][s]
            assert torch.equal(value, want) and kind == want_kind, (k, s)
            assert placed == (s != "step"), (k, s)  # the moments placed like the parameter
    assert local["seen"] == [], local["seen"][:5]
