"""Tests of the model registry, the attention backends and the Llama 3 model (CPU, fast)."""

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import models.registry
from models.registry import ModelSpec, get_model_spec, model_names
from models.attention import attention, flash_attn_available
from models.llama3 import Transformer, TransformerModelArgs, llama3_flavors
from models.llama3.model import count_params, flops_per_token, num_params, precompute_rope_inv_freq

VOCAB = 512


def debug_args(**overrides) -> TransformerModelArgs:
    return dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=VOCAB, **overrides)


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """Build on meta, materialize on CPU, initialize (the way the trainer does)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    return model


# ----------------------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------------------


def test_registry():
    assert "llama3" in model_names()
    spec = get_model_spec("llama3")
    assert isinstance(spec, ModelSpec)
    assert spec.model_cls is Transformer and spec.args_cls is TransformerModelArgs
    assert {"debugmodel", "8B", "8B_L8", "8B_L2", "70B", "405B"} <= set(spec.flavors)
    assert spec.flops_per_token is flops_per_token
    from models.llama3.parallelize import parallelize_llama, pipeline_stage

    assert spec.parallelize_fn is parallelize_llama
    from models.llama3.hf_adapter import Llama3HFAdapter

    assert spec.pipeline_fn is pipeline_stage and spec.state_dict_adapter is Llama3HFAdapter
    with pytest.raises(ValueError, match="model.name.*llama3"):
        get_model_spec("no_such_model")
    assert models.registry.get_model_spec is get_model_spec


def test_a_model_without_a_pipeline_split_refuses_pipeline_parallelism():
    from engine.config import ConfigError, parse_args
    from engine.config.validation import validate

    spec = dataclasses.replace(get_model_spec("llama3"), name="llama3_no_pp_split", pipeline_fn=None)
    models.registry.register_model_spec(spec)
    cfg = parse_args(["--config", "train_configs/debug_model.toml", "--model.name", "llama3_no_pp_split",
                      "--parallelism.pp", "2"])
    with pytest.raises(ConfigError, match=r"^parallelism\.pp: model 'llama3_no_pp_split' has no pipeline split .*"
                                          r"set parallelism\.pp = 1$"):
        validate(cfg, 2)
    validate(parse_args(["--config", "train_configs/debug_model.toml", "--model.name", "llama3_no_pp_split"]), 1)


def test_pipeline_stage_splits_without_dropping_or_duplicating():
    from models.llama3.parallelize import pipeline_stage

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256))
    n = model.n_layers
    ranges = [range(0, 2), range(2, n - 1), range(n - 1, n)]
    parts = [pipeline_stage(model, i, 3, r) for i, r in enumerate(ranges)]
    assert [list(p.layers.keys()) for p in parts] == [[str(i) for i in r] for r in ranges]
    assert [p.tok_embeddings is not None for p in parts] == [True, False, False]
    assert [(p.norm is not None, p.output is not None) for p in parts] == [(False, False)] * 2 + [(True, True)]
    assert len(model.layers) == n and model.norm is not None  # the whole model is left as it was


def test_flavor_shapes():
    f = llama3_flavors
    assert f["debugmodel"].vocab_size == -1 and f["debugmodel"].n_kv_heads == 8
    assert f["8B_L8"].n_layers == 8 and f["8B_L2"].n_layers == 2
    for name in ("8B_L8", "8B_L2"):
        assert dataclasses.replace(f[name], n_layers=32) == f["8B"]
    for name in ("8B", "70B", "405B"):
        assert f[name].rope_scaling and f[name].rope_theta == 500000 and f[name].vocab_size == 128256


# ----------------------------------------------------------------------------------------------------------------
# parameter and FLOP counts
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flavor,published,tol",
    [("8B", 8_030_261_248, 0.0), ("70B", 70_553_706_496, 0.005), ("405B", 405_853_388_800, 0.005)],
)
def test_param_counts_on_meta(flavor, published, tol):
    args = llama3_flavors[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    n = count_params(model)
    assert abs(n - published) <= tol * published, (flavor, n)
    assert n == num_params(args)
    assert count_params(model, exclude_embedding=True) == num_params(args, exclude_embedding=True)
    assert n - count_params(model, exclude_embedding=True) == args.vocab_size * args.dim
    if flavor == "8B":
        assert f"{n / 1e9:.2f}B" == "8.03B"


def test_param_counts_small_flavors():
    for name in ("8B_L8", "8B_L2"):
        args = llama3_flavors[name]
        with torch.device("meta"):
            model = Transformer(args)
        assert count_params(model) == num_params(args)
    args = debug_args()
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(model) == num_params(args)
    with pytest.raises(ValueError, match="vocab_size"):
        num_params(llama3_flavors["debugmodel"])


def test_flops_per_token_8b_hand_count():
    # Published Llama 3 8B shapes.
    n_layers, n_heads, head_dim, seq_len = 32, 32, 128, 8192  # dim 4096, vocabulary 128256
    embedding = 128256 * 4096
    per_layer = (
        4096 * 4096  # wq
        + 4096 * 1024  # wk
        + 4096 * 1024  # wv
        + 4096 * 4096  # wo
        + 3 * 4096 * 14336  # w1, w2, w3
        + 2 * 4096  # attention_norm, ffn_norm
    )
    total = embedding + 32 * per_layer + 4096 + 128256 * 4096  # + final norm + output
    assert total == 8_030_261_248
    expected = 6 * (total - embedding) + 12 * n_layers * n_heads * head_dim * seq_len
    assert flops_per_token(llama3_flavors["8B"], seq_len) == expected
    assert get_model_spec("llama3").flops_per_token(llama3_flavors["8B"], seq_len) == expected


# ----------------------------------------------------------------------------------------------------------------
# args
# ----------------------------------------------------------------------------------------------------------------


def test_update_from_config():
    base = llama3_flavors["debugmodel"]
    cfg = SimpleNamespace(attn="flex", attn_mask="block_causal", vocab_size=-1)
    args = base.update_from_config(cfg, tokenizer_vocab_size=1000, seq_len=4096)
    assert (args.attn, args.attn_mask, args.vocab_size, args.max_seq_len) == ("flex", "block_causal", 1000, 4096)
    assert base.vocab_size == -1 and base.attn == "sdpa"  # the flavor is untouched
    args = base.update_from_config(SimpleNamespace(attn="sdpa", attn_mask="causal", vocab_size=2048), 1000, 128)
    assert args.vocab_size == 2048 and args.max_seq_len == 2048
    cfg = SimpleNamespace(attn="sdpa", attn_mask="causal", vocab_size=-1)
    eight = llama3_flavors["8B"].update_from_config(cfg, 1000, 8192)
    assert eight.vocab_size == 128256 and eight.max_seq_len == 131072
    with pytest.raises(ValueError, match=r"^model.vocab_size: 500 \(set\) is smaller than the vocabulary of the "
                       r"tokenizer \(data.tokenizer\), 1000; set model.vocab_size to at least 1000 or use another"):
        base.update_from_config(SimpleNamespace(attn="sdpa", attn_mask="causal", vocab_size=500), 1000, 128)
    with pytest.raises(ValueError, match=r"^model.vocab_size: 128256 \(the flavor's\) is smaller than the "):
        llama3_flavors["8B"].update_from_config(cfg, 130000, 8192)
    with pytest.raises(ValueError, match="model.attn"):
        base.update_from_config(SimpleNamespace(attn="nope", attn_mask="causal", vocab_size=-1), 1000, 128)


# ----------------------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------------------


def test_debugmodel_meta_init_forward_backward():
    args = debug_args()
    model = build(args, seed=0)
    assert model.rope_table.device.type == "cpu" and model.rope_table.dtype == torch.float32
    assert "rope_table" not in model.state_dict()
    assert list(model.layers.keys()) == [str(i) for i in range(6)]
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    for name, b in model.named_buffers():
        assert torch.isfinite(torch.view_as_real(b) if b.is_complex() else b).all(), name
    # Norms are ones; init stds are the documented ones (roughly).
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) < 0.002
    assert abs(model.layers["5"].attention.wo.weight.std().item() - 0.02 / 12**0.5) < 0.001
    assert abs(model.output.weight.std().item() - args.dim**-0.5) < 0.1 * args.dim**-0.5
    assert model.output.weight.abs().max().item() <= 3 * args.dim**-0.5 + 1e-6

    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 64, VOCAB)
    assert torch.isfinite(logits).all()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers["0"].attention.wq.weight.grad.abs().sum() > 0

    # Same seed => identical weights; another seed => different weights.
    same = build(args, seed=0)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), same.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    other = build(args, seed=1)
    assert not torch.equal(model.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)


def test_init_weights_recomputes_rope_table_matches_eager_build():
    args = debug_args(n_layers=1)
    torch.manual_seed(0)
    eager = Transformer(args)
    model = build(args)
    assert torch.equal(model.rope_table, eager.rope_table)
    assert model.rope_table.shape == (args.max_seq_len, args.head_dim // 2, 2)


def test_pipeline_style_pieces_can_be_none():
    args = debug_args(n_layers=2)
    model = build(args)
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        full = model(tokens)
        first = build(args)
        del first.layers["1"]
        first.norm, first.output = None, None
        h = first(tokens)
        assert h.shape == (2, 16, args.dim)
        second = build(args)
        del second.layers["0"]
        second.tok_embeddings = None
        assert list(second.layers.keys()) == ["1"]
        second.init_weights()  # works with pieces missing
        second.load_state_dict(model.state_dict(), strict=False)
        first.load_state_dict(model.state_dict(), strict=False)
        out = second(first(tokens))
    torch.testing.assert_close(out, full, rtol=0, atol=1e-5)


def test_block_causal_requires_doc_ids():
    model = build(debug_args(n_layers=1, attn="flex", attn_mask="block_causal"))
    with pytest.raises(ValueError, match="doc_ids"):
        with torch.no_grad():
            model(torch.randint(0, VOCAB, (1, 8)))


# ----------------------------------------------------------------------------------------------------------------
# attention backends
# ----------------------------------------------------------------------------------------------------------------


def _qkv(B=2, Hq=8, Hkv=2, S=64, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g)
    return q, torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)


def test_flex_equals_sdpa_causal():
    q, k, v = _qkv()
    ref = attention(q, k, v, "sdpa")
    assert ref.shape == q.shape
    with torch.no_grad():  # the flex kernel itself (no CPU backward in torch)
        out = attention(q, k, v, "flex")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # With gradients on CPU the flex backend falls back to SDPA and still matches.
    qg = q.clone().requires_grad_()
    out = attention(qg, k, v, "flex")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()


@pytest.fixture
def sdpa_kernels():
    """Restores torch's SDPA kernel choice (process-wide) after the test."""
    from models.attention import select_sdpa_backend

    yield select_sdpa_backend
    select_sdpa_backend("auto")


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_sdpa_backend_choice_gives_the_same_attention(kernel, sdpa_kernels, monkeypatch):
    import models.attention as A

    q, k, v = (t.requires_grad_() for t in _qkv())
    ref = attention(q, k, v, "sdpa")
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    sdpa_kernels(kernel)
    assert torch.backends.cuda.math_sdp_enabled() == (kernel == "math")
    assert torch.backends.cuda.flash_sdp_enabled() == (kernel == "flash")
    out = attention(q, k, v, "sdpa")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The path of the kernels without grouped-query support (efficient, and cudnn where the probe says so:
    # CUDA only): K/V repeated to the query heads, here run by the CPU kernel chosen above.
    monkeypatch.setattr(A, "_gqa_native", False)
    out = attention(q, k, v, "sdpa")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v)), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _doc_ids(B, S):
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 20:] = 1
    doc[0, 41:] = 2
    doc[1, 33:] = 7
    return doc


