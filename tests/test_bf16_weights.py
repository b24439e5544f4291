"""Split bf16 weights: linear weights stored in bf16 with their fp32 masters' low halves beside them, updated
by the optimizer (parallelize/bf16_weights.py, engine/optim.py).

On CUDA they are on by default on one GPU; here the trainer's bf16 autocast is switched on for the CPU
(``engine.trainer.bf16_autocast`` patched), so the split weights run the same code as on the GPU, against plain
autocast on fp32 weights."""

import copy
import os
import shutil

import pytest
import torch

from engine import train, trainer
from engine.checkpoint.files import step_folder
from engine.config import Optimizer
from engine.optim import AdamWWithBf16Weights, build_optimizer, clip_grad_norm_, scales_gradients
from engine.plot import read_metrics
from models.loss import cross_entropy_sum
from parallelize.bf16_weights import bf16_weights_apply, master_weight, split, split_matmul_weights
from tests.parallel_harness import AOT_EAGER
from tests.test_model import build, debug_args

# Few tokens per step: a CPU without AVX-512 runs bf16 matmuls (autocast's) tens of times slower than fp32 ones
# (the output projection's input gradient, 4,096 deep, 170 ms for 64 tokens against 1.6 ms in fp32), and the
# comparisons below are bit for bit (or within rounding), which any batch shows as well as a large one.
SMALL = ["--model.flavor", "debugmodel_L2", "--training.seq_len", "16", "--training.local_batch_size", "2",
         "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--debug.deterministic", "--metrics.no-plots"]
LEARNING = ["--training.seq_len", "32", "--training.local_batch_size", "4"]  # for a curve that must fall far


@pytest.fixture
def cpu_autocast(monkeypatch):
    """The trainer computes under bf16 autocast on the CPU, as it does on one GPU."""
    monkeypatch.setattr(trainer, "bf16_autocast", lambda device, param, data_parallel: param == "bfloat16"
                        and not data_parallel)


def _train(dump, capsys, *args):
    rc = train.main(["--job.dump_folder", str(dump), *SMALL, *args])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    return read_metrics(os.path.join(dump, "metrics.jsonl")), out


def _curve(rows):
    return [(r["loss"], r["grad_norm"]) for r in rows]


def _forward_backward(model, tokens, labels):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens)
    loss = cross_entropy_sum(out.float(), labels) / labels.numel()
    loss.backward()
    return loss


