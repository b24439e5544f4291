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


def test_grouped_matmul_and_its_loop_fallback_agree(monkeypatch):
    torch.manual_seed(0)
    x, w = torch.randn(20, 16), torch.randn(4, 12, 16)
    counts = torch.tensor([3, 0, 9, 8])
    loop = torch.cat([x[:3] @ w[0].T, x[3:12] @ w[2].T, x[12:] @ w[3].T])
    assert moe.grouped_mm_works("cpu", torch.float32) == hasattr(torch, "_grouped_mm")
    torch.testing.assert_close(grouped_matmul(x, w, counts), loop)
    monkeypatch.setattr(moe, "grouped_mm_works", lambda device_type, dtype: False)
    assert torch.equal(grouped_matmul(x, w, counts), loop)


def test_gradients_reach_every_expert_that_got_tokens_and_the_router():
    layer = build(num_shared_experts=1)
    x = torch.randn(4, 6, DIM, requires_grad=True)
    (layer(x).square().sum() + layer.aux_loss).backward()
    got = layer.tokens_per_expert > 0
    per_expert = layer.experts.w1.grad.flatten(1).abs().sum(1)
    assert torch.equal(per_expert > 0, got)
    assert layer.router.gate.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert layer.shared_experts.w2.grad.abs().sum() > 0


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
