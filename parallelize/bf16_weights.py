"""bf16 matmul weights whose fp32 masters are kept as a bf16 high half and a 16-bit low half (one GPU).

Without FSDP, bf16 compute on CUDA is autocast: every fp32 matmul weight (``nn.Linear``'s, the MoE experts')
is cast to bf16 wherever a matmul reads it (each forward, each recomputation) and its bf16 gradient is cast back
to fp32: casts whose results the optimizer could have written once (their cost: docs/performance.md).

``split_matmul_weights`` stores each matmul weight (``nn.Linear`` and its subclasses, torchao's
``Float8Linear`` included, and a Mixture-of-Experts layer's stacked expert weights) as its bf16 rounding (round
to nearest even, as autocast's cast), with a 16-bit buffer (``weight_low``, ``w1_low``, ...) holding the rest:
together the fp32 weight exactly (``master_weight``), in the same 4 bytes per element. The matmuls read the
parameter with no cast, its gradient stays bf16, and the optimizer (``engine.optim.AdamWWithBf16Weights``)
rebuilds each fp32 weight, updates it and writes both halves back in one pass.

What does not change:

- The numbers: autocast's. One exception: a weight whose low 16 bits are exactly half a bf16 step would need a
  low half of +2^15, one past int16's range; it is stored 1 fp32 ulp lower, which keeps its bf16 value. Under
  float8 each weight is cast to float8 from its bf16 value, as under FSDP's bf16 mixed precision.
- The state: the state dict gives the fp32 weight (a hook rebuilds it; loading splits it again) and the
  optimizer's state is AdamW's, so checkpoints and exports are those of a run without split weights and either
  kind of run resumes the other's. A state dict builds the fp32 weights on the GPU while they fit in its free
  memory with 1 GiB to spare, then on the CPU, so a save never runs out of the memory training had.
- Autocast stays on: it casts the activations (the residual stream stays fp32) and finds the weights in bf16.

Memory: 4 bytes per weight element as before (2 + 2), no bf16 copies in flight, bf16 gradients (half the bytes).

Where (``bf16_weights_apply``): bf16 autocast on CUDA, no FSDP, one rank, no gradient accumulation. A
pipeline's microbatches and gradient accumulation would add the gradients up in bf16; tensor-parallel weights
are DTensors. Those layouts keep plain autocast, as does ``training.bf16_weights = false``.

Under FSDP2 (``split_fsdp_weights``, ``training.fsdp_bf16_weights``): every parameter's shard is split (FSDP2
needs one dtype per unit), so the all-gather reads bf16 shards with no cast, the gradients are reduced in
``mixed_precision_reduce`` as before and kept as bf16 shards, and the low halves stay sharded beside them. The
bf16 values the blocks compute with are the ones FSDP's cast gave; a gradient reduced over several ranks is
rounded to bf16 once more (on one rank it is the same).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.moe import GroupedExperts


def bf16_weights_apply(enabled: bool, distributed: bool, grad_accum: int) -> bool:
    """Whether a run that computes under bf16 autocast (CUDA, bfloat16, no FSDP) gets split bf16 weights: one
    rank and no gradient accumulation (the module docstring says why)."""
    return enabled and not distributed and grad_accum == 1


def master_weight(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight that the bf16 ``high`` half and the int16 ``low`` half hold, in one 4-byte buffer per
    element with no temporaries beside it (a state dict builds every weight this way; compiled, the update fuses
    it)."""
    weight = high.view(torch.int16).to(torch.int32)
    weight.bitwise_left_shift_(16).add_(low)
    return weight.view(torch.float32)


