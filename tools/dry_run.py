"""Dry run: the real build path for a world of W ranks, in one CPU process, without GPUs or memory.

    DRY_RUN=1 NGPU=W ./run_train.sh --config FILE [--section.key value ...]
    (= WORLD_SIZE=W python -m tools.dry_run --config FILE ...)

Steps, as a real launch takes them:
1. parse and validate the configuration for W ranks (engine.train.check: the same ``error:`` line and exit
   status 2 for a user error), and load the tokenizer for the vocabulary size (no data is read);
2. join torch's fake process group as one rank of W (collectives do nothing), build the device mesh and its
   named views (parallelize/mesh.py);
3. build the model on the meta device and apply the real plan (engine.build.build_model_parts: pipeline
   split, TP, CP, AC, compile, FSDP2) without allocating it;
4. read each parameter's local shard shape (DTensor ``to_local()``, on meta) and estimate the rank's memory
   with tools/memory.py.

Ranks of one pipeline stage are symmetric, so the plan is built once per pipeline rank, on the rank at that
pp coordinate and 0 in every other dimension (the rank holding the largest FSDP shard when sizes do not
divide); pp ranks whose stages have the same shape (the same layer counts, and the embedding/output on the
same side) share one build. torch.compile is lazy (it traces on the first forward, which a dry run never
runs), so compile.enable costs nothing here; the estimate uses memory.py's compiled activation formulas.

Environment: WORLD_SIZE (the simulated world, set from NGPU by run_train.sh), GPU_MEMORY_GIB (the memory of
one GPU the table compares with, default 80).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from dataclasses import dataclass
from typing import Optional

from tools import memory


def init_fake_world(rank: int, world_size: int) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size`` (replacing any current group).

    The fake backend lives in torch's testing package (``torch.testing._internal``, a private module); this
    is the one place Tessera imports it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# --------------------------------------------------------------------------------------------------------
# Measuring what a rank holds
# --------------------------------------------------------------------------------------------------------


def _tp_numel(param) -> int:
    """Elements of ``param`` after tensor- and expert-parallel sharding only (before FSDP's)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.numel()
    shape = list(param.shape)
    names = param.device_mesh.mesh_dim_names or ()
    for i, placement in enumerate(param.placements):
        if i < len(names) and names[i] in ("tp", "ep") and isinstance(placement, Shard):
            n = param.device_mesh.size(i)
            shape[placement.dim] = -(-shape[placement.dim] // n)
    numel = 1
    for s in shape:
        numel *= s
    return numel


def _local_numel(param) -> int:
    from torch.distributed.tensor import DTensor

    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def measure_stage(part, stage: int) -> memory.StageParams:
    """The StageParams of a parallelized stage module (meta device), from its parameters' local shapes."""
    embedding = final = None
    blocks: dict[str, memory.PartSizes] = {}
    for name, param in part.named_parameters():
        local, tp = _local_numel(param), _tp_numel(param)
        size = memory.PartSizes(local, tp, tp if param.dim() >= 2 and not name.startswith("tok_embeddings") else 0)
        if name.startswith("tok_embeddings."):
            embedding = (embedding or memory.PartSizes()) + size
        elif name.startswith("layers."):
            key = name.split(".")[1]
            blocks[key] = blocks.get(key, memory.PartSizes()) + size
        else:
            final = (final or memory.PartSizes()) + size
    sizes = list(blocks.values())
    if any(s != sizes[0] for s in sizes):
        raise AssertionError(f"stage {stage}: blocks of different shapes {sizes}")
    return memory.StageParams(stage, len(sizes), sizes[0] if sizes else memory.PartSizes(), embedding, final)


# --------------------------------------------------------------------------------------------------------
# Building one rank
# --------------------------------------------------------------------------------------------------------


@dataclass
class Build:
    """One simulated rank, built."""

    rank: int
    mesh_lines: list[str]
    """The mesh as this rank saw it (describe_mesh), taken before the next build replaces the world."""
    stages: list[memory.StageParams]
    seconds: float
    plan: str
    """What the parallel plan did to this rank's modules (engine.build.ModelParts.describe)."""


def stage_signature(cfg, dims, n_layers: int, pp_rank: int) -> tuple:
    """What determines a pipeline rank's parameter shapes: each of its stages' layer count and ends."""
    from parallelize import pipeline_parallel as pipeline

    p = cfg.parallelism
    if dims.pp == 1:
        return ((n_layers, True, True),)
    n = pipeline.num_stages(dims.pp, p.pp_schedule, p.pp_virtual_stages)
    layers = pipeline.split_layers(n_layers, n, p.pp_layers_per_stage or None)
    ids = pipeline.stage_ids(pp_rank, dims.pp, p.pp_schedule, p.pp_virtual_stages)
    return tuple((len(layers[i]), i == 0, i == n - 1) for i in ids)


@contextlib.contextmanager
def shared_empty_fsdp_chunks():
    """FSDP2 cuts every parameter into one chunk per shard rank and pads the list with a new empty tensor for each
    rank past the parameter's first dimension: at 16,384 ranks about 12,000 tensors per parameter, a minute for
    8B under pure FSDP. On the meta device an empty chunk holds nothing, so during a dry run the padding is one
    shared empty tensor. This patches torch's private ``_fsdp_param._chunk_with_empty`` (the one place Tessera
    touches it); where torch has no such function the build is the same, only slower."""
    import torch

    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return

    def chunk_with_empty(tensor, num_chunks: int, dim: int):
        if tensor.device.type != "meta":
            return original(tensor, num_chunks, dim)
        chunks = list(torch.chunk(tensor, num_chunks, dim=dim))
        if len(chunks) < num_chunks:
            chunks.extend([chunks[0].new_empty(0)] * (num_chunks - len(chunks)))
        return chunks

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def build_rank(cfg, world_size: int, rank: int, spec, model) -> Build:
    """Join the fake world as ``rank``, build the mesh and this rank's parallelized stages on meta."""
    import torch

    from engine.build import build_model_parts
    from parallelize.mesh import ParallelDims

    start = time.perf_counter()
    init_fake_world(rank, world_size)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if dims.distributed:
        dims.build_mesh("cpu")
    # build_model_parts copies the model for each pipeline stage; without PP it parallelizes it in place.
    target = model if dims.pp_enabled else copy.deepcopy(model)
    with shared_empty_fsdp_chunks():
        parts = build_model_parts(cfg, dims, spec, target, torch.device("meta"), materialize_weights=False)
    stages = [measure_stage(part, i) for part, i in zip(parts.parts, parts.stage_ids)]
    return Build(rank, describe_mesh(dims), stages, time.perf_counter() - start, parts.describe(torch.device("meta")))


def describe_mesh(dims) -> list[str]:
    """The mesh's degrees and its named views, as a rank of it sees them."""
    lines = [f"mesh: {dims.describe()} = {dims.world_size} ranks"]
    if not dims.distributed:
        return lines + ["views: none (a world of one rank)"]
    views = [f"{view} {dims.mesh(view).size()}" for view in ("dp", "dp_shard_cp", "dp_cp", "tp", "cp", "pp")]
    fsdp = dims.mesh("fsdp")
    fsdp_text = " x ".join(f"{n} {s}" for n, s in zip(fsdp.mesh_dim_names, fsdp.mesh.shape))
    lines.append(f"views: {', '.join(views)}; FSDP mesh: {fsdp_text}")
    return lines


# --------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------


def run(argv: list[str]) -> int:
    import torch

    from engine.data.tokenizer import build_tokenizer
    from engine.distributed import world_size_from_env
    from engine.train import check
    from models.registry import get_model_spec

    import os

    from engine.config import parse_args
    from engine.config.validation import HOPPER

    start = time.perf_counter()
    # A planning machine may lack the tokenizer folder: the flavor then gives the vocabulary. Noted, not fatal.
    notes = []
    assets = parse_args(argv).model.hf_assets_path
    if assets and not os.path.isdir(assets):
        notes.append(f"note: model.hf_assets_path '{assets}' not found (a real launch stops there); the dry run "
                     "takes the vocabulary from the flavor")
        argv = [*argv, "--model.hf_assets_path="]
    # The launch's own validation, for WORLD_SIZE ranks of the cluster's GPUs (not this machine's): float8,
    # flash_attn, async TP and CPU offload are planned here for Hopper GPUs even on a CPU login node.
    cfg, plan = check(argv, HOPPER)
    world_size = world_size_from_env()
    gpu_gib = memory.gpu_memory_from_env()
    spec = get_model_spec(cfg.model.name)
    vocab = build_tokenizer(cfg).vocab_size  # as the trainer does; no data is read
    args = spec.flavors[cfg.model.flavor].update_from_config(cfg.model, vocab, cfg.training.seq_len)
    shape = memory.ModelShape.from_args(args, cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    n_params = sum(p.numel() for p in model.parameters())
    dims = plan.dims

    print(f"dry run: {cfg.model.name}/{cfg.model.flavor} on {world_size:,} simulated ranks (fake process group, "
          f"meta device), validated for CUDA GPUs of compute capability "
          f"{HOPPER.cuda_capability[0]}.{HOPPER.cuda_capability[1]} with flash-attn)")
    for note in notes:
        print(note)
    print(f"model: {n_params / 1e9:.2f}B parameters, {spec.flops_per_token(args, cfg.training.seq_len) / 1e9:,.1f} "
          f"GFLOP per token, vocabulary {args.vocab_size:,}")
    groups: dict[tuple, list[int]] = {}
    for pp_rank in range(dims.pp):
        groups.setdefault(stage_signature(cfg, dims, shape.n_layers, pp_rank), []).append(pp_rank)

    shard = dims.dp_shard * dims.cp
    if shard > 2048:
        print(f"note: FSDP shards every parameter {shard:,} ways; fully_shard's set-up costs O(shard degree) per "
              f"parameter (one chunk view per shard), so this build may take a minute, as every real rank's "
              f"start-up would")
    rows: list[memory.RankRow] = []
    builds: dict[int, Build] = {}
    for pp_ranks in groups.values():
        build = build_rank(cfg, world_size, memory.first_rank_of_stage(dims, pp_ranks[0]), spec, model)
        for pp_rank in pp_ranks:
            builds[pp_rank] = build
    for line in builds[0].mesh_lines:
        print(line)
    print(memory.describe_layout(cfg, dims))
    print(f"plan (rank {builds[0].rank}): {builds[0].plan}")
    if cfg.compile.enable:
        print("compile.enable: blocks wrapped for torch.compile (lazy: nothing is traced in a dry run); activations "
              "estimated as compiled (tools/memory.py)")
    def sizes(stage: memory.StageParams) -> tuple:  # a stage of no layers has no block to measure
        return stage.layers, stage.block if stage.layers else None, stage.embedding, stage.final

    mismatched = []
    for pp_rank in range(dims.pp):
        build = builds[pp_rank]
        # Stage ids differ between pp ranks that share a build: take this rank's own ids.
        own = memory.analytic_stages(cfg, dims, shape, pp_rank)
        stages = [memory.StageParams(o.stage, b.layers, b.block, b.embedding, b.final)
                  for o, b in zip(own, build.stages)]
        if [sizes(s) for s in stages] != [sizes(s) for s in own]:
            mismatched.append(pp_rank)
        rank = memory.first_rank_of_stage(dims, pp_rank)
        rows.append(memory.RankRow(pp_rank, rank, stages,
                                   memory.estimate(shape, stages, memory.rank_layout(cfg, dims, pp_rank))))
    print("per-rank memory (GiB; params, grads and optimizer state from the built shards; the peak is the "
          "largest moment of a step, see tools/memory.py):")
    print(memory.format_table(rows, gpu_gib))
    built = {b.rank: b for b in builds.values()}
    print(f"built {len(built)} distinct pipeline rank(s) (global ranks {', '.join(map(str, sorted(built)))}) in "
          f"{sum(b.seconds for b in built.values()):.1f} s; total {time.perf_counter() - start:.1f} s")
    if mismatched:
        print(f"warning: the shard sizes built for pp ranks {mismatched} differ from memory.stage_params's formula")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    import torch.distributed as dist

    try:
        return run(argv)
    except ValueError as e:  # user errors (ConfigError is one) name their field
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from engine.lifetime import exit_now

    exit_now(main())  # without the interpreter's slow teardown of torch
