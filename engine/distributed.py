"""The world: process group, device, seeds and determinism.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain ``python -m engine.train`` is a world of one.
NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int
    """Global rank of this process."""
    local_rank: int
    """Rank of this process on its node (selects the GPU)."""
    world_size: int
    """Number of processes in the job."""
    device: torch.device
    """The device this rank computes on."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> World:
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = world_size_from_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # TESSERA_BACKEND=gloo lets several ranks share one GPU (NCCL refuses that): a check of CUDA code paths.
    backend = os.environ.get("TESSERA_BACKEND", backend)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return World(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every generator; with ``deterministic``, allow only deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