def test_split_holds_the_fp32_weight_exactly():
    """The bf16 half is the round-to-nearest-even value (autocast's cast) and the two halves give back every fp32
    weight bit for bit, at every magnitude and sign; a tie that rounds down to an even high half (low half
    +2^15) is the one exception: it comes back 1 fp32 ulp lower, with the same bf16 half."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.logspace(-30, 30, 200_000)
    high, low = split(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(high, x.bfloat16())
    back = master_weight(high, low)
    exact = back == x
    assert exact.float().mean() > 1 - 1e-4
    bits = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=g, dtype=torch.int64)
    ties = ((bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)
    ties = ties[torch.isfinite(ties)]
    high, low = split(ties)
    back = master_weight(high, low)
    off = back.view(torch.int32).long() - ties.view(torch.int32).long()
    assert set(off.unique().tolist()) == {-1, 0} and torch.equal(high, ties.bfloat16())
    assert torch.equal(back.bfloat16(), high) and torch.equal(split(back)[1], low)  # stable once stored


def test_a_state_dicts_fp32_weight_is_the_master_weight_and_goes_to_the_cpu_when_the_gpu_is_short(monkeypatch):
    """state_dict_weight gives the bits the halves stand for (every pattern, NaNs and infinities included), as
    master_weight does; fits_on_gpu counts the device's free memory and the allocator's free blocks, less 1 GiB
    to spare."""
    from parallelize import bf16_weights

    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (300_000,), generator=g, dtype=torch.int64).to(torch.int32)
    high, low = split(bits.view(torch.float32))
    built = bf16_weights.state_dict_weight(high, low)
    assert built.dtype == torch.float32 and built.device.type == "cpu"
    # the bits the halves stand for, in 64-bit integer arithmetic (high x 2^16 + low, wrapped to 32 bits)
    bits64 = high.view(torch.int16).to(torch.int64) * 2**16 + low.to(torch.int64)
    expected = ((bits64 + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert torch.equal(built.view(torch.int32), expected)
    assert torch.equal(master_weight(high, low).view(torch.int32), expected)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 45 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 41 * gib)
    cuda = torch.device("cuda", 0)
    assert bf16_weights.fits_on_gpu(6 * gib, cuda)  # 3 free + 4 cached = 7 = 6 + 1 to spare
    assert not bf16_weights.fits_on_gpu(6 * gib + 1, cuda)


def _as_stored(key: str, value: torch.Tensor) -> torch.Tensor:
    """An fp32 weight of the debug model as split weights hold it (ties 1 ulp lower; norms, embedding as is)."""
    return value if "norm" in key or "embeddings" in key else master_weight(*split(value))


@pytest.mark.parametrize("compiled", [False, True])
def test_split_weights_give_autocasts_loss_and_gradients_exactly(compiled):
    """The same model under autocast on fp32 weights, and on split bf16 weights: the same loss, and every
    gradient the same bits (a bf16 weight's gradient is the one autocast casts up to fp32), eager and with the
    blocks compiled. The state dict still holds the fp32 weights, bit for bit, and loading one splits it again."""
    ref = build(debug_args())
    ours = copy.deepcopy(ref)
    lows = split_matmul_weights([ours])
    assert len(lows) == 1 + 7 * len(ours.layers)  # the output projection and each block's seven
    assert all(p.dtype == torch.bfloat16 and low.dtype == torch.int16 for p, low in lows.items())
    assert ours.output.weight in lows
    theirs = ref.state_dict()
    mine = ours.state_dict()
    assert sorted(mine) == sorted(theirs) and all(mine[k].dtype == theirs[k].dtype for k in theirs)
    for k in theirs:  # the fp32 weights, but for a tie's 1 ulp (above)
        assert torch.equal(mine[k], _as_stored(k, theirs[k])), k
        assert (mine[k] != theirs[k]).float().mean() < 1e-4, k
    if compiled:
        for block in [*ref.layers.values(), *ours.layers.values()]:
            block.compile(fullgraph=True)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 512, (2, 64), generator=g) for _ in range(2))
    assert _forward_backward(ref, tokens, labels).item() == _forward_backward(ours, tokens, labels).item()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert q.grad.dtype == (torch.bfloat16 if q in lows else torch.float32), name
        assert torch.equal(p.grad, q.grad.float()), name
    # Loading fp32 weights (another model's) splits them: the state dict gives them back exactly.
    other = build(debug_args(), seed=1).state_dict()
    ours.load_state_dict(other)
    assert all(torch.equal(ours.state_dict()[k], _as_stored(k, other[k])) for k in other)


def test_moe_experts_are_split_and_give_autocasts_output_and_gradients_exactly():
    """A MoE layer with a shared expert: its stacked expert weights are split too (the grouped GEMMs read them with
    no cast), and under autocast it gives the output and gradients of fp32 weights, bit for bit."""
    from tests.test_moe import DIM
    from tests.test_moe import build as build_moe

    ref = build_moe(num_shared_experts=1)
    ours = copy.deepcopy(ref)
    lows = split_matmul_weights([ours])
    experts = [getattr(e, w) for e in (ours.experts, ours.shared_experts) for w in ("w1", "w2", "w3")]
    assert set(lows) == {*experts, ours.router.gate.weight}
    assert all(p.dtype == torch.bfloat16 and lows[p].shape == p.shape for p in experts)
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert sorted(mine) == sorted(theirs) and all(mine[k].dtype == theirs[k].dtype for k in theirs)
    for k in ("experts.w1", "shared_experts.w2", "router.gate.weight"):
        assert torch.equal(mine[k], master_weight(*split(theirs[k]))), k
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(1))
    outs = []
    for layer in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert q.grad.dtype == (torch.bfloat16 if q in lows else torch.float32), name
        assert torch.equal(p.grad, q.grad.float()), name
    assert all(p.grad.abs().sum() > 0 for p in experts)


def test_fused_loss_on_split_weights_adds_the_output_gradient_up_in_fp32():
    """The output projection fused with the loss (training.loss_chunk_tokens): under autocast the weight's gradient
    adds up over the chunks in fp32 either way; on a split weight it is that fp32 sum rounded to bf16 once (not
    rounded after every chunk), and every other gradient and the loss are autocast's exactly."""
    ref = build(debug_args())
    ours = copy.deepcopy(ref)
    lows = split_matmul_weights([ours])
    for m in (ref, ours):
        m.loss_chunk_tokens = 16
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 512, (2, 64), generator=g) for _ in range(2))
    losses = []
    for m in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tokens, labels=labels) / labels.numel()
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        expected = p.grad.bfloat16() if q in lows else p.grad
        assert q.grad.dtype == expected.dtype and torch.equal(q.grad, expected), name


