"""Context parallelism's CUDA path on one GPU: 2 processes share the GPU over gloo (NCCL refuses two ranks on
one device; gloo carries CUDA tensors for all-gather and reduce-scatter, so cp_rotate = allgather runs; the
point-to-point ring needs NCCL). Each rank runs context_attention on its load-balanced shard of seeded
q/k/v, in bf16 (CUDA flash kernels) and fp32 (the matmul kernels), and with document masking in bf16 (masked
blocks take the matmul kernels). Its output and q/k/v gradients are compared with an fp32 reference (SDPA on
fp32 copies, K/V repeated to the query heads), beside plain (block-)causal SDPA in the case's dtype on the same
GPU: a case passes when ring attention's largest error is at most twice plain SDPA's (plus 1e-5 of the
reference's largest value), i.e. splitting the sequence over ranks costs no accuracy. Exits non-zero when a
case fails.

    python bench/cuda_cp_check.py          # DEVICE=cpu: the same on CPU tensors, smaller (a dry run)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.attention import dense_causal_mask  # noqa: E402
from parallelize.context_parallel import context_attention, shard_sequence  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cuda")
# dtype, B, Hq, Hkv, S, D, document masking
# (The masked case has 8 query heads: plain SDPA with a dense mask and grouped-query attention runs only on the
# math kernel: scores of [heads, 8192, 8192] on each of the two ranks.)
CASES = [(torch.bfloat16, 1, 32, 8, 8192, 128, False), (torch.float32, 1, 8, 2, 2048, 64, False),
         (torch.bfloat16, 1, 8, 2, 8192, 128, True)]
if DEVICE == "cpu":
    CASES = [(dtype, b, 4, 2, 2048, 16, documents) for dtype, b, _, _, _, _, documents in CASES]


def _document_ids(b: int, s: int) -> torch.Tensor:
    """Documents of 700-3000 tokens: boundaries inside the 2,048-token chunks and a few across chunk edges."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(700, 3000, (s // 700 + 1,), generator=g)
    starts = torch.cumsum(lengths, 0)
    ids = (torch.arange(s).unsqueeze(-1) >= starts[starts < s]).sum(-1)
    return ids.expand(b, s).contiguous().to(DEVICE)


def _fp32_reference(q, k, v, grad, mask):
    """Output and q/k/v gradients of SDPA on fp32 copies, K/V repeated to the query heads."""
    full = [t.detach().float().clone().requires_grad_() for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(full[0], *(t.repeat_interleave(rep, dim=1) for t in full[1:]),
                                         attn_mask=mask, is_causal=mask is None)
    out.backward(grad.float())
    return [out.detach()] + [t.grad for t in full]


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    failed = []
    for dtype, b, hq, hkv, s, d, documents in CASES:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q, k, v, grad = (torch.randn(b, h, s, d, generator=g, device=DEVICE, dtype=dtype) for h in (hq, hkv, hkv, hq))
        doc_ids = _document_ids(b, s) if documents else None
        mask = dense_causal_mask(doc_ids, s, DEVICE) if documents else None
        exact = _fp32_reference(q, k, v, grad, mask)
        full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        plain = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        plain.backward(grad)
        local = [shard_sequence(t, 2, rank, 2).detach().requires_grad_() for t in (q, k, v)]
        ring = context_attention(*local, dist.group.WORLD, rotate="allgather", doc_ids=doc_ids)
        ring.backward(shard_sequence(grad, 2, rank, 2))
        case, line, bad = f"{dtype} S={s} documents={documents}", [], []
        for name, ref, mine, theirs in zip(("out", "dq", "dk", "dv"), exact, [ring] + [t.grad for t in local],
                                           [plain] + [t.grad for t in full]):
            ref = shard_sequence(ref, 2, rank, 2)
            ring_error = (mine.float() - ref).abs().max().item()
            plain_error = (shard_sequence(theirs, 2, rank, 2).float() - ref).abs().max().item()
            ok = ring_error <= 2 * plain_error + 1e-5 * ref.abs().max().item()
            line.append(f"{name} {ring_error:.2e} (plain {plain_error:.2e}){'' if ok else ' FAIL'}")
            bad += [] if ok else [name]
        failed += [f"{case} {name}" for name in bad]
        print(f"rank {rank} {case}: ring attention's max abs error against fp32 (plain SDPA's): {', '.join(line)}: "
              f"{'FAIL' if bad else 'pass'}", flush=True)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"rank {rank}: ring attention less accurate than plain SDPA in: {'; '.join(failed)}")


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    mp.start_processes(_worker, args=(free,), nprocs=2, start_method="spawn")
