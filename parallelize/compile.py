"""torch.compile: each transformer block with fullgraph, and the loss.

Blocks are compiled in place (``nn.Module.compile``), so parameter names and checkpoints are unchanged;
the blocks all share one compiled graph when their shapes agree.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from models.moe import MoE


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""compile.backend's choices: torch.compile's backends by their registered names."""


def apply_compile(blocks: nn.ModuleDict, inside_checkpoint: bool = False, fullgraph: bool = True,
                  backend: str = "inductor") -> None:
    """Compile each block in place with ``backend``, with fullgraph (context parallelism's ring attention,
    whichever way it rotates, is one operator to the compiler: parallelize/context_parallel.py) unless told
    otherwise: expert parallelism's all-to-all dispatch, whose split sizes live on the host, runs between two
    compiled graphs.

    ``inside_checkpoint`` (full and every-N activation checkpointing): a checkpoint-wrapped block's own module is
    compiled and the checkpoint runs eagerly around it, recomputing the compiled forward in backward. Compiling
    the wrapper instead, as for the per-op policy (which must be traced with the block), fails on torch 2.13
    under tensor parallelism: AOT autograd saves the DTensors' DeviceMesh among the checkpointed region's
    tensors ("expected all tensors_saved_with_vc_check to be Tensors"). Full checkpointing recomputes the whole
    block either way, so the two orders compute the same."""
    # A MoE block records its auxiliary loss and expert counts in its forward (models/moe.py): under per-op
    # checkpointing the compiled recompute in backward does not record them again (eager recompute would).
    # Dense blocks have no such side effects and keep Dynamo's default.
    if any(isinstance(m, MoE) for block in blocks.values() for m in block.modules()):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks.values():
        inner = getattr(block, "_checkpoint_wrapped_module", None) if inside_checkpoint else None
        (inner if inner is not None else block).compile(backend=backend, fullgraph=fullgraph)


def wait_before_compiled_blocks(module: nn.Module) -> None:
    """Hand the blocks a finished tensor from ``module`` (the embedding under TP): the forward hook clones an
    output that is still an asynchronous collective's result (a vocabulary-parallel embedding's
    reduce-scatter, which TP's styles leave pending). On torch 2.13 a compiled block whose input is such a
    tensor returns a plain gradient for it where the embedding's redistribution expects a DTensor, and the
    backward fails (2.11 does not); the clone waits for the collective outside the compiled region, costs one
    copy of the embedding output, and changes no value. ``AsyncCollectiveTensor`` is private: this is the one
    place that names it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def hook(mod, args, output):
        return output.clone() if isinstance(output, AsyncCollectiveTensor) else output

    module.register_forward_hook(hook)


_USER_CACHE_TAG: list[str] = []  # the tag the process started with (TORCH_COMPILE_CACHE_KEY_TAG), read once


def tag_compile_caches(group_names: list[str]) -> None:
    """Key the compiler's on-disk caches (inductor's graphs, AOT autograd's) by this rank's process-group names
    too. torch 2.13 keys a graph that calls collectives without the group's name (the mesh is an opaque input)
    but writes the name into the generated code, so ranks of one node that share the cache folder and belong
    to different TP groups (ranks 0-1 and 2-3 of FSDP 2 x TP 2) load each other's code, and a collective on a
    group the rank is not in fails ("Could not resolve the process group"). Ranks with the same groups (the
    same rank on a restart) still share. ``torch.compiler.config.cache_key_tag`` is the public knob for this;
    a tag the user set is kept in front."""
    import torch.compiler.config as compiler_config

    if not _USER_CACHE_TAG:
        _USER_CACHE_TAG.append(compiler_config.cache_key_tag)
    compiler_config.cache_key_tag = f"{_USER_CACHE_TAG[0]}|tessera-groups:{','.join(group_names)}"


def compile_loss(loss_fn: Callable, backend: str = "inductor") -> Callable:
    return torch.compile(loss_fn, backend=backend)


def set_inductor_option(name: str, value) -> None:
    """Set one of the compiler's (inductor's) process-wide options (``triton.autotune_pointwise``: one of its
    sections'). torch offers no public API for these; every plan that needs one (async TP's micro-pipelining,
    float8's eager-identical casts, compile.autotune) goes through here."""
    import torch._inductor.config as inductor_config

    *sections, key = name.split(".")
    owner = inductor_config
    for section in sections:
        owner = getattr(owner, section)
    assert hasattr(owner, key), f"this torch's inductor has no option {name}"
    setattr(owner, key, value)


def set_kernel_autotuning(enabled: bool) -> None:
    """compile.autotune for every graph compiled from now on in this process (the blocks' and the loss's):
    ``False`` gives each elementwise kernel one launch configuration and each reduction the one Inductor's
    deterministic mode picks, so no kernel is benchmarked, on clones of the tensors it writes, at its first
    launch. The reductions' filter is a test option of Inductor's (``deterministic`` itself also bans other
    benchmarks and shape padding); a CPU build ignores both."""
    set_inductor_option("triton.autotune_pointwise", enabled)
    set_inductor_option("test_configs.force_filter_reduction_configs", not enabled)
