"""The fused output projection + cross-entropy (models/loss.py) against logits followed by the plain loss."""

import pytest
import torch

from models.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum


def _inputs(dtype=torch.float32, n=37, d=16, v=50):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, v, (2, n), generator=g)
    labels[0, :5] = IGNORE_INDEX  # ignored targets contribute neither loss nor gradient
    labels[1, -1] = IGNORE_INDEX
    return h, w, labels


def _plain(h, w, labels):
    return cross_entropy_sum(h @ w.t().to(h.dtype), labels)


@pytest.mark.parametrize("chunk", [1, 16, 37, 74, 1000])
def test_fused_loss_and_gradients_equal_the_plain_loss(chunk):
    h, w, labels = _inputs()
    expected = _plain(h, w, labels)
    gh, gw = torch.autograd.grad(expected * 0.7, (h, w))
    got = linear_cross_entropy_sum(h, w, labels, chunk)
    fh, fw = torch.autograd.grad(got * 0.7, (h, w))  # the upstream gradient scales both
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fh, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fw, gw, rtol=1e-5, atol=1e-7)


def test_fused_loss_without_gradients_is_the_loss():
    h, w, labels = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy_sum(h, w, labels, 10)
        expected = _plain(h, w, labels)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert not got.requires_grad


def test_fused_loss_with_bf16_activations_and_a_float32_weight():
    """As under autocast: bf16 hidden states, the float32 weight cast once; the weight's gradient stays float32
    and agrees with the float32 computation to bf16 precision."""
    h, w, labels = _inputs()
    expected = _plain(h, w, labels)
    gh, gw = torch.autograd.grad(expected, (h, w))
    hb = h.detach().to(torch.bfloat16).requires_grad_()
    got = linear_cross_entropy_sum(hb, w, labels, 16)
    fh, fw = torch.autograd.grad(got, (hb, w))
    assert got.dtype == torch.float32 and fh.dtype == torch.bfloat16 and fw.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)
    torch.testing.assert_close(fh.float(), gh, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(fw, gw, rtol=5e-2, atol=2e-2)


def test_the_model_returns_the_fused_loss_with_labels():
    from models.llama3.model import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                             max_seq_len=32))
    model.init_weights(seed=1)
    tokens = torch.randint(0, 97, (2, 24))
    labels = torch.randint(0, 97, (2, 24))
    plain = cross_entropy_sum(model(tokens), labels)
    (gp,) = torch.autograd.grad(plain, model.output.weight)
    fused = model(tokens, labels=labels, loss_chunk_tokens=7)
    (gf,) = torch.autograd.grad(fused, model.output.weight)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, gp, rtol=1e-5, atol=1e-7)


def test_fused_loss_under_autocast_runs_its_matmuls_in_bf16():
    """Under autocast (one GPU without FSDP) the final norm's output and the weight are float32: the fused
    loss must still multiply in bf16, as F.linear would, and return float32 gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default):
                matmuls.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    h, w, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = cross_entropy_sum(torch.nn.functional.linear(h, w), labels)
        with Record():
            got = linear_cross_entropy_sum(h, w, labels, 16)
    fh, fw = torch.autograd.grad(got, (h, w))
    assert matmuls and all(d == torch.bfloat16 for ds in matmuls for d in ds), matmuls
    assert fh.dtype == fw.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=0)