def test_optimizer_state_loaded_after_the_split_stays_fp32():
    """torch's Optimizer.load_state_dict casts the moments to their parameter's dtype: loaded into split weights
    they must stay fp32, bit for bit, and the weights must be unchanged by the load."""
    model, grads = _model_and_grads(0)
    cfg = Optimizer(lr=0.1, weight_decay=0.1, implementation="foreach")
    opt = build_optimizer(model, cfg, torch.device("cpu"), bf16_weights=True)
    lows = split_matmul_weights([model])
    opt.set_low_halves(lows)
    for p, g in zip(model.parameters(), grads[0]):
        p.grad = g.to(p.dtype)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for state in opt.state.values():
        state["exp_avg"].zero_()
    opt.load_state_dict(saved)
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    in_order = [p for group in opt.param_groups for p in group["params"]]  # the state dict's numbering
    assert all(torch.equal(opt.state[p]["exp_avg"], saved["state"][i]["exp_avg"]) for i, p in enumerate(in_order))
    assert any(saved["state"][i]["exp_avg"].abs().max() > 0 for i in range(len(in_order)))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert all(p.dtype == torch.bfloat16 for p in lows)


def _model_and_grads(seed: int):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    torch.manual_seed(seed)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
    return model, grads


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
@pytest.mark.parametrize("compiled", [False, True])
def test_optimizer_computes_torchs_update_on_the_fp32_weights(name, compiled):
    """Three steps, weight decay on the matrices only, from the same gradients (bf16 values on the split
    weights): eager and without clipping the fp32 weights (both halves) and moments of torch's own foreach AdamW
    (Adam), bit for bit; with the clip folded in (grad_scale) or compiled (CUDA's kernel), within fp32 rounding.
    The state has torch's keys and dtypes."""
    for max_norm in (1e9, 0.5):
        cfg = Optimizer(name=name, lr=0.1, weight_decay=0.1, implementation="fused" if compiled else "foreach")
        model, grads = _model_and_grads(0)
        theirs = copy.deepcopy(model)
        ours = build_optimizer(model, cfg, torch.device("cpu"), bf16_weights=True)
        assert isinstance(ours, AdamWWithBf16Weights) and scales_gradients(ours)
        lows = split_matmul_weights([model])
        ours.set_low_halves(lows)
        reference = build_optimizer(theirs, Optimizer(name=name, lr=0.1, weight_decay=0.1,
                                                      implementation="foreach"), torch.device("cpu"))
        for step_grads in grads:
            for p, q, g in zip(model.parameters(), theirs.parameters(), step_grads):
                p.grad = g.to(p.dtype)
                q.grad = p.grad.float().clone()  # not the same tensor: the reference clip scales it
            total = clip_grad_norm_(list(model.parameters()), max_norm, optimizer=ours)
            assert total.item() == pytest.approx(clip_grad_norm_(list(theirs.parameters()), max_norm).item(),
                                                 rel=1e-6)
            ours.step()
            reference.step()
            ours.zero_grad()
        for p, q in zip(model.parameters(), theirs.parameters()):
            fp32 = master_weight(p.detach(), lows[p]) if p in lows else p.detach()
            if p in lows:
                assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), fp32.bfloat16())
            state, ref_state = ours.state[p], reference.state[q]
            assert sorted(state) == sorted(ref_state) == ["exp_avg", "exp_avg_sq", "step"]
            assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == 3.0
            if max_norm == 1e9 and not compiled:
                assert torch.equal(fp32, q.detach())
                assert all(torch.equal(state[k], ref_state[k]) for k in ("exp_avg", "exp_avg_sq"))
            else:  # inductor's kernels round on their own (fp32 updates of 0.1 on weights of 0.1-0.5)
                torch.testing.assert_close(fp32, q.detach(), rtol=1e-6, atol=1e-6)
                for k in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-7)


