"""The model registry: one ``ModelSpec`` per model family, looked up by ``model.name``.

The built-in families (``models/<name>/``) are listed here; ``register_model_spec`` adds another family (a
plug-in or a test).
"""

from __future__ import annotations

from models import llama3, qwen3
from models.spec import ModelSpec

__all__ = ["ModelSpec", "register_model_spec", "get_model_spec", "model_names"]

_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in (llama3.spec, qwen3.spec)}


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