def split(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (bf16 high, int16 low) halves of an fp32 ``weight``: high is its round-to-nearest-even bf16 value,
    low the difference of the two bit patterns (in [-2^15, 2^15]; +2^15, a tie kept even, is stored as
    2^15 - 1: the weight 1 fp32 ulp lower, with the same high half)."""
    high = weight.to(torch.bfloat16)
    low = weight.view(torch.int32) - (high.view(torch.int16).to(torch.int32) << 16)
    return high, low.clamp(max=2**15 - 1).to(torch.int16)


STATE_DICT_SPARE_BYTES = 2**30
"""GPU memory a state dict's fp32 weights leave free (the save's own buffers, the next step's first kernels)."""


def fits_on_gpu(nbytes: int, device: torch.device) -> bool:
    """Whether ``nbytes`` more fit on ``device`` now, with STATE_DICT_SPARE_BYTES to spare: the device's free
    memory and the caching allocator's free blocks together."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes + STATE_DICT_SPARE_BYTES <= free + cached


def state_dict_weight(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the halves hold, for a state dict: on their GPU when it fits (``fits_on_gpu``), else on
    the CPU (the halves copied there, 4 bytes per element, and joined there)."""
    if high.is_cuda:
        if fits_on_gpu(4 * high.numel(), high.device):
            try:
                return master_weight(high, low)
            except torch.OutOfMemoryError:  # free memory that a fragmented cache could not give in one block
                pass
        high, low = high.cpu(), low.cpu()
    return master_weight(high, low)


def _low_name(name: str) -> str:
    return f"{name}_low"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local tensor), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def placed_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the same kind of tensor as ``like``: a DTensor with its mesh, placements and shape, or as is."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """The fp32 weights in the state dict, as without split weights (``state_dict_weight``: GPU or CPU)."""
    for name in module._split_names:
        high = module._parameters[name].detach()
        whole = state_dict_weight(local_tensor(high), module._buffers[_low_name(name)])
        state_dict[prefix + name] = placed_like(whole, high)


def _load_state_dict_pre_hook(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Loading an fp32 weight: its low half into the buffer; load_state_dict then copies it into the bf16
    parameter, rounding to nearest even, which is the high half."""
    for name in module._split_names:
        value = state_dict.get(prefix + name)
        if value is not None:
            low = module._buffers[_low_name(name)]
            value = local_tensor(value.detach())
            assert value.shape == low.shape, (prefix + name, value.shape, low.shape)
            with torch.no_grad():
                low.copy_(split(value.to(low.device, torch.float32))[1])


def _keep_low(module: nn.Module, name: str, low: torch.Tensor) -> None:
    """Register ``low`` as parameter ``name``'s low half (a buffer outside the state dict) and, once per
    module, the hooks that give and take fp32 weights."""
    if not hasattr(module, "_split_names"):
        module._split_names = []
        module.register_state_dict_post_hook(_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    module._split_names.append(name)
    module.register_buffer(_low_name(name), low, persistent=False)


def _holders(part: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Each parameter of ``part`` (by id) with every (module, name) holding it: a tied one has several."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in part.modules():
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append((module, name))
    return holders


def _matmul_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The weights of ``module`` that its matmuls read in the compute dtype (autocast casts them): a linear
    layer's ``weight``, the experts' stacked ``w1``, ``w2`` and ``w3`` (models/moe.py casts them as autocast
    would)."""
    if isinstance(module, nn.Linear):
        return ("weight",)
    if isinstance(module, GroupedExperts):
        return ("w1", "w2", "w3")
    return ()


def split_matmul_weights(parts: Iterable[nn.Module]) -> dict[nn.Parameter, torch.Tensor]:
    """Store every matmul weight of ``parts`` (``_matmul_weight_names``) as bf16 + low half (in place: the same
    Parameter objects, so an optimizer built over them keeps them); returns parameter -> low half, for the
    optimizer. Call it once the weights are final (initialized or loaded) and before the first forward (compiled
    blocks trace then). A weight that another module shares (an output projection tied to the embedding) stays
    fp32: the embedding would otherwise read bf16 and start the residual stream in bf16."""
    lows: dict[nn.Parameter, torch.Tensor] = {}
    for part in parts:
        holders = _holders(part)
        for module in part.modules():
            for name in _matmul_weight_names(module):
                weight = module._parameters[name]
                if _low_name(name) in module._buffers or len(holders[id(weight)]) > 1:
                    continue
                assert weight is not None and weight.dtype == torch.float32, (type(module), name, weight)
                assert not isinstance(weight, DTensor), "split weights are for one rank"
                high, low = split(weight.detach())
                weight.data = high
                _keep_low(module, name, low)
                lows[weight] = low
    return lows


def split_fsdp_weights(parts: Iterable[nn.Module]) -> dict[nn.Parameter, torch.Tensor]:
    """Store every parameter of ``parts`` (FSDP2 modules, not yet run) as bf16 + low half, shard by shard:
    FSDP2 converts its sharded parameters in place (``_apply``), keeping the Parameter objects, so an optimizer
    built over them keeps them. Returns parameter -> low half (this rank's shard), for the optimizer. Call it
    once the weights are final (initialized or loaded) and before the first forward."""
    lows: dict[nn.Parameter, torch.Tensor] = {}
    for part in parts:
        owners = _holders(part)

        def to_high(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in owners or t in lows:  # a buffer, or a tied parameter split already: as it is
                return t
            assert isinstance(t, DTensor) and t.dtype == torch.float32, (owners[id(t)][0][1], type(t), t.dtype)
            high, low = split(t.detach().to_local())
            for module, name in owners[id(t)]:
                _keep_low(module, name, low)
            lows[t] = low
            return placed_like(high, t)

        part._apply(to_high)
    for p, low in lows.items():
        assert p.dtype == torch.bfloat16 and p.to_local().shape == low.shape, (p.dtype, p.shape, low.shape)
    return lows