def test_clip_norm_of_bf16_gradients_is_computed_in_fp32():
    """torch's norm of a bf16 tensor is a bf16 number (3 significant digits); the clip's total norm over bf16
    gradients is the fp32 norm of their values, and it scales them as it scales fp32 ones."""
    torch.manual_seed(0)
    values = [torch.randn(300).bfloat16() for _ in range(3)]
    bf16 = [torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16)) for _ in values]
    fp32 = [torch.nn.Parameter(torch.zeros(300)) for _ in values]
    for a, b, v in zip(bf16, fp32, values):
        a.grad, b.grad = v.clone(), v.float()
    total = clip_grad_norm_(bf16, 1.0)
    exact = torch.cat([v.double() for v in values]).norm().item()
    assert total.dtype == torch.float32 and total.item() == pytest.approx(exact, rel=1e-6)
    assert torch.nn.utils.get_total_norm([v.clone() for v in values]).item() != pytest.approx(exact, rel=1e-4)
    assert clip_grad_norm_(fp32, 1.0).item() == pytest.approx(exact, rel=1e-6)
    assert torch.cat([p.grad.float() for p in bf16]).norm().item() == pytest.approx(1.0, rel=1e-2)


def test_a_tied_output_weight_stays_fp32_on_one_gpu():
    """An output projection tied to the embedding is not split (the embedding would read bf16); the other linear
    weights are, and the state dict gives fp32 for every name."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 10, bias=False))
    model[2].weight = model[0].weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lows = split_matmul_weights([model])
    assert list(lows) == [model[1].weight] and model[0].weight.dtype == torch.float32
    after = model.state_dict()
    assert {k: v.dtype for k, v in after.items()} == {k: torch.float32 for k in before}
    assert all(torch.equal(after[k], _as_stored(k, before[k]) if k == "1.weight" else before[k]) for k in before)


def test_where_split_weights_apply():
    assert bf16_weights_apply(True, distributed=False, grad_accum=1)
    assert not bf16_weights_apply(False, distributed=False, grad_accum=1)
    assert not bf16_weights_apply(True, distributed=True, grad_accum=1)  # FSDP, TP, PP, CP: plain autocast
    assert not bf16_weights_apply(True, distributed=False, grad_accum=2)  # bf16 would accumulate the gradients


COMPILED_OP_AC = ["--compile.enable", "--activation_checkpoint.mode", "selective"]
TRACED_OP_AC = [*AOT_EAGER, "--activation_checkpoint.mode", "selective"]  # traced, not Inductor-compiled
SPLIT_LINE = "bf16 autocast on bf16 weights (fp32 masters split in two)"


MOE = ["--config", "train_configs/qwen3_moe_debug.toml", "--model.flavor", "debugmodel_moe_L2"]


@pytest.mark.parametrize("layout", [[], COMPILED_OP_AC, MOE], ids=["eager", "compile_op_ac", "moe"])
def test_training_on_split_weights_is_autocast_bit_for_bit(layout, tmp_path, capsys, cpu_autocast):
    """The trainer on one rank under bf16 autocast, on split bf16 weights (the default) and on fp32 weights,
    eager, with compiled blocks under per-op AC, and for a MoE model (its experts split too): 4 steps of the same
    losses, bit for bit (the update is torch's foreach AdamW's, the CPU's default kernel, on the same fp32
    weights). The clip is off (max_norm 1e9) because it differs by design: the split weights' update divides by
    the inverse clip factor as it reads a gradient, as torch's fused kernel does, where foreach multiplies by the
    factor. The learning rate is 4e-3, so that 4 steps of 32 tokens fall by more than their batches' spread on
    every torch release (at the default 8e-4 they may not)."""
    common = ["--training.steps", "4", "--training.max_norm", "1e9", "--optimizer.lr", "4e-3", *layout]
    ours, out = _train(tmp_path / "split", capsys, *common)
    assert SPLIT_LINE in out
    plain, out = _train(tmp_path / "plain", capsys, *common, "--training.no-bf16_weights")
    assert "bf16 autocast" in out and SPLIT_LINE not in out
    assert [r["loss"] for r in ours] == [r["loss"] for r in plain]
    # The norms differ in fp32's last bits: a bf16 gradient's norm is summed by another kernel than the fp32 one's.
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-6)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.5


def test_a_lost_low_half_would_show(tmp_path, capsys, cpu_autocast, monkeypatch):
    """The comparison above can fail: an optimizer that drops the low halves (fp32 weights rounded to bf16 at
    every update, updates smaller than half a bf16 step lost) gives another curve."""
    original = AdamWWithBf16Weights.step

    def lossy_step(self, closure=None):
        original(self, closure)
        for low in self.lows.values():
            low.zero_()

    common = ["--training.steps", "4", "--training.max_norm", "1e9"]
    monkeypatch.setattr(AdamWWithBf16Weights, "step", lossy_step)
    lossy, _ = _train(tmp_path / "lossy", capsys, *common)
    plain, _ = _train(tmp_path / "plain", capsys, *common, "--training.no-bf16_weights")
    assert lossy[0]["loss"] == plain[0]["loss"] and lossy[-1]["loss"] != plain[-1]["loss"]


def test_gradient_accumulation_keeps_plain_autocast(tmp_path, capsys, cpu_autocast):
    _, out = _train(tmp_path / "acc", capsys, "--training.steps", "1", "--training.global_batch_size", "4")
    assert "grad accumulation 2; " in out and "bf16 autocast" in out and SPLIT_LINE not in out


def test_resume_on_split_weights_is_bit_identical_and_checkpoints_are_interchangeable(tmp_path, capsys,
                                                                                      cpu_autocast):
    """Checkpoints hold the fp32 weights and torch's AdamW state with or without split weights: a run resumed at
    step 2 on split weights continues bit-identically, and so does one resumed on fp32 weights (the clip off,
    as above)."""
    ckpt = ["--training.steps", "4", "--training.max_norm", "1e9", "--checkpoint.enable", "--checkpoint.interval", "2"]
    whole, _ = _train(tmp_path / "whole", capsys, *ckpt)
    for name, extra in (("split", []), ("plain", ["--training.no-bf16_weights"])):
        dump = tmp_path / name
        shutil.copytree(tmp_path / "whole", dump)
        shutil.rmtree(step_folder(str(dump / "checkpoint"), 4))
        rows, out = _train(dump, capsys, *ckpt, *extra)
        assert "resumed from step 2" in out
        resumed = [r for r in rows if r["step"] > 2][-2:]
        assert [r["step"] for r in resumed] == [3, 4]
        if name == "split":
            assert _curve(resumed) == _curve(whole[2:])
        else:  # the same losses (no clip: see above); the norms of fp32 gradients in fp32's last bits
            assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]
            assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in whole[2:]], rel=1e-6)


def test_float8_layers_train_on_split_weights(tmp_path, capsys, cpu_autocast):
    """torchao's Float8Linear (emulated) on split bf16 weights, traced under per-op AC (TRACED_OP_AC: the GPU check
    runs float8 through Inductor): the layers keep their class and read their bf16 weights; the curve follows
    float8 on fp32 weights (eager) within float8's tolerance (each weight is cast to float8 from its bf16 value, not
    from fp32: not the same bits)."""
    pytest.importorskip("torchao")
    common = ["--training.steps", "6", "--float8.enable", "--float8.emulate", *LEARNING]
    ours, out = _train(tmp_path / "split", capsys, *common, *TRACED_OP_AC)
    assert SPLIT_LINE in out and "float8 tensorwise (emulated)" in out
    plain, _ = _train(tmp_path / "plain", capsys, *common, "--training.no-bf16_weights")
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in plain], rel=1e-2)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.5


def test_compiled_update_in_the_trainer_follows_torchs_fused_adamw(tmp_path, capsys, cpu_autocast):
    """The update as CUDA runs it (compiled: optimizer.implementation fused here, one graph per parameter group)
    inside the trainer, clip on, against torch's fused AdamW on fp32 weights: the first loss the same, then the
    curves within fp32 rounding's drift (measured: 5e-5 over 8 steps)."""
    common = ["--training.steps", "8", "--optimizer.implementation", "fused", *LEARNING]
    ours, out = _train(tmp_path / "split", capsys, *common)
    assert SPLIT_LINE in out
    plain, _ = _train(tmp_path / "plain", capsys, *common, "--training.no-bf16_weights")
    assert ours[0]["loss"] == plain[0]["loss"]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in plain], rel=2e-4)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.8  # 8.75 -> 7.82 measured


