"""The ``ModelSpec``: everything the trainer needs to know about one model family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["ModelSpec"]


@dataclass
class ModelSpec:
    """Everything the trainer needs to know about one model family."""

    name: str
    """Registry key of the family, as written in ``model.name`` (e.g. "llama3")."""
    model_cls: type
    """The ``nn.Module`` class; constructed as ``model_cls(args)``, ideally under ``torch.device("meta")``, then
    materialized with ``to_empty(device=...)`` and ``init_weights(buffer_device=None)``."""
    args_cls: type
    """The dataclass of model hyperparameters taken by ``model_cls`` (e.g. ``TransformerModelArgs``)."""
    flavors: dict[str, Any]
    """Named sizes of the family (``model.flavor``), each an ``args_cls`` instance."""
    flops_per_token: Callable[[Any, int], int]
    """``flops_per_token(args, seq_len) -> int``: training FLOPs (forward + backward) per token, for MFU."""
    parallelize_fn: Optional[Callable] = None
    """``parallelize_fn(model, dims, cfg, device_type)``: applies the family's whole plan (TP, AC, compile,
    FSDP2/HSDP/DDP) to a model on the meta device, in place, for the ``ParallelDims`` ``dims``."""
    pipeline_fn: Optional[Callable] = None
    """``pipeline_fn(model, stage, n_stages, layers) -> nn.Module``: the pipeline split, a copy of the model (meta
    device) holding only what stage ``stage`` of ``n_stages`` runs (the blocks whose indices are in the range
    ``layers``; the trainer picks the ranges). None: the family has no pipeline split (parallelism.pp must be 1)."""
    shapes: Optional[Callable[[Any], dict[str, int]]] = None
    """``shapes(args)``: the sizes the memory estimate reads (dim, n_layers, n_heads, n_kv_heads, head_dim,
    ffn_hidden, vocab_size). None: tools/memory.py cannot estimate this family."""
    state_dict_adapter: Optional[type] = None
    """Converts between this family's state dict and the Hugging Face checkpoint layout: a class with ``to_hf``,
    ``from_hf``, ``names``, ``shapes``, ``hf_names``, ``tensors_to_hf``, ``read_from_hf``, ``hf_shapes``,
    ``hf_config`` and ``check_hf_config`` (engine/hf.py uses them)."""