def _per_document_sdpa(q, k, v, doc):
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in doc[b].unique():
            idx = (doc[b] == d).nonzero().squeeze(1)
            s, e = idx.min().item(), idx.max().item() + 1
            assert e - s == idx.numel()  # documents are contiguous
            out[b, :, s:e] = F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True, enable_gqa=True
            )[0]
    return out


def test_flex_document_mask_equals_per_document_sdpa():
    q, k, v = _qkv(S=64)
    doc = _doc_ids(2, 64)
    ref = _per_document_sdpa(q, k, v, doc)
    with torch.no_grad():
        out = attention(q, k, v, "flex", doc_ids=doc)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # Differs from plain causal attention (the mask is really applied).
    assert (out - attention(q, k, v, "sdpa")).abs().max() > 1e-2
    # The CPU training path (dense-mask SDPA) agrees too, and backpropagates.
    qg = q.clone().requires_grad_()
    out = attention(qg, k, v, "flex", doc_ids=doc)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()


def test_flex_training_path_compiles_in_one_graph():
    """compile.enable compiles each block with fullgraph: the CPU training path of document masking must trace
    without a graph break (its one-time log line broke it)."""
    import models.attention as attention_module

    q, k, v = _qkv(S=64)
    doc = _doc_ids(2, 64)
    attention_module._warned_cpu_fallback = False  # the log line is due
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: attention(q, k, v, "flex", doc_ids=doc), fullgraph=True, backend="eager")
    qg = q.clone().requires_grad_()
    out = compiled(qg)
    torch.testing.assert_close(out, _per_document_sdpa(q, k, v, doc), rtol=0, atol=1e-5)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()