# ------------------------------------------------------------------------------------------------------------
# Under FSDP2 (training.fsdp_bf16_weights): every parameter's shard split
# ------------------------------------------------------------------------------------------------------------

FSDP_SPLIT_LINE = "FSDP2 on bf16 weights (fp32 masters split in two)"
# The clip off (as above), and gradients reduced in bf16: FSDP2 then holds the same bf16 values either way (fp32
# reductions are rounded to bf16 once more on split weights), so the two runs can be compared bit for bit.
FSDP_EXACT = ["--training.max_norm", "1e9", "--training.mixed_precision_reduce", "bfloat16"]


def _bf16_fsdp_policy(param: str, reduce: str, device_type: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from parallelize.fsdp import DTYPES

    return MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])


def _use_bf16_fsdp(setattr_) -> None:
    """FSDP2's bf16 mixed precision on the CPU too, as on CUDA (the plan's policy and the trainer's view of it)."""
    import models.llama3.parallelize as llama3_plan

    setattr_(trainer, "mixed_precision_policy", _bf16_fsdp_policy)
    setattr_(llama3_plan, "mixed_precision_policy", _bf16_fsdp_policy)


@pytest.fixture
def cpu_bf16_fsdp(monkeypatch):
    _use_bf16_fsdp(monkeypatch.setattr)


