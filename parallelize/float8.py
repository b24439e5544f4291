"""float8 training on torchao: linear layers whose matmuls run in float8, composed with TP and FSDP2.

``convert_float8(model, ...)`` swaps the ``nn.Linear`` layers of a model on the meta device for torchao's
``Float8Linear`` (same parameter names, so checkpoints and init are unchanged). Each converted layer casts
its input, weight and output gradient to float8 with dynamic scales (computed from the tensor's current
amax), runs its three matmuls in float8 (``torch._scaled_mm``) and returns the high-precision dtype.

Recipes (``float8.recipe``):

- ``tensorwise``: one scale per tensor; the cuBLAS float8 matmul; the fastest. Composes with FSDP2's
  float8 all-gather (``float8.fsdp_float8_all_gather``: weights are cast to float8 before the all-gather,
  half the bytes of bf16), optionally with every weight's scale computed in one all-reduce after the
  optimizer step (``float8.precompute_scale``; the trainer calls ``float8_after_optimizer_step``), and
  with float8 tensor-parallel styles (activations cast to float8 before the sequence-parallel all-gather).
- ``rowwise``: one scale per row (power-of-two scales); more accurate, somewhat slower; TP uses the plain
  styles and FSDP all-gathers in high precision.

Which layers: every ``nn.Linear`` except the output projection (the logits are too sensitive), the layers
named in ``float8.filter_fqns`` (substrings of the fully-qualified name), and those whose dimensions are not
multiples of 16 (a requirement of the float8 matmul); under TP the per-rank slice must be a multiple of 16
too.

Order with tensor parallelism: the swap must happen *before* TP. A TP style installs its input/output
hooks on the module object it is applied to and shards that object's weight; swapping the module afterwards
drops the hooks (the forward then mixes DTensors and plain tensors), and torchao's float8 TP styles refuse
any module that is not a ``Float8Linear`` yet. The swap itself allocates and communicates nothing, so doing
it first changes nothing else in the plan: TP, CP, AC, compile and FSDP then wrap the converted layers
(see models/llama3/parallelize.py).

``float8.emulate`` runs the same casts but the matmuls in float32 on the dequantized values: float8
numerics on CPUs and GPUs without float8 (tests), no speed-up. Collectives over gloo cannot carry float8
tensors, so on gloo the float8 TP styles are replaced by the plain ones (the scales are the same: the amax of
a sharded DTensor is all-reduced either way); FSDP2 all-gathers a block's float8 weights together with its
fp32 norm weights as bytes, which gloo carries.

torchao is imported lazily (only when float8 is on): it is an optional dependency (``pip install
'tessera[float8]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import sys
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engine.config.errors import ConfigError
from parallelize.compile import set_inductor_option

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
TORCHAO_PIN = "torchao==0.17.0"


# --------------------------------------------------------------------------------------------------------
# Support checks (called by engine.config.validate, before anything is allocated)
# --------------------------------------------------------------------------------------------------------


def cuda_capability() -> Optional[tuple[int, int]]:
    """Compute capability of this rank's GPU (LOCAL_RANK), or None without CUDA. Creates no CUDA context."""
    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.cuda.get_device_capability(index)


def check_float8_supported(emulate: bool, capability: Optional[tuple[int, int]] | str = "detect") -> None:
    """Raise ConfigError (naming float8.enable / float8.emulate) when float8 cannot run here.

    ``capability``: the GPU's compute capability, None for no GPU, or "detect" to look it up."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"float8.enable: float8 training needs torchao, which is not installed; pip install "
            f"'tessera[float8]' ({TORCHAO_PIN}), or set float8.enable = false"
        )
    if emulate:
        return
    if capability == "detect":
        capability = cuda_capability()
    if capability is None:
        raise ConfigError(
            "float8.enable: this machine has no CUDA GPU and float8 matmuls need one with compute capability "
            ">= 8.9 (H100, L40S, RTX 4090); set float8.emulate = true to emulate them in float32 (float8 "
            "numerics, no speed-up), or float8.enable = false"
        )
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(
            f"float8.enable: this GPU (compute capability {capability[0]}.{capability[1]}) has no float8 "
            f"matmuls, which need compute capability >= 8.9 (H100, L40S, RTX 4090); set float8.emulate = true "
            f"to emulate them in float32 (no speed-up), or float8.enable = false"
        )


# --------------------------------------------------------------------------------------------------------
# torchao, imported quietly
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_import():
    """torchao's import logs a warning for each CUDA-only extension it cannot load (always, on a CPU build of
    torch) and torch one about an Enum it registers; neither matters for float8 training."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    quiet = not torch.cuda.is_available()
    for lg in loggers:
        if quiet or lg.name != "torchao":
            lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao_float8():
    if "torchao.float8" not in sys.modules:
        with _quiet_import():
            import torchao.float8  # noqa: F401
            import torchao.float8.float8_tensor_parallel  # noqa: F401
    return sys.modules["torchao.float8"]


