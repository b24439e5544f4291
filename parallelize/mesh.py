"""The parallel layout: degrees of each dimension and one DeviceMesh with named views.

The ranks form a 5-D grid ``pp x dp_replicate x dp_shard x cp x tp`` (tp innermost, so tensor-parallel
peers are neighbours on a node). Every dimension is in the mesh, size 1 included: a size-1 dimension adds
no communication, and every view then exists whatever the layout, so code asks for the view it needs
instead of testing which dimensions are on. Views, beside the five dimensions:

- ``dp``          = dp_replicate x dp_shard: ranks that read different samples (the data loader's shard).
- ``dp_shard_cp`` = dp_shard x cp: the ranks FSDP2 shards parameters over (CP ranks hold different tokens
  of the same samples, so they can share the shards).
- ``dp_cp``       = dp_replicate x dp_shard x cp: ranks holding different tokens; the loss, the token
  count and the gradient all-reduce run over it.
- ``dp_shard_cp_tp`` = dp_shard x cp x tp: no code asks for it, but DTensor finds it: the gradient norm
  of FSDP x TP parameters is partial over (dp_shard_cp, tp), and with this view DTensor reduces it in one
  all-reduce instead of one per dimension (slower, and the ranks could round differently).

Expert parallelism (``ep`` > 1, Mixture-of-Experts flavors) carves ep out of dp_shard x cp: the ``dp_shard_cp``
ranks are split into ``edp x ep`` (ep innermost). Views for the MoE layers, built when ep > 1 or tp > 1:

- ``ep``          : the ranks that hold different experts and exchange tokens by all-to-all.
- ``efsdp``       : edp x tp: the ranks holding the same experts and different tokens (under TP each rank runs
  the MoE layer on its own sequence shard); FSDP2 shards and reduces the experts over them.
- ``expert_fsdp`` : FSDP2's mesh for the experts: efsdp, with dp_replicate in front for HSDP.
- ``moe_fsdp``    : FSDP2's mesh for a MoE layer's router and shared experts under TP: dp_shard x cp x tp, with
  dp_replicate in front for HSDP (every rank holding other tokens).

``DeviceMesh._flatten``, ``_unflatten`` and ``_concatenate`` are private APIs (the only way torch offers to build
these views); this module is the one place that calls them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.config.errors import ConfigError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp_tp": ("dp_shard", "cp", "tp"),
}


@dataclass
class ParallelDims:
    """Degrees of the parallel dimensions (all resolved, >= 1) and, once built, the mesh."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    fsdp_single_rank: bool = False
    """Wrap in FSDP2 on a world of one rank too (parallelism.fsdp_single_rank)."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp_shard x cp (adds no ranks)."""
    _meshes: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, p: Any, world_size: int) -> "ParallelDims":
        """Resolve ``parallelism`` for ``world_size`` ranks; raises ConfigError naming the field."""
        degrees = {name: int(getattr(p, name, 1)) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
        for name, value in degrees.items():
            if value < 1 and not (name == "dp_shard" and value == -1):
                allowed = ">= 1, or -1 for the ranks left over" if name == "dp_shard" else ">= 1"
                raise ConfigError(f"parallelism.{name}: must be {allowed}, got {value}")
        others = math.prod(v for k, v in degrees.items() if k != "dp_shard")
        if degrees["dp_shard"] == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism.dp_shard: -1 takes the ranks left over, but the other degrees "
                    f"({_describe(degrees, skip='dp_shard')} = {others}) do not divide the world size {world_size}"
                )
            degrees["dp_shard"] = world_size // others
        product = math.prod(degrees.values())
        if product != world_size:
            raise ConfigError(
                f"parallelism: the degrees multiply to {product} ({_describe(degrees)}) but the world has "
                f"{world_size} ranks (NGPU x nodes); make the product equal the world size, or set "
                f"parallelism.dp_shard = -1"
            )
        ep = int(getattr(p, "ep", 1))
        if ep < 1:
            raise ConfigError(f"parallelism.ep: must be >= 1, got {ep}")
        if (degrees["dp_shard"] * degrees["cp"]) % ep:
            raise ConfigError(
                f"parallelism.ep: {ep} does not divide dp_shard x cp = {degrees['dp_shard']} x {degrees['cp']}; expert "
                "parallelism spreads the experts over ranks drawn from those two dimensions, so pick an ep that "
                "divides their product"
            )
        single = bool(getattr(p, "fsdp_single_rank", False)) and world_size == 1
        return cls(world_size=world_size, fsdp_single_rank=single, ep=ep, **degrees)

    # -- which techniques are on ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def data_parallel(self) -> bool:
        """Whether the model is wrapped in FSDP2 (FSDP, HSDP or DDP, or FSDP on a single rank)."""
        return self.fsdp_enabled or self.dp_replicate_enabled or self.fsdp_single_rank

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def distributed(self) -> bool:
        """Whether there is a process group and a mesh (more than one rank, or FSDP on a single rank)."""
        return self.world_size > 1 or self.fsdp_single_rank

    # -- the mesh ----------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str, backend: str = "gloo"):
        """Build the 5-D mesh and its flattened views (needs an initialized process group of world_size, or, for
        fsdp_single_rank, makes one of ``backend``: the trainer passes engine.distributed.process_group_backend's)."""
        from torch.distributed.device_mesh import init_device_mesh

        assert self.distributed, "a world of one rank has no mesh"
        import torch.distributed as dist

        if not dist.is_initialized():  # fsdp_single_rank: a process group of one, no launcher needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        shape = tuple(getattr(self, name) for name in DIM_NAMES)
        root = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        self._meshes = {"root": root, **{name: root[name] for name in DIM_NAMES}}
        for view, dims in FLAT_VIEWS.items():
            self._meshes[view] = root[dims]._flatten(view)
        # FSDP2's mesh: 1-D for FSDP, 2-D (replicate, shard) for HSDP and DDP.
        if self.cp == 1:
            self._meshes["fsdp"] = root["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else root["dp_shard"]
        elif self.dp_replicate == 1:
            self._meshes["fsdp"] = self._meshes["dp_shard_cp"]
        else:
            with warnings.catch_warnings():  # slicing a flattened view out of the root: the only way in torch
                warnings.simplefilter("ignore")
                self._meshes["fsdp"] = root["dp_replicate", "dp_shard_cp"]
        if self.ep > 1 or self.tp > 1:
            self._build_moe_views(root)
        return root

    def _build_moe_views(self, root) -> None:
        """The MoE layers' views (see the module doc)."""
        from torch.distributed.device_mesh import DeviceMesh

        m = self._meshes
        if self.ep > 1:
            split = m["dp_shard_cp"]._unflatten(0, (self.dp_shard * self.cp // self.ep, self.ep), ("edp", "ep"))
            m["ep"] = split["ep"]
            edp = split["edp"]
            m["efsdp"] = DeviceMesh._concatenate([edp, root["tp"]])._flatten("efsdp") if self.tp > 1 else edp
        else:
            m["efsdp"] = m["dp_shard_cp_tp"]
        replicate = [root["dp_replicate"]] if self.dp_replicate > 1 else []
        m["expert_fsdp"] = DeviceMesh._concatenate([*replicate, m["efsdp"]]) if replicate else m["efsdp"]
        m["moe_fsdp"] = (DeviceMesh._concatenate([*replicate, m["dp_shard_cp_tp"]]) if replicate
                         else m["dp_shard_cp_tp"])

    def mesh(self, name: str):
        """The named view: one of pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp, fsdp, root; with ep > 1
        or tp > 1 also ep (ep > 1), efsdp, expert_fsdp and moe_fsdp."""
        assert self._meshes, "build_mesh() first"
        return self._meshes[name]

    def coordinate(self, view: str) -> tuple[int, int]:
        """(this rank's index, size) along a 1-D view; (0, 1) in a world of one."""
        if not self._meshes:
            return 0, 1
        mesh = self._meshes[view]
        return mesh.get_local_rank(), mesh.size()

    def group(self, view: str) -> Optional[Any]:
        """The process group of a 1-D view; None in a world of one."""
        return self._meshes[view].get_group() if self._meshes else None

    def group_names(self) -> list[str]:
        """The names of this rank's process groups, one per view (the names collectives are called with)."""
        return [self._meshes[view].get_group().group_name for view in (*DIM_NAMES, *FLAT_VIEWS)] \
            if self._meshes else []

    def is_dp_leader(self) -> bool:
        """Whether this rank is the first of the ranks that share its data (pp, cp and tp coordinates 0)."""
        return all(self.coordinate(view)[0] == 0 for view in ("pp", "cp", "tp"))

    def describe(self) -> str:
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return _describe({name: getattr(self, name) for name in DIM_NAMES}) + ep


def _describe(degrees: dict[str, int], skip: str = "") -> str:
    return " x ".join(f"{k} {v}" for k, v in degrees.items() if k != skip)
