"""The model on this rank: the host-memory check of a CPU run, then the pipeline split of the model (on the meta
device) into this rank's stages, each stage's parallel plan, materialized on the device and initialized."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from engine.config import Config
from parallelize import pipeline_parallel as pipeline
from parallelize.float8 import is_float8_all_gathered
from parallelize.fsdp import resharded_after_forward
from parallelize.init import materialize
from parallelize.mesh import ParallelDims


def host_memory_available() -> int | None:
    """Bytes of memory this machine can still give (MemAvailable of /proc/meminfo); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(flavor: str, num_params: int, dims: ParallelDims, world_size: int) -> None:
    """A run on CPU keeps float32 weights, gradients and AdamW's two moments: 16 bytes per parameter, held once per
    data-parallel replica and split over the other dimensions. A model whose state alone exceeds the memory
    this machine has available (its share of the ranks: LOCAL_WORLD_SIZE) is refused before it is allocated,
    rather than killed by the kernel mid-build."""
    available = host_memory_available()
    if available is None:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    need = 16 * num_params * dims.dp_replicate * local_ranks / world_size
    if need > available:
        gib = 1024**3
        raise ValueError(
            f"model.flavor: {flavor} ({num_params / 1e9:.2f}B parameters) needs at least {need / gib:.1f} GiB of host "
            f"memory on CPU (float32 weights, gradients and AdamW state) and this machine has {available / gib:.1f} "
            "GiB available; train a smaller model.flavor (debugmodel) here, or this one on GPUs"
        )


@dataclass
class ModelParts:
    """This rank's share of the model: its pipeline stages (the whole model without PP), parallelized."""

    parts: list[nn.Module]
    stage_ids: list[int]
    """Global indices of this rank's stages ([0] without PP)."""
    stage_count: int
    """Stages of the whole pipeline (1 without PP)."""

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.stage_count - 1 in self.stage_ids

    def describe(self, device: torch.device) -> str:
        """What the parallel plan did to this rank's parts, read from the modules themselves rather than the
        config: FSDP2 units (and those that free their parameters after forward), weights all-gathered in float8,
        compiled modules, checkpointed blocks, parameters FSDP keeps in CPU memory."""
        modules = [m for part in self.parts for m in part.modules()]
        blocks = sum(len(part.layers) for part in self.parts)
        out = []
        fsdp = [m for m in modules if isinstance(m, FSDPModule)]
        if fsdp:
            flags = [resharded_after_forward(m) for m in fsdp]
            resharded = sum(bool(f) for f in flags)
            which = "none" if resharded == 0 else "all" if resharded == len(fsdp) else str(resharded)
            out.append(f"FSDP2 on {len(fsdp)} units"
                       + ("" if None in flags else f" ({which} resharded after forward)"))
        float8_gathered = sum(is_float8_all_gathered(p) for part in self.parts for p in part.parameters())
        if float8_gathered:
            out.append(f"{float8_gathered} weights all-gathered in float8")
        on_cpu = [p for part in self.parts for p in part.parameters() if p.device.type == "cpu"]
        if on_cpu and device.type != "cpu":
            out.append(f"{len(on_cpu)} parameters in CPU memory")
        compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
        if compiled:
            out.append(f"{compiled} modules compiled")
        wrapped = [m for m in modules if hasattr(m, "_checkpoint_wrapped_module")]
        per_op = sum(hasattr(m, "op_matmuls") for m in wrapped)
        if per_op:
            out.append(f"{per_op} of {blocks} blocks checkpointed per op")
        if len(wrapped) > per_op:
            out.append(f"{len(wrapped) - per_op} of {blocks} blocks checkpointed whole")
        return "; ".join(out) or "no FSDP, compile or activation checkpointing"


def build_model_parts(cfg: Config, dims: ParallelDims, spec, model: nn.Module, device: torch.device,
                      materialize_weights: bool = True) -> ModelParts:
    """Split ``model`` (on the meta device) into this rank's pipeline stages and apply the model's parallel
    plan to each. With ``materialize_weights`` the parts are then allocated on ``device`` and initialized:
    every layout gets the weights a single process would draw (parallelize/init.py; each unit of the model
    is seeded by its name, whatever stage holds it). Without it they stay on the meta device (dry runs)."""
    p = cfg.parallelism
    if dims.pp_enabled:
        pp_rank, pp = dims.coordinate("pp")
        stage_count = pipeline.num_stages(pp, p.pp_schedule, p.pp_virtual_stages)
        stage_ids = pipeline.stage_ids(pp_rank, pp, p.pp_schedule, p.pp_virtual_stages)
        layers = pipeline.split_layers(model.n_layers, stage_count, p.pp_layers_per_stage or None)
        parts = [spec.pipeline_fn(model, i, stage_count, layers[i]) for i in stage_ids]
    else:
        stage_count, stage_ids, parts = 1, [0], [model]
    # FSDP's CPU offload wants its parameters in CPU memory (it moves each unit's to the GPU for its forward and
    # backward); the buffers (the RoPE table) stay on the GPU.
    offload = p.fsdp_cpu_offload and dims.data_parallel
    for part in parts:
        if cfg.training.loss_chunk_tokens:
            part.loss_chunk_tokens = cfg.training.loss_chunk_tokens
        spec.parallelize_fn(part, dims, cfg, device.type)
        if materialize_weights:
            part.to_empty(device=torch.device("cpu") if offload else device)
            with torch.no_grad():
                part.init_weights(buffer_device=device if offload else None, materialize=materialize,
                                  seed=cfg.debug.seed)
        part.train()
    return ModelParts(parts, stage_ids, stage_count)
