"""The device meshes of a job's layout (the degrees: ``config/layout.Layout``).

The world is ``(pp, dp_replicate, dp_shard, tp)``, outermost first: pipeline stages
outermost (rank ``r`` is in stage ``r // (dp_degree × tp)``), then data parallelism inside
each stage, tensor parallelism innermost (so its ranks are neighbours on one node). Sparse
(routed-expert) parameters see a stage's ranks as ``(dp_replicate, dp_shard_mod_ep, ep)``:
expert parallelism borrows its ranks from ``dp_shard × tp``, the innermost first, as
torchtitan's ``efsdp × ep`` does:

- ``pp`` is the pipeline mesh: its ranks hold different stages of the same samples and
  pass activations point to point (``train/pipeline``);
- ``dp_shard`` (with ``dp_replicate`` for HSDP) is the FSDP mesh of dense parameters;
- ``tp`` is the tensor-parallel mesh (``models/tensor_parallel``); its ranks hold
  different sequence shards between blocks, which is what lets EP borrow them;
- ``ep`` is the expert-parallel mesh: its ranks hold different experts and exchange
  tokens with all-to-all;
- ``dp_shard_mod_ep = dp_shard × tp / ep`` (with ``dp_replicate`` for HSDP) is the FSDP
  mesh of expert parameters, which are already split ``ep`` ways;
- ``dp`` (``Layout.dp_degree`` ranks, 1-D: the ranks of this rank's stage without
  ``tp``) is data parallelism: its ranks read different data, and losses are averaged
  over it (across replica groups, ``ft/`` reduces again); expert loads are summed over
  every rank of the stage (``load_group``).

Size-1 dimensions are kept, so the same names exist in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_kedro.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep")
DENSE_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """The meshes of a validated :class:`~titan_kedro.config.layout.Layout` on this rank."""

    layout: Layout
    """The degrees (validated when the layout was built)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device (``cpu`` or ``cuda:<local rank>``)."""
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dense_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _pp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, device: torch.device) -> ParallelDims:
        """The meshes of ``cfg.layout``, checked against the ranks that were started.

        Raises:
            ValueError: ``world_size`` (the ranks torchrun started) is not the configured one.
        """
        layout = cfg.layout
        if world_size != layout.world_size:
            raise ValueError(
                f"{world_size} ranks were started, but the config's world size is "
                f"{layout.world_size} (launch.nproc_per_node × launch.nnodes); start the "
                "workers through the training pipeline, or set launch.* to match"
            )
        return cls(layout, device)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks of this replica group (gradients are reduced over them)."""
        return self.layout.dp_degree

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
        return self.layout.dp_shard_mod_ep

    def build_mesh(self) -> DeviceMesh:
        """Create the meshes (needs an initialised process group); returns the 4-D world mesh.

        The ``(pp, stage)`` mesh's ``stage`` dimension (every rank of one pipeline stage) is
        unflattened twice, into ``(dp_replicate, dp_shard, tp)`` for dense parameters and
        into ``(dp_replicate, dp_shard_mod_ep, ep)`` for experts, so rank ``r`` sits at the
        same place in both; ``dp`` flattens the dense mesh's data dimensions (without
        ``tp``, the stage itself).
        """
        stage = "dp" if self.tp == 1 else "stage"
        flat = init_device_mesh(
            self.device.type, (self.pp, self.dp_degree * self.tp), mesh_dim_names=("pp", stage)
        )
        self._pp_mesh = flat["pp"]
        self._flat_mesh = flat[stage]
        self._dense_mesh = flat._unflatten(
            1, (self.dp_replicate, self.dp_shard, self.tp), DENSE_DIMS
        )
        if self.tp == 1:
            self._dp_mesh = flat["dp"]
        else:
            self._dp_mesh = self._dense_mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self._world_mesh = flat._unflatten(
            1, (self.dp_replicate, self.dp_shard_mod_ep, self.ep), MESH_DIMS[1:]
        )
        return self._world_mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """4-D mesh ``(pp, dp_replicate, dp_shard_mod_ep, ep)``."""
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called yet")
        return self._world_mesh

    @property
    def pp_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that hold this rank's pipeline (one per stage group)."""
        self.world_mesh  # noqa: B018
        return self._pp_mesh

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (0: holds the first stage)."""
        return self.pp_mesh.get_local_rank()

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
            return self._dense_mesh["dp_replicate", "dp_shard"]
        return self._dense_mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that split one model replica's tensors between them."""
        self.world_mesh  # noqa: B018
        return self._dense_mesh["tp"]

    @property
    def load_group(self) -> torch.distributed.ProcessGroup:
        """Every rank of this pipeline stage: expert loads are summed over it (the ``tp``
        ranks route different sequence shards)."""
        self.world_mesh  # noqa: B018
        return self._flat_mesh.get_group()

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
        """This rank's index among its group's data-parallel ranks (``ft/identity.data_shard``
        places it among every group's)."""
        return self.dp_mesh.get_local_rank()
