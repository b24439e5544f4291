"""torch.compile: each transformer block with fullgraph, and the loss.

Blocks are compiled in place (``nn.Module.compile``), so parameter names and checkpoints are unchanged;
the blocks all share one compiled graph when their shapes agree.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def apply_compile(blocks: nn.ModuleDict, fullgraph: bool = True) -> None:
    """Compile each block in place; ``fullgraph=False`` where a block holds ops dynamo cannot trace
    (context parallelism's point-to-point ring runs eagerly between two graphs)."""
    for block in blocks.values():
        block.compile(fullgraph=fullgraph)


def compile_loss(loss_fn: Callable) -> Callable:
    return torch.compile(loss_fn)


def set_inductor_option(name: str, value) -> None:
    """Set one of the compiler's (inductor's) process-wide options. torch offers no public API for these; every
    plan that needs one (async TP's micro-pipelining, float8's eager-identical casts) goes through here."""
    import torch._inductor.config as inductor_config

    assert hasattr(inductor_config, name), f"this torch's inductor has no option {name}"
    setattr(inductor_config, name, value)
