"""Microbenchmarks of the single-GPU speed levers at the benchmark's shapes (Llama-3-8B layers, seq 8192,
batch 1), measured before any of them is built into the trainer (docs/performance.md lists them with their
predictions). Prints one table per lever: median milliseconds of forward + backward (CUDA events, after
warm-up) and peak memory above the inputs.

    python bench/hopper_levers.py [--only sdpa,ce,adamw,rope,clip,bf16] [--reps 20]

1. sdpa: the attention kernel F.scaled_dot_product_attention dispatches to for causal GQA (32 query heads,
   8 KV heads, head_dim 128) against each backend forced (flash, cuDNN, memory-efficient), with GQA left to
   the kernel (enable_gqa) or K/V repeated to 32 heads first.
2. ce: the loss over the 128,256-token vocabulary: logits = h @ W^T then cross-entropy as the trainer does
   it (fp32 upcast of the bf16 logits), on the bf16 logits directly, and chunked over tokens with the logits
   recomputed in backward (never materializing [8192, 128256]); liger-kernel's fused linear cross-entropy too
   when it is installed.
3. adamw: one optimizer step over the 8B_L8 parameter shapes (2.8B fp32 parameters): fused, foreach.
4. rope: rotary embeddings of one layer's q [1, 8192, 32, 128] and k [1, 8192, 8, 128] in bf16, forward and
   backward, eager and compiled: the complex product (Meta's reference, and the reference trainer's; inductor
   runs it as eager kernels over fp32 copies) against real arithmetic (models/llama3/model.py: Tessera runs
   the complex product eagerly and the real arithmetic compiled).
5. clip: gradient clipping then fused AdamW over the 8B_L8 parameters: the clip scaling the gradients in a
   pass of its own, against the clip factor applied inside the optimizer's kernel (engine/optim.py).
6. bf16: split bf16 weights (parallelize/bf16_weights.py) against autocast on fp32 weights, in two parts: the
   matmuls of the 8B_L8 model (8 blocks' seven projections and the output, one token batch of 8192, forward
   and backward under autocast: fp32 weights cast in the forward and their gradients cast back, or bf16 weights
   read as they are), and the clip with the optimizer step over 8B_L8's parameters (fused AdamW on fp32 weights
   and gradients, or the compiled update of the split weights from bf16 gradients, with one launch
   configuration per kernel as the trainer compiles it, or with Inductor's default autotuning).
Needs a CUDA GPU; on a CPU it says so and exits 0 (tests call the rope, clip and bf16 levers on CPU, small).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # models.loss, run from anywhere

GIB = 2**30


def bench(fn, reps: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms, peak GiB allocated above what was allocated before) of fn(); on CPU (tests) the host's
    time and no memory figure."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times), 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / GIB


def row(name: str, fn, reps: int, flops: float | None = None) -> None:
    try:
        ms, mem = bench(fn, reps)
    except Exception as e:  # an unsupported backend or an out-of-memory is a result too
        print(f"  {name:<44} not available: {str(e).splitlines()[0][:90]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return
    rate = f"  {flops / ms / 1e9:6.0f} TFLOP/s" if flops else ""
    print(f"  {name:<44} {ms:8.2f} ms  {mem:6.2f} GiB{rate}")


def lever_sdpa(reps: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, hq, hkv, d = 1, 8192, 32, 8, 128
    print(f"sdpa: causal attention fwd+bwd, q [{b},{hq},{s},{d}], k/v [{b},{hkv},{s},{d}] bf16")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 4 * b * hq * s * s * d / 2 * 3.5  # causal half; backward ~2.5x forward

    def run(backends, repeat: bool):
        def fn():
            kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if repeat else (k, v)
            ctx = sdpa_kernel(backends) if backends else torch.enable_grad()
            with ctx:
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not repeat)
            out.backward(do)
        return fn

    row("default dispatch, enable_gqa (what Tessera runs)", run(None, False), reps, flops)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        row(f"{name}, enable_gqa", run([backend], False), reps, flops)
        row(f"{name}, K/V repeated to {hq} heads", run([backend], True), reps, flops)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum of cross-entropies of (h @ w.T) over token chunks; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, w, labels, chunks):
        ctx.save_for_backward(h, w, labels)
        ctx.chunks = chunks
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for hc, lc in zip(h.chunk(chunks), labels.chunk(chunks)):
            total += F.cross_entropy((hc @ w.t()).float(), lc, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad):
        h, w, labels = ctx.saved_tensors
        gh, gw = torch.empty_like(h), torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        start = 0
        for hc, lc in zip(h.chunk(ctx.chunks), labels.chunk(ctx.chunks)):
            p = torch.softmax((hc @ w.t()).float(), dim=-1)
            p[torch.arange(len(lc), device=p.device), lc] -= 1
            p = (p * grad).to(h.dtype)
            gh[start:start + len(hc)] = p @ w
            gw += (p.t() @ hc).float()
            start += len(hc)
        return gh, gw.to(w.dtype), None, None


def lever_ce(reps: int) -> None:
    n, dim, vocab = 8192, 4096, 128256
    print(f"ce: output projection + cross-entropy fwd+bwd, h [{n},{dim}] @ W [{vocab},{dim}] bf16")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1).requires_grad_()
    w = (torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    flops = 6 * n * dim * vocab

    def trainer_way():
        F.cross_entropy((h @ w.t()).float(), labels, reduction="sum").backward()

    def bf16_logits():
        F.cross_entropy(h @ w.t(), labels, reduction="sum").backward()

    row("logits.float() then cross_entropy (Tessera eager)", trainer_way, reps, flops)
    row("cross_entropy on bf16 logits", bf16_logits, reps, flops)
    row("compiled: matmul + float + cross_entropy (compile)", _compiled_ce(h, w, labels), reps, flops)
    for chunks in (4, 8):
        row(f"chunked x{chunks}, logits recomputed in backward",
            lambda c=chunks: ChunkedLinearCrossEntropy.apply(h, w, labels, c).backward(), reps, flops)
    from models.loss import linear_cross_entropy_sum  # training.loss_chunk_tokens

    for tokens in (1024, 2048, 4096):
        row(f"Tessera fused projection + loss, {tokens}-token chunks",
            lambda t=tokens: linear_cross_entropy_sum(h[None], w, labels[None], t).backward(), reps, flops)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        print("  liger-kernel fused linear cross-entropy       not installed (pip install liger-kernel)")
    else:
        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        row("liger-kernel fused linear cross-entropy", lambda: loss(w, h, labels).backward(), reps, flops)


def _compiled_ce(h, w, labels):
    fn = torch.compile(lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y, reduction="sum"))
    return lambda: fn(h, w, labels).backward()


def _meta_model(flavor: str) -> torch.nn.Module:
    """The Llama 3 model of ``flavor`` on the meta device (shapes only)."""
    from models.llama3.flavors import llama3_flavors
    from models.llama3.model import Transformer

    args = llama3_flavors[flavor]
    if args.vocab_size <= 0:  # the debug flavor takes its vocabulary from the tokenizer
        args = dataclasses.replace(args, vocab_size=512)
    with torch.device("meta"):
        return Transformer(args)


def lever_adamw(reps: int) -> None:
    shapes = [p.shape for p in _meta_model("8B_L8").parameters()]
    params = [torch.zeros(s, device="cuda", dtype=torch.float32, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"adamw: one step over {n / 1e9:.2f}B fp32 parameters ({len(params)} tensors)")
    for impl in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
        row(impl, opt.step, max(3, reps // 4))
        del opt
        torch.cuda.empty_cache()


def lever_rope(reps: int, device: str = "cuda", seq: int = 8192) -> dict:
    from models.llama3.model import precompute_rope_table, rope_complex, rope_real

    hq, hkv, d = 32, 8, 128
    print(f"rope: rotary embeddings fwd+bwd of one layer, q [1,{seq},{hq},{d}], k [1,{seq},{hkv},{d}] bf16")
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, seq, hq, d, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, seq, hkv, d, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    table = precompute_rope_table(d, seq, 500000.0, rope_scaling=True).to(device)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    outputs = {}

    def run(fn, name):
        def step():
            a, b = fn(q, k, table)
            outputs[name] = (a.detach(), b.detach())
            torch.autograd.backward((a, b), (dq, dk))
        return step

    for name, fn in (("complex product, eager (Tessera eager)", rope_complex), ("real arithmetic, eager", rope_real),
                     ("complex product, compiled", torch.compile(rope_complex)),
                     ("real arithmetic, compiled (Tessera compiled)", torch.compile(rope_real))):
        row(name, run(fn, name), reps)
    return outputs


def lever_clip(reps: int, device: str = "cuda", flavor: str = "8B_L8") -> dict:
    from engine.optim import clip_grad_norm_

    shapes = [p.shape for p in _meta_model(flavor).parameters()]
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    n = sum(x.numel() for x in grads)
    print(f"clip: gradient norm, clip (max_norm 1) and fused AdamW over {n / 1e9:.2f}B fp32 parameters")
    results = {}
    for name, in_optimizer in (("clip scales the gradients, then the step", False),
                               ("clip factor inside the fused kernel (Tessera)", True)):
        params = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step():
            for p, grad in zip(params, grads):
                p.grad = grad.clone() if device == "cpu" else grad  # kept unchanged on CPU, for the test
            clip_grad_norm_(params, 1.0, optimizer=opt, scale_in_optimizer=in_optimizer)
            opt.step()
        if device == "cpu":  # one step from the same start, for the test's comparison
            step()
            results[name] = [p.detach().clone() for p in params]
        else:
            row(name, step, max(3, reps // 4))
        del opt, params
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def lever_bf16(reps: int, device: str = "cuda", flavor: str = "8B_L8", tokens: int = 8192) -> dict:
    from engine.config import Optimizer
    from engine.optim import build_optimizer, clip_grad_norm_
    from parallelize.bf16_weights import master_weight, split_matmul_weights

    meta = _meta_model(flavor)
    linear = [m.weight.shape for m in meta.modules() if isinstance(m, torch.nn.Linear)]
    shapes = [p.shape for p in meta.parameters()]
    g = torch.Generator(device=device).manual_seed(0)
    print(f"bf16: {len(linear)} matmuls fwd+bwd under autocast over {tokens} tokens, then clip + optimizer step "
          f"over {sum(torch.Size(s).numel() for s in shapes) / 1e9:.2f}B parameters")
    results = {}
    inputs = {s[1]: torch.randn(tokens, s[1], device=device, dtype=torch.bfloat16, generator=g) for s in linear}
    for name, dtype in (("matmuls, fp32 weights (autocast casts)", torch.float32),
                        ("matmuls, bf16 weights (split, Tessera)", torch.bfloat16)):
        weights = [(torch.randn(s, device=device, generator=g) * 0.02).to(dtype).requires_grad_() for s in linear]

        def matmuls():
            with torch.autocast(device, dtype=torch.bfloat16):
                total = sum(F.linear(inputs[w.shape[1]], w).float().mean() for w in weights)
            total.backward()
            for w in weights:
                w.grad = None
        if device == "cuda":
            row(name, matmuls, reps)
        else:
            matmuls()
        del weights
    grads = [torch.randn(s, device=device, generator=g) * 1e-3 for s in shapes]
    for name, split, autotune in (
            ("clip + fused AdamW, fp32 weights and gradients", False, False),
            ("clip + AdamW on split bf16 weights, bf16 gradients (Tessera: one launch configuration)", True, False),
            ("the same, the update's kernels autotuned (two configurations tried at the first launch)", True, True)):
        model = torch.nn.Module()
        model.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes])
        cfg = Optimizer(lr=1e-4, weight_decay=0.1, implementation="fused")
        opt = build_optimizer(model, cfg, torch.device(device), bf16_weights=split)
        lows = {}
        if split:  # the 2-D parameters stand for the linear weights (the embedding too: a little more work)
            for p in model.params:
                if p.ndim == 2:
                    holder = torch.nn.Linear(1, 1, bias=False)
                    holder.weight = p
                    lows.update(split_matmul_weights([holder]))
            opt.set_low_halves(lows)
        if autotune:  # the update with Inductor's default options (pointwise autotuning on)
            from engine.optim import _adam_update

            opt._update = torch.compile(_adam_update, fullgraph=True, dynamic=False)

        own = [grad.to(p.dtype, copy=True) for p, grad in zip(model.params, grads)]  # cast untimed; bf16 if split

        def step():
            for p, grad in zip(model.params, own):
                p.grad = grad
            clip_grad_norm_(list(model.params), 1.0, optimizer=opt)
            opt.step()
        if device == "cuda":
            row(name, step, max(3, reps // 4))
        else:  # one step from the same start, for the test's comparison
            step()
            results[name] = [(master_weight(p.detach(), lows[p]) if p in lows else p.detach()).clone()
                             for p in model.params]
        del opt, model, own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="sdpa,ce,adamw,rope,clip,bf16")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("hopper_levers: no CUDA GPU here; run it on the Hopper machine (H100 or H200)")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    levers = {"sdpa": lever_sdpa, "ce": lever_ce, "adamw": lever_adamw, "rope": lever_rope, "clip": lever_clip,
              "bf16": lever_bf16}
    for name in args.only.split(","):
        levers[name](args.reps)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
