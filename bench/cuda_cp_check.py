"""Context parallelism's CUDA path on one GPU: 2 processes share the GPU over gloo (NCCL refuses two ranks on
one device; gloo carries CUDA tensors for all-gather and reduce-scatter, so cp_rotate = allgather runs; the
point-to-point ring needs NCCL). Each rank runs context_attention on its load-balanced shard of seeded
q/k/v, in bf16 (CUDA flash kernels) and fp32 (the matmul kernels), and with document masking in bf16 (masked
blocks take the matmul kernels), and prints the largest errors of its output and q/k/v gradients against full
(block-)causal SDPA on the same GPU.

    python bench/cuda_cp_check.py
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
from parallelize.context import context_attention, shard_sequence  # noqa: E402

# dtype, B, Hq, Hkv, S, D, document masking
# (The masked case has 8 query heads: its reference is SDPA with a dense mask and grouped-query attention,
# which only the math kernel takes: fp32 scores of [heads, 8192, 8192] on each of the two ranks.)
CASES = [(torch.bfloat16, 1, 32, 8, 8192, 128, False), (torch.float32, 1, 8, 2, 2048, 64, False),
         (torch.bfloat16, 1, 8, 2, 8192, 128, True)]


def _document_ids(b: int, s: int) -> torch.Tensor:
    """Documents of 700-3000 tokens: boundaries inside the 2,048-token chunks and a few across chunk edges."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(700, 3000, (s // 700 + 1,), generator=g)
    starts = torch.cumsum(lengths, 0)
    ids = (torch.arange(s).unsqueeze(-1) >= starts[starts < s]).sum(-1)
    return ids.expand(b, s).contiguous().cuda()


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.set_device(0)
    for dtype, b, hq, hkv, s, d, documents in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=dtype) for h in (hq, hkv, hkv, hq))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        doc_ids = _document_ids(b, s) if documents else None
        if documents:
            mask = dense_causal_mask(doc_ids, s, "cuda")
            ref = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=True)
        else:
            ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        ref.backward(grad)
        local = [shard_sequence(t, 2, rank, 2).detach().requires_grad_() for t in (q, k, v)]
        out = context_attention(*local, dist.group.WORLD, rotate="allgather", doc_ids=doc_ids)
        out.backward(shard_sequence(grad, 2, rank, 2))
        errors = {"out": (out - shard_sequence(ref, 2, rank, 2)).abs().max().item()}
        for name, mine, theirs in zip("qkv", local, full):
            errors["d" + name] = (mine.grad - shard_sequence(theirs.grad, 2, rank, 2)).abs().max().item()
        scale = {n: t.abs().max().item() for n, t in (("out", ref), ("dq", full[0].grad))}
        print(f"rank {rank} {dtype} S={s} documents={documents}: max abs error {errors} (|ref| max {scale})",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    mp.start_processes(_worker, args=(free,), nprocs=2, start_method="spawn")
