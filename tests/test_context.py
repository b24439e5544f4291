"""Context parallelism (parallelize/context_parallel.py): sequence sharding and ring attention.

The ring-attention checks spawn one gloo process group per world size (CPU) and run every case of that size in
it: each rank builds the same seeded full q/k/v, computes full causal SDPA and its gradients as the reference,
and checks its own shard of the output and of the q/k/v gradients from ``context_attention``; the same with
document masking, against SDPA with the dense block-causal mask. A failing check raises in the worker, which
fails the spawn.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from models.attention import dense_causal_mask
from parallelize import context_parallel as context
from parallelize.context_parallel import (
    _cpu_block_backward,
    _cpu_block_forward,
    _math_block_backward,
    _math_block_forward,
    context_attention,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from tests.parallel_harness import free_port, start_method

B, HQ, HKV, D = 2, 4, 2, 16
SEQ_LENS = {2: (32, 96), 4: (64, 128)}  # S = 2 * cp * chunk: chunks of 8 and a longer case


def _full_inputs(seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient for the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, seq_len, D, generator=g)
    k = torch.randn(B, HKV, seq_len, D, generator=g)
    v = torch.randn(B, HKV, seq_len, D, generator=g)
    grad = torch.randn(B, HQ, seq_len, D, generator=g)
    return q, k, v, grad


def _document_ids(seq_len: int, cp: int) -> torch.Tensor:
    """``[B, S]`` document ids whose boundaries fall inside chunks (chunk length ``S / 2cp``), on a chunk edge, and
    (second row) a document that spans several chunks: many blocks then hold query rows with no visible key."""
    chunk = seq_len // (2 * cp)
    starts = [
        sorted({0, 3, chunk, chunk + chunk // 2 + 1, 3 * chunk - 2, seq_len - 5}),
        [0, 5, 4 * chunk - 1],
    ]
    rows = []
    for row in starts:
        ids = torch.zeros(seq_len, dtype=torch.long)
        for start in row[1:]:
            ids[start:] += 1
        rows.append(ids)
    return torch.stack(rows)


def _check_case(group, rank: int, cp: int, seq_len: int, rotate: str, scale, documents: bool = False) -> None:
    q, k, v, grad = _full_inputs(seq_len, seed=seq_len + cp)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    doc_ids = _document_ids(seq_len, cp) if documents else None
    if documents:
        mask = dense_causal_mask(doc_ids, seq_len, "cpu")
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale, enable_gqa=True)
    ref.backward(grad)

    def shard(t):
        return shard_sequence(t, 2, rank, cp)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, group, rotate=rotate, scale=scale, doc_ids=doc_ids)
    out.backward(shard(grad))
    where = f"cp={cp} S={seq_len} rotate={rotate} scale={scale} documents={documents} rank={rank}"
    torch.testing.assert_close(out, shard(ref), rtol=1e-5, atol=1e-5, msg=lambda m: f"out, {where}: {m}")
    for name, x, x_full in zip("qkv", local, full):
        torch.testing.assert_close(
            x.grad, shard(x_full.grad), rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}, {where}: {m}"
        )


def _worker(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        for seq_len in SEQ_LENS[world_size]:
            for rotate in ("allgather", "alltoall"):
                _check_case(group, rank, world_size, seq_len, rotate, scale=None)
                _check_case(group, rank, world_size, seq_len, rotate, scale=None, documents=True)
        _check_case(group, rank, world_size, SEQ_LENS[world_size][0], "alltoall", scale=0.3)
        # The kernels masked blocks take on CUDA (matmul/softmax), inside the ring; whole blocks, then one query
        # row at a time (the tiling of long blocks).
        kernels, tile_bytes = context._block_kernels, context.MATH_TILE_BYTES
        context._block_kernels = lambda q, masked: (_math_block_forward, _math_block_backward)
        try:
            _check_case(group, rank, world_size, SEQ_LENS[world_size][0], "allgather", scale=None, documents=True)
            context.MATH_TILE_BYTES = 1
            _check_case(group, rank, world_size, SEQ_LENS[world_size][0], "alltoall", scale=None, documents=True)
        finally:
            context._block_kernels, context.MATH_TILE_BYTES = kernels, tile_bytes
        # A one-rank group: plain (block-)causal attention.
        singles = [dist.new_group([r]) for r in range(world_size)]
        q, k, v, _ = _full_inputs(16, seed=0)
        torch.testing.assert_close(
            context_attention(q, k, v, singles[rank]),
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        )
        doc_ids = _document_ids(16, 1)
        torch.testing.assert_close(
            context_attention(q, k, v, singles[rank], doc_ids=doc_ids),
            F.scaled_dot_product_attention(q, k, v, attn_mask=dense_causal_mask(doc_ids, 16, "cpu"), enable_gqa=True),
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp):
    mp.start_processes(_worker, args=(cp, free_port()), nprocs=cp, start_method=start_method(cp))


def _ac_compile_worker(rank: int, world_size: int, port: int) -> None:
    """Ring attention under per-op activation checkpointing and under torch.compile(fullgraph=True)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from parallelize.activation_checkpoint import op_policy

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    resolve = context._resolve_group
    try:
        group, seq_len = dist.group.WORLD, SEQ_LENS[world_size][0]
        q, k, v, grad = _full_inputs(seq_len, seed=7)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True).backward(grad)
        expected = [shard_sequence(t.grad, 2, rank, world_size) for t in full]
        for rotate in ("allgather", "alltoall"):
            # Per-op AC saves the ring's output whole (one operator), not the block kernels' partial results, and
            # its recomputation does not run the ring again: the group is looked up once for the forward, once
            # for the backward, and not a third time.
            saved, rings = [], []
            base = op_policy("all")

            def policy(ctx, op, *args, **kwargs):
                decision = base(ctx, op, *args, **kwargs)
                if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                    saved.append(str(op))
                return decision

            context._resolve_group = lambda name: rings.append(name) or resolve(name)
            local = [shard_sequence(t, 2, rank, world_size).requires_grad_() for t in (q, k, v)]
            out = checkpoint(partial(context_attention, cp_group=group, rotate=rotate), *local, use_reentrant=False,
                             context_fn=lambda: create_selective_checkpoint_contexts(policy))
            out.backward(shard_sequence(grad, 2, rank, world_size))
            context._resolve_group = resolve
            assert saved == ["tessera.ring_attention.default"], (rotate, saved)
            assert rings == [group.group_name] * 2, (rotate, rings)
            for x, want in zip(local, expected):
                torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)
            # One graph, either rotation (the point-to-point ring included: dynamo sees one opaque operator).
            compiled = torch.compile(partial(context_attention, cp_group=group, rotate=rotate), fullgraph=True,
                                     backend="aot_eager")
            local = [shard_sequence(t, 2, rank, world_size).requires_grad_() for t in (q, k, v)]
            compiled(*local).backward(shard_sequence(grad, 2, rank, world_size))
            for x, want in zip(local, expected):
                torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)
        dist.barrier()
    finally:
        context._resolve_group = resolve
        dist.destroy_process_group()


