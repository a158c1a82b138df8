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

The world of one group is ``pp × dp_degree × tp``, outermost first. Tensor parallelism
(``tp``) is innermost; the ``tp`` ranks of a data-parallel rank read the same batch.
Expert parallelism borrows from ``dp_shard × tp`` (torchtitan's rule), so ``ep`` must
divide that product. Pipeline parallelism (``pp``) splits the model's blocks into stages
held by different ranks; each stage is data-parallel over ``dp_degree`` ranks, and every
rank of one pipeline reads the same samples. Its step runs ``n_microbatches =
local_batch_size × grad_accum_steps / pp_microbatch_size`` microbatches through the schedule (``train/pipeline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
"""Pipeline schedules of ``torch.distributed.pipelining`` this project trains with.

``ZBVZeroBubble`` and ``DualPipeV`` split each backward into an input and a weight part
by autograd-graph surgery; the fused output loss computes its weight gradient inside its
forward and the MoE layers route through custom autograd functions, so they are refused
rather than trained untested."""
INTERLEAVED_SCHEDULES = ("Interleaved1F1B",)
"""Schedules that run several stages per pipeline rank."""


def check_pipeline(layout: Layout) -> None:
    """Refuse a pipeline that torch's schedules cannot run (names the key and the fix).

    Raises:
        ValueError: An unknown schedule, stages per rank that do not fit it, a microbatch
            size that does not split the rank's samples, or too few microbatches.
    """
    schedule, pp, per_rank = layout.pp_schedule, layout.pp, layout.pp_stages_per_rank
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"parallelism.pipeline_schedule={schedule!r} is not supported; use one of "
            f"{', '.join(PP_SCHEDULES)}"
        )
    interleaved = schedule in INTERLEAVED_SCHEDULES
    if interleaved and per_rank < 2:
        raise ValueError(
            f"parallelism.pipeline_stages_per_rank={per_rank}: {schedule} needs 2 or more "
            "stages per rank (or use pipeline_schedule: 1F1B)"
        )
    if not interleaved and per_rank != 1:
        raise ValueError(
            f"parallelism.pipeline_stages_per_rank={per_rank}: {schedule} runs one stage per "
            "rank; set it to 1, or use pipeline_schedule: Interleaved1F1B"
        )
    if layout.pp_microbatch_size < 1:
        raise ValueError("parallelism.pipeline_microbatch_size must be ≥ 1")
    samples = layout.local_batch_size * layout.grad_accum_steps
    if samples % layout.pp_microbatch_size:
        raise ValueError(
            f"parallelism.pipeline_microbatch_size={layout.pp_microbatch_size} does not divide "
            f"the {samples} samples each rank trains per step (training.local_batch_size "
            f"{layout.local_batch_size} × {layout.grad_accum_steps} accumulation steps); "
            "pick a divisor of it"
        )
    n_micro = samples // layout.pp_microbatch_size
    if n_micro < pp:
        raise ValueError(
            f"{n_micro} pipeline microbatch(es) per step do not fill a {pp}-rank pipeline "
            f"({schedule} needs at least {pp}); lower parallelism.pipeline_microbatch_size or "
            "raise training.global_batch_size (more accumulation) or training.local_batch_size"
        )
    rounds = max(1, n_micro // pp)
    if interleaved and n_micro % rounds:
        raise ValueError(
            f"{n_micro} pipeline microbatches per step: {schedule} needs a multiple of its "
            f"{rounds} rounds (n_microbatches // pipeline degree {pp}); make the microbatches "
            f"a multiple of {pp} (parallelism.pipeline_microbatch_size, training.global_batch_size)"
        )


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
    pp: int = 1
    """Pipeline-parallel degree (``parallelism.pipeline_parallel_degree``; 1: none)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule (``parallelism.pipeline_schedule``), one of ``PP_SCHEDULES``."""
    pp_microbatch_size: int = 0
    """Samples per pipeline microbatch (0: ``local_batch_size``)."""
    pp_stages_per_rank: int = 1
    """Pipeline stages each pipeline rank holds (2 or more only for interleaved schedules)."""

    def __post_init__(self) -> None:
        if not self.pp_microbatch_size:
            object.__setattr__(self, "pp_microbatch_size", self.local_batch_size)
        degrees = {
            "world_size": self.world_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "ep": self.ep,
            "replica_groups": self.replica_groups,
            "local_batch_size": self.local_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "tp": self.tp,
            "pp": self.pp,
            "pp_stages_per_rank": self.pp_stages_per_rank,
        }
        small = {name: value for name, value in degrees.items() if value < 1}
        if small:
            raise ValueError(f"layout degrees must be ≥ 1, got {small}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            pipeline = f"pipeline {self.pp} × " if self.pp > 1 else ""
            tensor = f" × tensor {self.tp}" if self.tp > 1 else ""
            raise ValueError(
                f"parallelism: {pipeline}replicate {self.dp_replicate} × shard "
                f"{self.dp_shard}{tensor} = {product}, but the world size is "
                f"{self.world_size} (launch.nproc_per_node × launch.nnodes); set "
                "data_parallel_shard_degree: -1 or make the product equal the world size"
            )
        if self.pp > 1 or self.pp_stages_per_rank > 1:
            check_pipeline(self)
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
        pp: int = 1,
        pp_schedule: str = "1F1B",
        pp_microbatch_size: int | None = None,
        pp_stages_per_rank: int | None = None,
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
            pp: Pipeline-parallel degree.
            pp_schedule: Pipeline schedule name.
            pp_microbatch_size: Samples per pipeline microbatch; None: ``local_batch_size``.
            pp_stages_per_rank: Stages per pipeline rank; None: 2 for interleaved schedules,
                else 1.

        Raises:
            ValueError: Naming the config key at fault and how to fix it.
        """
        if tp < 1 or world_size % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the world size "
                f"{world_size} (launch.nproc_per_node × launch.nnodes); pick a divisor of "
                f"{world_size}, or change the number of ranks"
            )
        if pp < 1 or (world_size // tp) % pp:
            raise ValueError(
                f"parallelism.pipeline_parallel_degree={pp} does not divide the world size "
                f"{world_size} (launch.nproc_per_node × launch.nnodes) divided by "
                f"parallelism.tensor_parallel_degree={tp}; pick a divisor of {world_size // tp} "
                "or change launch.nproc_per_node"
            )
        dp_world = world_size // (pp * tp)
        if dp_shard == -1:
            if dp_replicate < 1 or dp_world % dp_replicate:
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree={dp_replicate} does not divide "
                    f"the data-parallel ranks {dp_world} (world size {world_size} / pipeline "
                    f"degree {pp} / tensor-parallel degree {tp}); pick a divisor of {dp_world}"
                )
            dp_shard = dp_world // dp_replicate
        accum = 1
        if global_batch_size is not None:
            data_ranks = dp_world * replica_groups
            per_micro_batch = local_batch_size * data_ranks
            if per_micro_batch < 1 or global_batch_size % per_micro_batch:
                raise ValueError(
                    f"training.global_batch_size={global_batch_size} must be a multiple of "
                    f"training.local_batch_size={local_batch_size} × data ranks {data_ranks} "
                    f"(data-parallel ranks {dp_world} × replica groups {replica_groups})"
                )
            accum = global_batch_size // per_micro_batch
        if pp_stages_per_rank is None:
            pp_stages_per_rank = 2 if pp_schedule in INTERLEAVED_SCHEDULES else 1
        return cls(
            world_size=world_size,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=ep,
            replica_groups=replica_groups,
            local_batch_size=local_batch_size,
            grad_accum_steps=accum,
            tp=tp,
            pp=pp,
            pp_schedule=pp_schedule,
            pp_microbatch_size=pp_microbatch_size or local_batch_size,
            pp_stages_per_rank=pp_stages_per_rank,
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
            pp=parallelism.pipeline_parallel_degree,
            pp_schedule=parallelism.pipeline_schedule,
            pp_microbatch_size=parallelism.pipeline_microbatch_size,
            pp_stages_per_rank=parallelism.pipeline_stages_per_rank,
        )

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all (``pp × pp_stages_per_rank``)."""
        return self.pp * self.pp_stages_per_rank

    @property
    def n_microbatches(self) -> int:
        """Pipeline microbatches per optimizer step (each rank's samples of the step)."""
        return self.local_batch_size * self.grad_accum_steps // self.pp_microbatch_size

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