def fsdp_bf16_job(world_size: int, rank: int, argv: list[str]):
    """A training run on this rank with FSDP2's bf16 policy on the CPU; rank 0 returns its (loss, grad_norm)
    curve and whether it ran on split weights."""
    from tests.parallel_harness import train_job

    _use_bf16_fsdp(setattr)
    printed = train_job(world_size, rank, ["--job.dump_folder", argv[0], *SMALL, *argv[1:]])
    if rank:
        return None
    return _curve(read_metrics(os.path.join(argv[0], "metrics.jsonl"))), FSDP_SPLIT_LINE in printed


@pytest.mark.parametrize("world, layout", [
    (3, ["--parallelism.dp_shard", "3"]),  # shards of uneven sizes (FSDP2 pads them)
    (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    (1, ["--parallelism.fsdp_single_rank", *COMPILED_OP_AC]),  # FSDP2's code path of any size, compiled
    (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]),
    (4, ["--parallelism.dp_shard", "2", "--parallelism.pp", "2", "--training.local_batch_size", "4"]),
    (2, ["--config", "train_configs/qwen3_moe_debug.toml", "--model.flavor", "debugmodel_moe_L2",
         "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
], ids=["fsdp3", "hsdp2x2", "fsdp1_compile_op_ac", "fsdp2_tp2", "pp2_fsdp2", "moe_ep2"])
def test_fsdp_split_weights_train_as_fsdps_bf16_bit_for_bit(world, layout, tmp_path):
    """FSDP2 with bf16 parameters, on split shards and on fp32 shards (torch's foreach AdamW): 4 steps of the
    same losses and gradient norms, bit for bit."""
    from tests.parallel_harness import run_jobs

    common = ["--training.steps", "4", *FSDP_EXACT, *layout]
    runs = run_jobs(world, fsdp_bf16_job, {
        "split": ([str(tmp_path / "split"), *common, "--training.fsdp_bf16_weights"],),
        "plain": ([str(tmp_path / "plain"), *common, "--optimizer.implementation", "foreach"],),
    }, str(tmp_path / "out"))
    (split_curve, split_on), (plain_curve, plain_on) = runs["split"], runs["plain"]
    assert split_on and not plain_on
    assert split_curve == plain_curve
    assert split_curve[-1][0] < split_curve[0][0] - 0.1


def test_fsdp_split_weights_under_float8_train_as_fsdps_bf16(tmp_path, capsys, cpu_bf16_fsdp):
    """torchao's Float8Linear (emulated) on split FSDP2 shards, on one rank: the float8 casts read the
    all-gathered bf16 weights either way, so the curve is plain FSDP's, bit for bit."""
    pytest.importorskip("torchao")
    common = ["--training.steps", "4", "--parallelism.fsdp_single_rank", "--float8.enable", "--float8.emulate",
              *FSDP_EXACT]
    ours, out = _train(tmp_path / "split", capsys, *common, "--training.fsdp_bf16_weights")
    assert FSDP_SPLIT_LINE in out and "float8 tensorwise (emulated)" in out
    plain, _ = _train(tmp_path / "plain", capsys, *common, "--optimizer.implementation", "foreach")
    assert _curve(ours) == _curve(plain)


def _checkpoint_weights(dump) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(dump, "weights.pt")
    dcp_to_torch_save(step_folder(str(dump / "checkpoint"), 2), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k.startswith("model.")}


def test_fsdp_split_weights_save_fp32_masters_and_resume_either_way(tmp_path, capsys, cpu_bf16_fsdp):
    """FSDP2 on one rank: the checkpoint of a run on split shards holds the fp32 weights that a run on fp32
    shards holds, bit for bit but for the ties that split weights store 1 ulp lower (about 1 element in 65,536;
    a lost low half would put nearly every element off by up to half a bf16 step); resumed at step 2 on split
    shards and on fp32 shards, both continue the curve."""
    ckpt = ["--training.steps", "4", "--parallelism.fsdp_single_rank", *FSDP_EXACT, "--checkpoint.enable",
            "--checkpoint.interval", "2"]
    whole, out = _train(tmp_path / "whole", capsys, *ckpt, "--training.fsdp_bf16_weights")
    assert FSDP_SPLIT_LINE in out
    plain, _ = _train(tmp_path / "plain", capsys, *ckpt, "--optimizer.implementation", "foreach")
    assert _curve(whole) == _curve(plain)
    ours, theirs = _checkpoint_weights(tmp_path / "whole"), _checkpoint_weights(tmp_path / "plain")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for key, value in ours.items():
        assert value.dtype == torch.float32, key
        off = (value - theirs[key]).abs()
        assert off.max() < 1e-6 and (off > 0).float().mean() < 1e-4, (key, off.max(), (off > 0).sum())
    for name, extra in (("split", ["--training.fsdp_bf16_weights"]), ("fp32", ["--optimizer.implementation",
                                                                                "foreach"])):
        dump = tmp_path / name
        shutil.copytree(tmp_path / "whole", dump)
        shutil.rmtree(step_folder(str(dump / "checkpoint"), 4))
        rows, out = _train(dump, capsys, *ckpt, *extra)
        assert "resumed from step 2" in out
        assert _curve([r for r in rows if r["step"] > 2][-2:]) == _curve(whole[2:]), name


def test_fsdp_split_weights_refuse_what_they_do_not_cover():
    from engine.config import ConfigError, parse_args
    from engine.config.validation import validate

    def error(world: int, *args: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(parse_args(["--training.fsdp_bf16_weights", *args]), world, check_paths=False)
        return str(e.value)

    assert "this layout has no FSDP" in error(1)
    assert "mixed_precision_param = bfloat16" in error(2, "--training.mixed_precision_param", "float32")
    assert "not with gradient accumulation" in error(2, "--training.global_batch_size", "32")
    validate(parse_args(["--training.fsdp_bf16_weights", "--parallelism.fsdp_single_rank"]), 1, check_paths=False)


def tied_split_job(world_size: int, rank: int):
    """A module whose embedding and output projection share one weight, under FSDP2 over the ranks, split."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parallelize.bf16_weights import split_fsdp_weights

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.out = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.mid(self.emb(x)))

    torch.manual_seed(0)
    model = Tied()
    mesh = init_device_mesh("cpu", (world_size,))
    policy = _bf16_fsdp_policy("bfloat16", "float32", "cpu")
    fully_shard(model.mid, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    lows = split_fsdp_weights([model])
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    model(torch.randint(0, 10, (3, 4))).float().sum().backward()
    return {"lows": len(lows), "tied": model.out.weight is model.emb.weight,
            "dtypes": {n: (p.dtype, p.grad.dtype) for n, p in model.named_parameters()},
            "state": {k: (v.dtype, bool(torch.equal(v, before[k]))) for k, v in after.items()}}


def test_a_tied_weight_is_split_once_and_its_state_dict_entries_stay_fp32(tmp_path):
    from tests.parallel_harness import run_jobs

    result = run_jobs(2, tied_split_job, {"tied": ()}, str(tmp_path))["tied"]
    assert result["lows"] == 3 and result["tied"]  # emb/out's weight, mid's weight and bias
    assert set(result["dtypes"].values()) == {(torch.bfloat16, torch.bfloat16)}
    assert result["state"] == {k: (torch.float32, True) for k in ("emb.weight", "mid.weight", "mid.bias",
                                                                  "out.weight")}
