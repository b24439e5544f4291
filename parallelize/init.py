"""Layout-independent initialization of a parallelized model.

A parallelized model's parameters are DTensors: each rank holds a shard. Initializing the shards in place
would draw different random numbers under each layout (and, on CPU, the same numbers on every shard),
so a run's weights would depend on how it is parallelized. Instead, ``materialize(module)`` lets a model's
own init code run on whole, plain tensors: inside the context each DTensor parameter of ``module`` is
swapped for a full-size tensor; on exit every rank copies its own shard of it into the DTensor. All ranks
draw the same random sequence as one process would, so every layout starts from exactly the weights of a
single-process run with the same seed. Models call it one unit (a block, the embedding) at a time, so the
extra memory is one unit's full parameters.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def _compute_device(param: DTensor) -> torch.device:
    """Where ``param``'s init draws its numbers: the device its mesh computes on, also when its shard lives in CPU
    memory (FSDP's CPU offload), since the CPU's generator draws other numbers than CUDA's for the same seed."""
    local = param.to_local().device
    kind = param.device_mesh.device_type
    if local.type == kind or kind == "cpu":
        return local
    return torch.device(kind, torch.get_device_module(kind).current_device())


@contextlib.contextmanager
def materialize(module: nn.Module | None):
    """Within the context, ``module``'s DTensor parameters are whole plain tensors (see module doc)."""
    if module is None:
        yield
        return
    swapped = []  # (owner, name, original DTensor parameter, full tensor)
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                full = torch.empty(param.shape, dtype=param.dtype, device=_compute_device(param))
                owner.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
                swapped.append((owner, name, param, full))
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, param, full in swapped:
                owner.register_parameter(name, param)
                mesh = param.device_mesh
                whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
                # Replicate -> Shard is a local slice on every rank: no communication.
                param.to_local().copy_(whole.redistribute(mesh, param.placements).to_local())
