"""The job's layout: how its ranks split the work, derived and validated in one place.

``JobConfig.layout`` builds it from ``launch``, ``parallelism``, ``fault_tolerance`` and
``training``; the config validation, the DeepSeek spec's check, the mesh
(``train/parallel_dims.ParallelDims``), the planner, the loaders and the trainer all read
it, so no other module resolves ``data_parallel_shard_degree: -1`` or divides the
global batch. Two data-parallel numbers have two names:

- ``dp_degree``: the data-parallel ranks of one replica group (``dp_replicate ×
  dp_shard``), over which gradients are reduced inside the group;
- ``data_ranks``: every rank that reads different data (``dp_degree × replica_groups``);
  the global batch is ``local_batch_size × data_ranks × grad_accum_steps``.

Tensor parallelism (``tp``) is the innermost degree: the world of one group is
``dp_degree × tp`` (pipeline parallelism adds ``pp`` in front); the ``tp`` ranks of a
data-parallel rank read the same batch. Expert parallelism borrows from ``dp_shard × tp``
(torchtitan's rule), so ``ep`` must divide that product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Degrees, batch split and accumulation of one job (validated on construction).

    Build it with :meth:`build` (which resolves ``-1`` and the accumulation steps and
    names the config keys in its errors) or :meth:`from_config`.
    """

    world_size: int
    """Ranks of one replica group (``launch.nproc_per_node × launch.nnodes``)."""
    dp_replicate: int
    """HSDP replicas (``parallelism.data_parallel_replicate_degree``)."""
    dp_shard: int
    """FSDP shard degree, resolved (never -1)."""
    ep: int = 1
    """Expert-parallel degree, borrowed from ``dp_shard`` (1: none)."""
    replica_groups: int = 1
    """Fault-tolerant replica groups (1 without ``fault_tolerance.enable``)."""
    local_batch_size: int = 1
    """Samples per rank per micro-batch (``training.local_batch_size``)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step on each rank."""
    tp: int = 1
    """Tensor-parallel degree (``parallelism.tensor_parallel_degree``; innermost)."""

    def __post_init__(self) -> None:
        degrees = {
            "world_size": self.world_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "ep": self.ep,
            "replica_groups": self.replica_groups,
            "local_batch_size": self.local_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "tp": self.tp,
        }
        small = {name: value for name, value in degrees.items() if value < 1}
        if small:
            raise ValueError(f"layout degrees must be ≥ 1, got {small}")
        if self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            tensor = f" × tensor {self.tp}" if self.tp > 1 else ""
            raise ValueError(
                f"parallelism: replicate {self.dp_replicate} × shard {self.dp_shard}{tensor} "
                f"= {self.dp_replicate * self.dp_shard * self.tp}, but the world size "
                f"is {self.world_size} (launch.nproc_per_node × launch.nnodes); set "
                "data_parallel_shard_degree: -1 or make the product equal the world size"
            )
        if (self.dp_shard * self.tp) % self.ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree={self.ep} must divide the data-parallel "
                f"shard degree {self.dp_shard} × tensor-parallel degree {self.tp} = "
                f"{self.dp_shard * self.tp} (expert parallelism borrows its ranks from FSDP "
                "sharding and tensor parallelism); pick a divisor of it"
            )

    @classmethod
    def build(
        cls,
        *,
        world_size: int,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        ep: int = 1,
        replica_groups: int = 1,
        local_batch_size: int = 1,
        global_batch_size: int | None = None,
        tp: int = 1,
    ) -> Layout:
        """Resolve ``dp_shard = -1`` and the accumulation steps, then validate.

        Args:
            world_size: Ranks of one replica group.
            dp_replicate: HSDP replicas.
            dp_shard: FSDP shard degree; -1 takes what the world leaves after replication.
            ep: Expert-parallel degree.
            replica_groups: Fault-tolerant replica groups.
            local_batch_size: Samples per rank per micro-batch.
            global_batch_size: Samples per optimizer step over every data rank; None: no
                accumulation.
            tp: Tensor-parallel degree.

        Raises:
            ValueError: Naming the config key at fault and how to fix it.
        """
        if tp < 1 or world_size % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the world size "
                f"{world_size} (launch.nproc_per_node × launch.nnodes); pick a divisor of "
                f"{world_size}, or change the number of ranks"
            )
        if dp_shard == -1:
            if dp_replicate < 1 or (world_size // tp) % dp_replicate:
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree={dp_replicate} does not divide "
                    f"the world size {world_size} (launch.nproc_per_node × launch.nnodes) "
                    f"divided by parallelism.tensor_parallel_degree={tp}; pick a divisor of "
                    f"{world_size // tp}"
                )
            dp_shard = world_size // (dp_replicate * tp)
        accum = 1
        if global_batch_size is not None:
            data_ranks = world_size // tp * replica_groups
            per_micro_batch = local_batch_size * data_ranks
            if per_micro_batch < 1 or global_batch_size % per_micro_batch:
                raise ValueError(
                    f"training.global_batch_size={global_batch_size} must be a multiple of "
                    f"training.local_batch_size={local_batch_size} × data ranks {data_ranks} "
                    f"(world size {world_size} / tensor parallel {tp} × replica groups "
                    f"{replica_groups})"
                )
            accum = global_batch_size // per_micro_batch
        return cls(
            world_size=world_size,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=ep,
            replica_groups=replica_groups,
            local_batch_size=local_batch_size,
            grad_accum_steps=accum,
            tp=tp,
        )

    @classmethod
    def from_config(cls, cfg: Any) -> Layout:
        """The layout of a ``JobConfig`` (duck-typed: its sections are all that is read)."""
        ft, parallelism, training = cfg.fault_tolerance, cfg.parallelism, cfg.training
        return cls.build(
            world_size=cfg.launch.world_size,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            ep=parallelism.expert_parallel_degree,
            replica_groups=ft.replica_groups if ft.enable else 1,
            local_batch_size=training.local_batch_size,
            global_batch_size=training.global_batch_size,
            tp=parallelism.tensor_parallel_degree,
        )

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks of one replica group (gradients are reduced over them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: every data-parallel rank of every replica group."""
        return self.dp_degree * self.replica_groups

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP degree of expert parameters (the shard × tensor ranks left over by EP)."""
        return self.dp_shard * self.tp // self.ep

    @property
    def group_batch_size(self) -> int:
        """Samples one replica group trains on per optimizer step."""
        return self.local_batch_size * self.dp_degree * self.grad_accum_steps

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over every data rank."""
        return self.group_batch_size * self.replica_groups
