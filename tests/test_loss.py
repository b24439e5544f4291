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
    model.loss_chunk_tokens = 7
    fused = model(tokens, labels=labels)
    (gf,) = torch.autograd.grad(fused, model.output.weight)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, gp, rtol=1e-5, atol=1e-6)  # gradients of about 1e-2; fp32 sums in other orders


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


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary-parallel (tensor parallelism): 2 gloo ranks, each holding a slice of the vocabulary
# ----------------------------------------------------------------------------------------------------------------


def vocab_parallel_job(world_size: int, rank: int, vocab: int, chunk: int) -> dict:
    """On a 1-D TP mesh: the weight sharded on the vocabulary (Shard(0), uneven when ``vocab`` does not divide),
    the hidden state on the sequence (Shard(1)), as the llama3 plan leaves them. Checks the loss, the no-grad
    loss and both gradients against the plain loss of the whole tensors; raises in the worker on a mismatch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallelize.tensor_parallel import vocab_parallel_linear_cross_entropy_sum

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    h, w, labels = _inputs(n=36, v=vocab)
    expected = _plain(h, w, labels)
    gh, gw = torch.autograd.grad(expected * 0.7, (h, w))

    hd = distribute_tensor(h.detach(), mesh, [Shard(1)]).requires_grad_()
    wd = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
    got = vocab_parallel_linear_cross_entropy_sum(hd, wd, labels, chunk)
    (got * 0.7).backward()
    with torch.no_grad():
        no_grad = vocab_parallel_linear_cross_entropy_sum(hd, wd, labels, chunk)
    where = f"vocab={vocab} chunk={chunk} rank={rank}"
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5, msg=lambda m: f"loss, {where}: {m}")
    torch.testing.assert_close(no_grad, expected, rtol=1e-6, atol=1e-5, msg=lambda m: f"no-grad, {where}: {m}")
    assert wd.to_local().shape[0] < vocab  # each rank really holds a slice
    torch.testing.assert_close(hd.grad.full_tensor(), gh, rtol=1e-5, atol=1e-7, msg=lambda m: f"dh, {where}: {m}")
    torch.testing.assert_close(wd.grad.full_tensor(), gw, rtol=1e-5, atol=1e-7, msg=lambda m: f"dw, {where}: {m}")
    return {"loss": got.item(), "expected": expected.item()}


def test_vocab_parallel_fused_loss_equals_the_plain_loss(tmp_path):
    from tests.parallel_harness import run_jobs

    jobs = {f"v{v}_c{c}": (v, c) for v, c in [(50, 16), (51, 7), (51, 1000)]}  # 51: slices of 26 and 25
    results = run_jobs(2, vocab_parallel_job, jobs, str(tmp_path))
    for name, r in results.items():
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-6), name