def test_ring_attention_under_op_checkpointing_and_compile():
    mp.start_processes(_ac_compile_worker, args=(2, free_port()), nprocs=2, start_method=start_method(2))


# ----------------------------------------------------------------------------------------------------------------
# no processes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp):
    t = torch.randn(3, 2 * cp * 5, 7)
    shards = [shard_sequence(t, 1, r, cp) for r in range(cp)]
    assert all(s.shape == (3, 10, 7) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, 1), t, rtol=0, atol=0)


def test_shard_sequence_chunks_and_divisibility():
    t = torch.arange(8)
    assert shard_sequence(t, 0, 0, 2).tolist() == [0, 1, 6, 7]
    assert shard_sequence(t, 0, 1, 2).tolist() == [2, 3, 4, 5]
    with pytest.raises(AssertionError, match="not divisible"):
        shard_sequence(torch.arange(10), 0, 0, 2)


def test_local_positions():
    assert local_positions(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert local_positions(4, 0, 1).tolist() == [0, 1, 2, 3]
    positions = [local_positions(24, r, 3) for r in range(3)]
    assert sorted(torch.cat(positions).tolist()) == list(range(24))
    assert positions[1].dtype == torch.long


def test_bad_rotate_name():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"parallelism\.cp_rotate.*'ring'.*allgather, alltoall"):
        context_attention(q, q, q, None, rotate="ring")


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("is_causal,masked", [(False, False), (True, False), (False, True)])
def test_math_block_kernels_match_cpu_flash(is_causal, masked, tiled, monkeypatch):
    """The matmul kernels (used where no flash kernel fits, e.g. fp32 on CUDA, or masked blocks on CUDA) agree
    with the CPU flash ones, also when the backward is given another output and lse (as ring attention does).
    Masked: a query row with no visible key has lse -inf and output 0 from both. Tiled: the query rows go in
    tiles of 3 (of 8), as a long block's would under ``MATH_TILE_BYTES``."""
    if tiled:
        monkeypatch.setattr(context, "MATH_TILE_BYTES", 3 * 2 * 3 * 8 * 4)  # 3 rows of [B=2, H=3, Sk=8] fp32
        assert context._row_tiles(torch.empty(2, 3, 8, 16), torch.empty(2, 3, 8, 16)) == [(0, 3), (3, 6), (6, 8)]
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(4))
    mask = None
    if masked:
        doc_q, doc_k = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]] * 2), torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]] * 2)
        mask = doc_q.unsqueeze(-1) == doc_k.unsqueeze(-2)
        mask = mask.unsqueeze(1)  # rows 5-7 (document 2) see no key
    out_m, lse_m = _math_block_forward(q, k, v, is_causal, 0.4, mask)
    out_c, lse_c = _cpu_block_forward(q, k, v, is_causal, 0.4, mask)
    torch.testing.assert_close(out_m, out_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_m, lse_c, rtol=1e-5, atol=1e-5)
    if masked:
        assert lse_c[..., 5:].isneginf().all() and (out_c[..., 5:, :] == 0).all()
        lse_c = lse_c.masked_fill(lse_c.isneginf(), 1.0)  # the merged lse of a whole row is always finite
    other_out, other_lse = torch.randn(2, 3, 8, 16, generator=g), lse_c + 0.5
    grads_m = _math_block_backward(dout, q, k, v, other_out, other_lse, is_causal, 0.4, mask)
    grads_c = _cpu_block_backward(dout, q, k, v, other_out, other_lse, is_causal, 0.4, mask)
    for gm, gc in zip(grads_m, grads_c):
        torch.testing.assert_close(gm, gc, rtol=1e-5, atol=1e-5)