def is_float8_linear(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` is a torchao Float8Linear (False, without importing torchao, when it is not loaded)."""
    mod = sys.modules.get("torchao.float8.float8_linear")
    return module is not None and mod is not None and isinstance(module, mod.Float8Linear)


def is_float8_all_gathered(param: torch.Tensor) -> bool:
    """Whether FSDP2 all-gathers ``param`` in float8: torchao's float8 weight under its sharding (False, without
    importing torchao, when it is not loaded)."""
    mod = sys.modules.get("torchao.float8.fsdp_utils")
    local = param.to_local() if isinstance(param, DTensor) else param
    return mod is not None and isinstance(local, mod.WeightWithDynamicFloat8CastTensor)


# --------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------


def linear_config(recipe: str, emulate: bool, fsdp_float8_all_gather: bool):
    """torchao's Float8LinearConfig for ``recipe``, with emulation and the FSDP float8 all-gather set."""
    assert recipe in RECIPES, recipe
    assert not (fsdp_float8_all_gather and recipe != "tensorwise"), "float8 all-gather is tensorwise only"
    f8 = _torchao_float8()
    base = f8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def module_filter(skip: Iterable[nn.Module], filter_fqns: Iterable[str], tp: int = 1) -> Callable[[nn.Module, str], bool]:
    """The layers to convert: ``nn.Linear`` layers not in ``skip`` nor MoE routers, whose name contains none of
    ``filter_fqns``, and whose dimensions (divided by ``tp``: each rank's slice) are multiples of 16."""
    skip_ids = {id(m) for m in skip if m is not None}
    fqns = [f for f in filter_fqns if f]

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or id(module) in skip_ids:
            return False
        if fqn.endswith("router.gate"):  # a MoE router (models/moe.py): its scores choose the experts, kept exact
            return False
        if any(f in fqn for f in fqns):
            return False
        # Conservative under TP: whichever dimension TP shards, its per-rank slice stays a multiple of 16.
        return all(d % (16 * tp) == 0 for d in (module.in_features, module.out_features))

    return keep


def check_float8_layers(model: nn.Module, filter_fqns: Iterable[str], tp: int = 1) -> tuple[int, int]:
    """The float8 section against the whole model (on the meta device, before the pipeline split): every
    float8.filter_fqns entry must name some linear layer (a misspelled one would silently convert it), and at
    least one layer must be left to convert (else float8.enable changes nothing). Returns (layers converted,
    linear layers); raises ConfigError. ``model.output`` is never converted."""
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    for entry in filter_fqns:
        if not any(entry in fqn for fqn in linears):
            examples = ", ".join(dict.fromkeys(fqn.split(".", 2)[-1] for fqn in linears[:8]))
            raise ConfigError(f"float8.filter_fqns: '{entry}' names no linear layer of the model (its layers: "
                                f"{examples}, ...); fix or remove it")
    keep = module_filter([getattr(model, "output", None)], filter_fqns, tp)
    converted = sum(keep(m, fqn) for fqn, m in model.named_modules())
    if converted == 0:
        raise ConfigError(
            f"{'float8.filter_fqns' if filter_fqns else 'float8.enable'}: no linear layer would run in float8 "
            "(float8.filter_fqns excludes the others, or their "
            f"dimensions{' per TP rank' if tp > 1 else ''} are not multiples of 16), so float8 would change "
            "nothing; narrow float8.filter_fqns or turn float8.enable off")
    return converted, len(linears)


def convert_float8(
    model: nn.Module,
    recipe: str = "tensorwise",
    emulate: bool = False,
    filter_fqns: Iterable[str] = (),
    fsdp_float8_all_gather: bool = False,
    tp: int = 1,
    skip: Iterable[nn.Module] = (),
) -> list[str]:
    """Swap ``model``'s eligible linear layers for Float8Linear in place (before TP, AC, compile and FSDP);
    returns the names of the converted layers. ``skip``: modules never converted (the output projection)."""
    f8 = _torchao_float8()
    config = linear_config(recipe, emulate, fsdp_float8_all_gather)
    keep = module_filter(skip, filter_fqns, tp)
    if recipe == "rowwise":
        # Compiled rowwise scaling with activation checkpointing can recompute a float8 cast with other rounding
        # than the forward's (NaNs seen in torchtitan, pytorch/pytorch#150859): make inductor round as eager does.
        set_inductor_option("emulate_precision_casts", True)
    converted: list[str] = []

    def record(module: nn.Module, fqn: str) -> bool:
        ok = keep(module, fqn)
        if ok:
            converted.append(fqn)
        return ok

    f8.convert_to_float8_training(model, module_filter_fn=record, config=config)
    return converted


# --------------------------------------------------------------------------------------------------------
# Tensor-parallel styles
# --------------------------------------------------------------------------------------------------------


def float8_tp_comm_supported(tp_mesh) -> bool:
    """Whether the TP process group can all-gather float8 tensors (NCCL can, gloo cannot)."""
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(tp_mesh.get_group()))


def colwise_parallel(module: nn.Module, float8_comm: bool, **kwargs):
    """ColwiseParallel, or torchao's float8 version for a Float8Linear when ``float8_comm``."""
    if float8_comm and is_float8_linear(module):
        return sys.modules["torchao.float8.float8_tensor_parallel"].Float8ColwiseParallel(**kwargs)
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(**kwargs)


def rowwise_parallel(module: nn.Module, float8_comm: bool, **kwargs):
    """RowwiseParallel, or torchao's float8 version for a Float8Linear when ``float8_comm``."""
    if float8_comm and is_float8_linear(module):
        return sys.modules["torchao.float8.float8_tensor_parallel"].Float8RowwiseParallel(**kwargs)
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(**kwargs)


def prepare_module_input(consumers: list[nn.Module], float8_comm: bool, **kwargs):
    """PrepareModuleInput, or (when ``float8_comm`` and every linear reading the input is a Float8Linear) the
    float8 version that casts the input before its all-gather, once for all of them."""
    if float8_comm and consumers and all(is_float8_linear(m) for m in consumers):
        return sys.modules["torchao.float8.float8_tensor_parallel"].PrepareFloat8ModuleInput(**kwargs)
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(**kwargs)


# --------------------------------------------------------------------------------------------------------
# After each optimizer step
# --------------------------------------------------------------------------------------------------------


def precompute_enabled(f8: Any) -> bool:
    return bool(f8.enable and f8.recipe == "tensorwise" and f8.fsdp_float8_all_gather and f8.precompute_scale)


def float8_after_optimizer_step(model_parts: list[nn.Module], f8: Any) -> None:
    """The trainer calls this right after ``optimizer.step()``. With ``float8.precompute_scale`` (and the FSDP
    float8 all-gather) it computes every float8 weight's scale from the updated weights in one all-reduce,
    for the next forward's all-gathers; otherwise it does nothing.

    Once a weight holds a precomputed scale, FSDP's all-gather uses it instead of computing its own, so after
    the first call every optimizer step must be followed by one (a trainer that never calls it falls back to
    the per-layer scales of the all-gather: same numbers, more all-reduces)."""
    if not precompute_enabled(f8):
        return
    f8mod = _torchao_float8()
    for part in model_parts:
        f8mod.precompute_float8_dynamic_scale_for_fsdp(part)
