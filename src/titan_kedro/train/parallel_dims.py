"""Parallel degrees and the device mesh built from them.

The world is laid out as a 3-D mesh ``(dp_replicate, dp_shard_mod_ep, ep)``; expert
parallelism borrows its ranks from the FSDP shard dimension, as in torchtitan:

- ``dp_shard = dp_shard_mod_ep × ep`` is the FSDP mesh of dense parameters (flattened);
- ``ep`` is the expert-parallel mesh: its ranks hold different experts and exchange
  tokens with all-to-all;
- ``dp_shard_mod_ep`` (with ``dp_replicate`` for HSDP) is the FSDP mesh of expert
  parameters, which are already split ``ep`` ways;
- ``dp`` (the whole world, 1-D) is data parallelism: every rank reads different data,
  and losses / expert loads are reduced over it.

Size-1 dimensions are kept, so the same names exist in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "ep")


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension, validated against the world size."""

    dp_replicate: int
    """HSDP replicas."""
    dp_shard: int
    """FSDP shard degree (``-1``: whatever the world leaves after replication)."""
    ep: int
    """Expert-parallel degree, taken out of ``dp_shard`` (1: no expert parallelism)."""
    world_size: int
    """Total number of ranks."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device (``cpu`` or ``cuda:<local rank>``)."""
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dense_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.ep < 1 or self.world_size < 1:
            raise ValueError(
                f"parallel degrees must be ≥ 1: replicate={self.dp_replicate}, ep={self.ep}, "
                f"world={self.world_size}"
            )
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree={self.dp_replicate} does not "
                    f"divide the world size {self.world_size}"
                )
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(
                f"replicate {self.dp_replicate} × shard {self.dp_shard} != world size "
                f"{self.world_size}; set parallelism.data_parallel_shard_degree to -1"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree={self.ep} must divide the FSDP shard "
                f"degree {self.dp_shard} (expert parallelism borrows ranks from it)"
            )

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, device: torch.device) -> ParallelDims:
        """Degrees from ``cfg.parallelism`` (plus the ``expert_parallel_degree`` extension)."""
        section = cfg.parallelism
        return cls(
            dp_replicate=section.data_parallel_replicate_degree,
            dp_shard=section.data_parallel_shard_degree,
            ep=int(getattr(section, "expert_parallel_degree", 1)),
            world_size=world_size,
            device=device,
        )

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether there is anything to shard or replicate (more than one data-parallel rank).

        On one rank the model stays unwrapped: FSDP would only copy every parameter and
        gradient through its buffers each step, and mixed precision comes from autocast.
        """
        return self.dp_degree > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP degree of expert parameters (the shard ranks left over by EP)."""
        return self.dp_shard // self.ep

    def build_mesh(self) -> DeviceMesh:
        """Create the meshes (needs an initialised process group); returns the 3-D world mesh.

        The 1-D ``dp`` mesh is unflattened twice, into ``(dp_replicate, dp_shard)`` for
        dense FSDP and into ``(dp_replicate, dp_shard_mod_ep, ep)`` for experts, so rank
        ``r`` sits at the same place in both.
        """
        flat = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        self._dp_mesh = flat
        self._dense_mesh = flat._unflatten(
            0, (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
        )
        self._world_mesh = flat._unflatten(
            0, (self.dp_replicate, self.dp_shard_mod_ep, self.ep), MESH_DIMS
        )
        return self._world_mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """3-D mesh ``(dp_replicate, dp_shard_mod_ep, ep)``."""
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called yet")
        return self._world_mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh over every data-parallel rank (loss and expert-load reductions)."""
        self.world_mesh  # noqa: B018  (raises before build_mesh)
        return self._dp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for FSDP of dense parameters: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
        self.world_mesh  # noqa: B018
        if self.dp_replicate > 1:
            return self._dense_mesh
        return self._dense_mesh["dp_shard"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Mesh for FSDP of expert parameters: ``dp_shard_mod_ep`` (with replicate for HSDP)."""
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_mod_ep"]
        return self.world_mesh["dp_shard_mod_ep"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that share one set of experts between them."""
        return self.world_mesh["ep"]

    @property
    def ep_group(self) -> torch.distributed.ProcessGroup:
        """Process group for the expert all-to-all."""
        return self.ep_mesh.get_group()

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (selects its data)."""
        return self.dp_mesh.get_local_rank()
