"""Tessera's model registry: one ``ModelSpec`` per model family (``models/<name>/``).

A model family registers itself with ``register_model_spec`` when its package is imported; importing ``models``
registers the built-in families (llama3). The trainer looks a family up with ``get_model_spec(cfg.model.name)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["ModelSpec", "register_model_spec", "get_model_spec", "model_names"]


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
    state_dict_adapter: Optional[type] = None
    """Converts between this family's state dict and the Hugging Face checkpoint layout: a class with
    ``to_hf``, ``from_hf``, ``hf_shapes``, ``hf_config`` and ``check_hf_config`` (engine/hf.py uses them)."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` under ``spec.name``; registering the same spec again is a no-op.

    Raises ``ValueError`` when a different spec already holds that name.
    """
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec and existing != spec:
        raise ValueError(f"model.name: a different model spec is already registered as {spec.name!r}")
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str, field: str = "model.name") -> ModelSpec:
    """The ``ModelSpec`` registered as ``name``; ``ValueError`` naming ``field`` (the option that gave the name)
    and the known names if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"{field}: unknown model {name!r}; known models: {', '.join(model_names())}") from None


def model_names() -> list[str]:
    """Names of the registered model families, sorted."""
    return sorted(_REGISTRY)


# Built-in families register themselves on import. Imported after the registry exists, so the family packages
# can do ``from models import ModelSpec, register_model_spec`` without a circular-import problem.
from models import llama3 as _llama3  # noqa: E402,F401