def test_sdpa_with_doc_ids_raises():
    q, k, v = _qkv(S=16)
    with pytest.raises(ValueError, match="flex"):
        attention(q, k, v, "sdpa", doc_ids=torch.zeros(2, 16, dtype=torch.long))


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_flash_attn_missing_raises():
    assert not flash_attn_available()
    q, k, v = _qkv(S=16)
    with pytest.raises(ValueError, match="model.attn"):
        attention(q, k, v, "flash_attn")


def _fake_flash_attn4(monkeypatch) -> None:
    """flash-attn-4's two private functions (the only ones models/attention.py calls), as math on CPU with its
    layouts: q [B, S, Hq, D], k/v [B, S, Hkv, D], the log-sum-exp [B, Hq, S]."""
    import sys
    import types

    def fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False):
        rep = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        scores = qt @ kt.transpose(-1, -2) * softmax_scale
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")) if causal else scores
        lse = scores.logsumexp(-1)
        return ((scores - lse[..., None]).exp() @ vt).transpose(1, 2).to(q.dtype), lse

    def bwd(q, k, v, out, dout, lse, softmax_scale, causal, *args, **kwargs):  # attention's gradients, by hand
        b, s, hq, d = q.shape
        rep = hq // k.shape[2]
        qt, kt, vt, ot, dot = (t.transpose(1, 2).float() for t in (q, k, v, out, dout))
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        scores = qt @ kt.transpose(-1, -2) * softmax_scale
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        p = (scores - lse[..., None]).exp()
        dp = dot @ vt.transpose(-1, -2)
        ds = p * (dp - (dot * ot).sum(-1, keepdim=True))
        dq = ds @ kt * softmax_scale
        dk = (ds.transpose(-1, -2) @ qt * softmax_scale).unflatten(1, (-1, rep)).sum(2)
        dv = (p.transpose(-1, -2) @ dot).unflatten(1, (-1, rep)).sum(2)
        return tuple(g.transpose(1, 2).to(q.dtype) for g in (dq, dk, dv))

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd, module._flash_attn_bwd = fwd, bwd
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flash_attn4_operator_matches_sdpa_and_compiles_whole(monkeypatch, compiled):
    """The tessera::flash_attn operator wraps FlashAttention 4 (here a CPU stand-in of its two functions): its
    output and q/k/v gradients are SDPA's, under grouped-query attention, and torch.compile traces it whole."""
    from models.attention import flash_attn4

    _fake_flash_attn4(monkeypatch)
    q, k, v = _qkv(S=16)  # [B, H, S, D]
    grads = []
    for use_flash in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if use_flash:
            def fn(q, k, v):
                return flash_attn4(*(t.transpose(1, 2).contiguous() for t in (q, k, v)))[0].transpose(1, 2)

            out = (torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn)(*leaves)
        else:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.square().sum().backward()
        grads.append((out.detach(), *(t.grad for t in leaves)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_backend_raises():
    q, k, v = _qkv(S=16)
    with pytest.raises(ValueError, match="model.attn"):
        attention(q, k, v, "nope")


def test_model_flex_equals_sdpa_same_weights():
    args = debug_args(n_layers=2)
    sdpa_model = build(args)
    flex_model = build(dataclasses.replace(args, attn="flex"))
    flex_model.load_state_dict(sdpa_model.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = sdpa_model(tokens)
        out = flex_model(tokens)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_model_block_causal_equals_separate_documents():
    args = debug_args(n_layers=2, attn="flex", attn_mask="block_causal")
    model = build(args)
    tokens = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    doc = torch.zeros(1, 48, dtype=torch.long)
    doc[0, 30:] = 1
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc)
        first = model(tokens[:, :30], doc_ids=doc[:, :30])
        second = model(tokens[:, 30:], doc_ids=doc[:, 30:])
    # RoPE is relative, so the second document at offset 30 matches it run alone from position 0.
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=0, atol=1e-4)
    # Training path on CPU (grad enabled) gives the same logits.
    train_logits = model(tokens, doc_ids=doc)
    torch.testing.assert_close(train_logits.detach(), packed, rtol=0, atol=1e-5)
    train_logits.sum().backward()
    # A causal model ignores doc_ids.
    causal = build(dataclasses.replace(args, attn_mask="causal"))
    with torch.no_grad():
        torch.testing.assert_close(causal(tokens, doc_ids=doc), causal(tokens), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------------------------


def test_rope_scaling_matches_transformers():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = llama3_flavors["8B"]
    config = LlamaConfig(
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    ours = precompute_rope_inv_freq(args.head_dim, args.rope_theta, rope_scaling=True)
    assert ours.shape == hf_inv_freq.shape == (64,)
    torch.testing.assert_close(ours, hf_inv_freq, rtol=0, atol=1e-6)
    unscaled = precompute_rope_inv_freq(args.head_dim, args.rope_theta, rope_scaling=False)
    assert not torch.allclose(ours, unscaled)  # scaling changes the low frequencies
    torch.testing.assert_close(ours[:10], unscaled[:10], rtol=0, atol=0)  # and keeps the high ones
    # The model's RoPE table uses those frequencies: angle(position p) = p * inv_freq.
    model_args = dataclasses.replace(args, n_layers=1, dim=256, n_heads=2, n_kv_heads=2, max_seq_len=16, vocab_size=8)
    with torch.device("meta"):
        m = Transformer(model_args)
    m.to_empty(device="cpu")
    m.init_weights()
    torch.testing.assert_close(m.rope_table[5], torch.stack((torch.cos(5 * ours), torch.sin(5 * ours)), dim=-1))


def test_rope_is_interleaved_meta_layout():
    # Meta's layout rotates the pairs (x[2i], x[2i+1]); check one pair by hand.
    from models.llama3.model import apply_rotary_emb, precompute_rope_table

    fc = precompute_rope_table(4, 3, theta=10000.0)
    x = torch.zeros(1, 3, 1, 4)
    x[..., 0] = 1.0  # first pair = (1, 0)
    q, _ = apply_rotary_emb(x, x, fc)
    angle = 2 * 1.0  # position 2, inv_freq[0] = 1
    expected = torch.tensor([torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))])
    torch.testing.assert_close(q[0, 2, 0, :2], expected)
    assert q[0, 2, 0, 2:].abs().max() == 0


def test_rope_real_arithmetic_and_complex_product_agree():
    # The rotation is the complex product (a + ib) e^(i angle) of Meta's reference; apply_rotary_emb computes it as
    # that product eagerly (rope_complex) and in real arithmetic when compiled (rope_real): both match it.
    from models.llama3.model import (apply_rotary_emb, precompute_rope_inv_freq, precompute_rope_table, rope_complex,
                                     rope_real)

    torch.manual_seed(0)
    head_dim, S = 16, 11
    xq, xk = torch.randn(2, S, 4, head_dim), torch.randn(2, S, 2, head_dim)
    table = precompute_rope_table(head_dim, S, 500000.0, rope_scaling=True)
    angles = torch.outer(torch.arange(S, dtype=torch.float32), precompute_rope_inv_freq(head_dim, 500000.0, True))
    cis = torch.polar(torch.ones_like(angles), angles).view(1, S, 1, head_dim // 2)
    for rope in (rope_complex, rope_real, apply_rotary_emb):
        q, k = rope(xq, xk, table)
        for x, out in ((xq, q), (xk, k)):
            expected = torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * cis).flatten(3)
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=rope.__name__)
        bf = rope(xq.bfloat16(), xk.bfloat16(), table)
        assert bf[0].dtype == bf[1].dtype == torch.bfloat16, rope.__name__
        torch.testing.assert_close(bf[0].float(), q, rtol=0, atol=2e-2, msg=rope.__name__)  # bf16 rounding


def test_rope_compiles_without_complex_operators():
    # Inductor generates no code for complex operators (it warns and runs them as eager kernels): the RoPE a
    # compiled block runs must be real arithmetic, fused with its neighbours.
    import warnings

    from models.llama3.model import apply_rotary_emb, precompute_rope_table

    torch._dynamo.reset()
    x = torch.randn(1, 8, 2, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, k = torch.compile(apply_rotary_emb, fullgraph=True)(x, x, precompute_rope_table(8, 8, 10000.0))
        (q.sum() + k.sum()).backward()
    assert not [w for w in caught if "complex" in str(w.message)], [str(w.message) for w in caught]
    torch.testing.assert_close(q, apply_rotary_emb(x, x, precompute_rope_table(8, 8, 10000.0))[0])
