"""The MoE layer (models/moe.py) against transformers' Qwen3-MoE block, a token-by-token reference, and its load
balancing rules (CPU, fast)."""

import pytest
import torch
import torch.nn.functional as F

from models import moe
from models.moe import MoE, MoEArgs, grouped_matmul

DIM = 32


def build(seed: int = 0, **overrides) -> MoE:
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": 24, **overrides})
    torch.manual_seed(seed)
    layer = MoE(DIM, args)
    layer.init_weights(init_std=0.05)
    return layer


def reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: each token through its top-k experts (chosen with the bias, weighted without it), in fp32."""
    a, e = layer.args, layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = layer.router.gate.weight @ x[t]
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        bias = layer.expert_bias if layer.expert_bias is not None else torch.zeros_like(scores)
        chosen = torch.topk(scores + bias, a.top_k).indices
        weights = scores[chosen] / (scores[chosen].sum() if a.route_norm else 1)
        for w, i in zip(weights * a.route_scale, chosen):
            out[t] += w * (e.w2[i] @ (F.silu(e.w1[i] @ x[t]) * (e.w3[i] @ x[t])))
        if layer.shared_experts is not None:
            s = layer.shared_experts
            out[t] += s.w2[0] @ (F.silu(s.w1[0] @ x[t]) * (s.w3[0] @ x[t]))
    return out


@pytest.mark.parametrize("options", [{}, {"route_norm": True}, {"score_func": "sigmoid", "route_norm": True,
                                                                 "route_scale": 2.5, "num_shared_experts": 2,
                                                                 "load_balance_coeff": 1e-3}])
def test_moe_matches_a_token_by_token_reference(options):
    layer = build(**options)
    if layer.expert_bias is not None:  # a bias that changes some choices
        layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    x = torch.randn(3, 5, DIM)
    out = layer(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, DIM), reference(layer, x.reshape(-1, DIM)), rtol=1e-5, atol=1e-6)
    assert layer.tokens_per_expert.sum() == 15 * 2  # dropless: every token reaches its two experts


def test_the_bias_chooses_the_experts_but_not_their_weights():
    layer = build(score_func="sigmoid", load_balance_coeff=1e-3)
    x = torch.randn(1, DIM)
    _, plain, _ = layer.router(x)
    bias = torch.zeros(8)
    bias[plain[0, 0]] = -10.0  # the first choice is pushed out
    weights, chosen, _ = layer.router(x, bias)
    assert plain[0, 0] not in chosen[0]
    scores = torch.sigmoid(layer.router.gate(x))
    torch.testing.assert_close(weights, scores.gather(-1, chosen))


def test_moe_matches_transformers_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

    for norm in (False, True):
        config = Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=norm)
        theirs = Qwen3MoeSparseMoeBlock(config)
        ours = build(route_norm=norm)
        with torch.no_grad():
            theirs.gate.weight.copy_(ours.router.gate.weight)
            theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
            theirs.experts.down_proj.copy_(ours.experts.w2)
        x = torch.randn(2, 7, DIM)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
        logits = ours.router.gate(x.reshape(-1, DIM))
        torch.testing.assert_close(ours.aux_loss, load_balancing_loss_func((logits,), 8, 2))


def test_grouped_matmul_and_its_loop_fallback_agree():
    torch.manual_seed(0)
    x, w = torch.randn(20, 16, requires_grad=True), torch.randn(4, 12, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 9, 8])
    loop = torch.cat([x[:3] @ w[0].T, x[3:12] @ w[2].T, x[12:] @ w[3].T])
    grad = torch.randn_like(loop)
    expected = torch.autograd.grad(loop, (x, w), grad)
    assert not moe.grouped_mm_works("cpu", torch.float32)  # fp32: the loop, exactly the same arithmetic
    out = grouped_matmul(x, w, counts)
    assert torch.equal(out, loop)
    for got, want in zip(torch.autograd.grad(out, (x, w), grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if moe.grouped_mm_works("cpu", torch.bfloat16):  # one grouped GEMM
        xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
        torch.testing.assert_close(grouped_matmul(xb, wb, counts), _loop_of(xb, wb), rtol=2e-2, atol=2e-2)


def _loop_of(x, w):
    return torch.cat([x[:3] @ w[0].T, x[3:12] @ w[2].T, x[12:] @ w[3].T])


def test_gradients_reach_every_expert_that_got_tokens_and_the_router():
    layer = build(num_shared_experts=1)
    x = torch.randn(4, 6, DIM, requires_grad=True)
    (layer(x).square().sum() + layer.aux_loss).backward()
    got = layer.tokens_per_expert > 0
    per_expert = layer.experts.w1.grad.flatten(1).abs().sum(1)
    assert torch.equal(per_expert > 0, got)
    assert layer.router.gate.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert layer.shared_experts.w2.grad.abs().sum() > 0


def test_the_auxiliary_loss_weight_trains_it_as_if_it_were_added_to_the_loss():
    """With ``aux_loss_weight`` w, backward through the layer's output alone gives every parameter and the input
    the gradients of ``loss + w * aux_loss``: what lets the auxiliary loss train on any pipeline stage."""
    x = torch.randn(4, 6, DIM)
    grads = {}
    for name, weight in (("added", 0.0), ("weighted", 0.3), ("untrained", 0.0)):
        layer = build(num_shared_experts=1)
        layer.aux_loss_weight = weight
        inp = x.clone().requires_grad_()
        loss = layer(inp).square().sum()
        (loss + 0.3 * layer.aux_loss if name == "added" else loss).backward()
        grads[name] = {"input": inp.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    for key, grad in grads["added"].items():
        torch.testing.assert_close(grads["weighted"][key], grad, msg=lambda m: f"{key}: {m}")
    assert not torch.allclose(grads["untrained"]["router.gate.weight"], grads["added"]["router.gate.weight"])


def test_expert_bias_moves_towards_the_less_loaded_experts_and_counts_restart():
    layer = build(load_balance_coeff=0.01)
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5]))
    assert layer.expert_load() == pytest.approx(10 / 5)
    layer.update_expert_bias()
    bias = layer.expert_bias
    assert bias[0] < 0 < bias[1] and bias.sum().abs() < 1e-7  # centred: only the differences matter
    assert torch.all(layer.tokens_per_expert == 0)
    plain = build()
    assert plain.expert_bias is None and "expert_bias" not in plain.state_dict()
    assert "expert_bias" in layer.state_dict() and "tokens_per_expert" not in layer.state_dict()


@pytest.mark.parametrize("bad, field", [({"top_k": 9}, "top_k"), ({"top_k": 0}, "top_k"),
                                        ({"score_func": "relu"}, "score_func")])
def test_impossible_arguments_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        MoEArgs(**{"num_experts": 8, **bad})


def _register(name: str, **changes):
    import dataclasses

    from models.registry import get_model_spec, register_model_spec

    base = get_model_spec("llama3")
    flavor = dataclasses.replace(base.flavors["debugmodel"], **changes)
    register_model_spec(dataclasses.replace(base, name=name, flavors={"debugmodel": flavor}))


def test_a_layout_a_flavor_cannot_be_split_by_is_one_error_naming_the_field():
    """MoE layers under TP are sharded by FSDP over the TP ranks: TP alone, without FSDP, is refused."""
    from engine.config import ConfigError, parse_args
    from engine.config.validation import validate

    _register("llama3_moe", moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=64))
    with pytest.raises(ConfigError, match=r"^parallelism.tp: llama3_moe/debugmodel runs its Mixture-of-Experts"):
        validate(parse_args(["--model.name", "llama3_moe", "--parallelism.tp", "2"]), 2)
    validate(parse_args(["--model.name", "llama3_moe", "--parallelism.dp_shard", "2"]), 2)


@pytest.mark.parametrize("flavor, argv, world, message", [
    ("debugmodel", ["--parallelism.ep", "2"], 2, "parallelism.ep: qwen3/debugmodel has no Mixture-of-Experts"),
    ("debugmodel_moe", ["--parallelism.ep", "3"], 3, "parallelism.ep: 3 does not divide qwen3/debugmodel_moe's 8 "
                                                     "experts"),
    ("debugmodel_moe", ["--parallelism.ep", "4", "--parallelism.tp", "2"], 4,
     r"parallelism.ep: 4 does not divide dp_shard x cp = 2 x 1"),
    ("debugmodel_moe", ["--parallelism.ep", "0"], 2, "parallelism.ep: must be >= 1"),
])
def test_impossible_expert_parallel_layouts_are_one_error_naming_the_field(flavor, argv, world, message):
    from engine.config import ConfigError, parse_args
    from engine.config.validation import validate

    with pytest.raises(ConfigError, match="^" + message):
        validate(parse_args(["--model.name", "qwen3", "--model.flavor", flavor, *argv]), world)
    validate(parse_args(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.ep", "2",
                         "--parallelism.tp", "2"]), 4)


def test_compiled_moe_matches_eager_without_a_graph_break():
    """Forward, auxiliary loss, expert counts and gradients (the auxiliary loss's included) of the compiled layer."""
    layer = build(num_shared_experts=1, load_balance_coeff=1e-3)
    layer.aux_loss_weight = 0.3
    x = torch.randn(2, 9, DIM, requires_grad=True)
    eager = layer(x)
    eager_aux, eager_counts = layer.aux_loss, layer.tokens_per_expert.clone()
    eager.square().sum().backward()
    eager_grads = {n: p.grad for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    layer.tokens_per_expert.zero_()
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.aux_loss, eager_aux)
    assert torch.equal(layer.tokens_per_expert, eager_counts)
    out.square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("compiled", [False, True])
def test_under_autocast_the_experts_compute_in_its_dtype(compiled):
    """One GPU without FSDP trains fp32 weights under bf16 autocast: the experts' GEMMs take bf16 copies of the
    weights and the input, as autocast does for nn.Linear (one dtype for both operands, which the grouped GEMM
    needs), eager and compiled alike, and the gradients reach the fp32 weights. CPU autocast stands in for CUDA's."""
    layer = build(num_shared_experts=1)
    torch.manual_seed(1)
    x = torch.randn(18, DIM)
    counts = torch.tensor([3, 0, 5, 2, 1, 4, 0, 3])
    experts = layer.experts
    bf16 = moe.GroupedExperts(DIM, 24, 8)  # the same weights stored in bf16, given a bf16 input, no autocast
    bf16.load_state_dict(experts.state_dict())
    expected = bf16.bfloat16()(x.bfloat16(), counts)
    run = torch.compile(experts, fullgraph=True) if compiled else experts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(x, counts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0 if not compiled else 1e-2, atol=0 if not compiled else 1e-3)
    # The whole layer under autocast: its output near the fp32 one, its gradients in the weights' fp32.
    x = torch.randn(2, 9, DIM)
    full = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = (torch.compile(layer, fullgraph=True) if compiled else layer)(x)
    assert out.dtype == torch.float32 and not torch.equal(out, full)
    torch.testing.assert_close(out, full, rtol=5e-2, atol=5e-3)
    out.square().sum().backward()
    assert experts.w2.grad.dtype == torch.float32 and experts.w2.grad.abs().sum() > 0
    assert layer.shared_experts.w1.grad.abs().sum() > 0


def test_a_moe_model_trains_logs_its_expert_load_and_balances(tmp_path, capsys):
    """A MoE variant of the debug model, 12 steps at the full lr from the first: the auxiliary loss joins the trained
    loss (not the logged one) and keeps the router balanced, metrics.jsonl, the console and experts.png carry the
    expert load, and the expert bias moves and is saved."""
    from engine import train
    from engine.checkpoint.files import read_full, step_folder
    from engine.plot import read_metrics

    _register("llama3_moe_bias", moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=128, load_balance_coeff=1e-2),
              n_dense_layers=1)
    common = ["--model.name", "llama3_moe_bias", "--training.seq_len", "64", "--training.local_batch_size", "2",
              "--training.steps", "12", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
              "--debug.deterministic"]
    runs = {}
    for coeff in ("0", "0.5"):
        dump = tmp_path / f"aux{coeff}"
        extra = ["--checkpoint.enable", "--checkpoint.interval", "6"] if coeff == "0" else []
        assert train.main([*common, "--job.dump_folder", str(dump), "--model.moe_aux_loss_coeff", coeff, *extra]) == 0
        runs[coeff] = read_metrics(str(dump / "metrics.jsonl"))
        out = capsys.readouterr().out
        assert "expert_load: " in out and "aux_loss: " in out
        assert (dump / "experts.png").stat().st_size > 0
    plain, balanced = runs["0"], runs["0.5"]
    assert all(len(r["expert_load"]) == 5 and r["expert_load_max"] >= 1.0 for r in plain)  # 5 of 6 blocks
    assert plain[0]["loss"] == balanced[0]["loss"]  # the logged loss is the cross-entropy
    assert plain[-1]["loss"] != balanced[-1]["loss"]  # the auxiliary loss was trained
    # Without it the router drifts from balance as the cross-entropy trains it (the aux loss up by 0.2 or more by
    # steps 7-12); with it, it stays near 2.0. One batch moves it by about 0.05, so the later steps' mean is compared.
    late = [sum(r["moe_aux_loss"] for r in run[6:]) / 6 for run in (plain, balanced)]
    assert late[1] < late[0] - 0.05, late
    state = read_full(step_folder(str(tmp_path / "aux0" / "checkpoint"), 12), "model.")
    biases = [v for k, v in state.items() if k.endswith("expert_bias")]
    assert len(biases) == 5 and all(b.abs().sum() > 0 for b in biases)


def test_every_shipped_moe_config_balances_its_experts():
    """A MoE config without load balancing collapses: the debug MoE model routed every token of some layers to 2
    of its 8 experts within 50 steps. Every shipped config of a MoE flavor weighs the auxiliary loss or uses a flavor
    with DeepSeek-V3's expert bias."""
    import glob

    from engine.config import parse_args
    from models.registry import get_model_spec

    moe_configs = []
    for path in sorted(glob.glob("train_configs/*.toml")):
        model = parse_args(["--config", path]).model
        args = get_model_spec(model.name).flavors[model.flavor]
        if getattr(args, "moe", None) is None:
            continue
        moe_configs.append(path)
        assert model.moe_aux_loss_coeff > 0 or args.moe.load_balance_coeff is not None, path
    assert len(moe_configs) >= 3, moe_configs
