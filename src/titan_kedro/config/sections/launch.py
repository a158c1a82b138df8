"""Sections of where the job runs (the schedulers, ``launch``) and whether it fits (``plan``)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field, StrictInt, field_validator

from titan_kedro.config.sections.base import Section

LOCAL_SCHEDULER = "local"
"""``launch.scheduler`` value for torchrun on this machine, without TorchX."""
LOCAL_CWD_SCHEDULER = "local_cwd"
"""TorchX's scheduler for several torchrun agents on this machine (tests and demos)."""
FT_SCHEDULERS = (LOCAL_SCHEDULER, LOCAL_CWD_SCHEDULER)
"""Schedulers that run fault-tolerant replica groups (on this machine)."""
FT_JOB_PER_GROUP_SCHEDULERS = ("slurm",)
"""Schedulers that run each fault-tolerant replica group as a job of its own
(``launch/slurm_groups.py``), ``launch.nnodes`` nodes per group."""


@functools.cache
def scheduler_names() -> tuple[str, ...]:
    """Valid ``launch.scheduler`` values: ``local`` and every scheduler TorchX offers."""
    from torchx.schedulers import get_scheduler_factories

    return (LOCAL_SCHEDULER, *get_scheduler_factories())


class LaunchResources(Section):
    gpus: StrictInt = Field(0, ge=0)
    """GPUs requested per node from a TorchX scheduler (one per worker on CUDA: ``nproc_per_node``)."""
    cpus: StrictInt = Field(2, ge=1)
    """CPU cores requested per node from a TorchX scheduler."""
    memory_mb: StrictInt = Field(1024, ge=1)
    """Host memory requested per node from a TorchX scheduler, in MB (TorchX's ``memMB``)."""


class LaunchSection(Section):
    scheduler: str = LOCAL_SCHEDULER
    """``local``: torchrun on this machine; else the TorchX scheduler that runs one torchrun
    per node (``local_cwd``: several agents here; ``slurm``, ``kubernetes``, …)."""
    scheduler_args: dict[str, Any] = Field(default_factory=dict)
    """TorchX run options of the scheduler (slurm ``partition``/``time``, kubernetes ``queue``/
    ``namespace``, …), plus ``image`` and ``mounts`` (TorchX mount strings) for the job's role."""
    resources: LaunchResources = Field(default_factory=LaunchResources)
    """What each node asks the TorchX scheduler for."""
    shared_dir: str | None = None
    """A folder every node of a remote TorchX job mounts at the same path; the job config, token
    files, checkpoints, dump and log folders must lie under it."""
    dryrun: bool = False
    """Write the scheduler request and the TorchX AppDef to ``dryrun_dir`` and train nothing."""
    dryrun_dir: str = "data/07_model_output/launch"
    """Where a dry run writes ``request_<scheduler>.txt`` and ``appdef.json``."""
    nproc_per_node: StrictInt = Field(1, ge=1)
    """Worker processes per node (one per GPU on CUDA)."""
    nnodes: StrictInt = Field(1, ge=1)
    """Number of nodes (more than one needs a TorchX scheduler)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous. None: standalone (``local``), the rank-0 node's
    port 29500 (TorchX schedulers) or a free port here (``local_cwd``)."""
    rdzv_id: str | None = None
    """Rendezvous id with ``rdzv_endpoint`` (TorchX jobs use their app id). None: a random,
    unguessable id per launch."""
    max_restarts: StrictInt = Field(0, ge=0)
    """torchrun restarts the worker group this often; training resumes from the latest checkpoint."""
    log_dir: str = "data/07_model_output/logs"
    """torchrun's per-worker log folder (and the replicas' logs under ``local_cwd``)."""
    timeout_s: StrictInt | None = Field(None, gt=0)
    """Stop the whole launch (cancel the TorchX job) after this many seconds (None: no limit)."""
    auto_continue: StrictInt | None = Field(None, ge=0)
    """How often a Slurm job that the scheduler requeues (preemption, ``scontrol requeue``,
    a lost node) or ends at its time limit continues from its latest complete checkpoint in
    the same MLflow run without a person. None: 3 for remote schedulers, 0 on this machine."""
    save_before_limit_s: StrictInt | None = Field(120, ge=1)
    """Slurm: the workers get ``SIGUSR1`` this many seconds before the job's time limit
    (``sbatch --signal``) and save a checkpoint at the next step (None: no signal)."""

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        if value == LOCAL_SCHEDULER:  # the default needs no TorchX import
            return value
        names = scheduler_names()
        if value not in names:
            raise ValueError(
                f"unknown scheduler {value!r}; set launch.scheduler to one of: {', '.join(names)}"
            )
        return value

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def continues(self) -> int:
        """``auto_continue`` resolved: its value, else 3 for remote schedulers, 0 here."""
        if self.auto_continue is not None:
            return self.auto_continue
        return 0 if self.scheduler in FT_SCHEDULERS else 3


class PlanSection(Section):
    gpu: str = "H100"
    """GPU model planned for ``training.device: cuda`` when this machine has none (``H100``,
    ``H200``, ``B200``…): its memory and bf16 peak come from the tables."""
    device_memory_gib: float | None = Field(None, gt=0)
    """Memory per rank, overriding the GPU table (CUDA) or the host memory / local ranks (CPU)."""
    reserved_gib: float = Field(2.0, ge=0)
    """Memory per rank kept free for the CUDA context, allocator fragmentation and
    communication buffers (which the plan does not count)."""
    assumed_mfu: float = Field(0.2, gt=0, le=1)
    """Model-FLOPs utilisation assumed for the wall time and device-hours of ``training.steps``."""
    enforce: bool = True
    """The training pipeline refuses to launch a job whose plan does not fit."""
    search: bool = False
    """Also search the layouts of the launch's world (``titan_kedro.plan.search``) and add
    the ranked table (planned peak, fit, step time, recomputation) to the model card's
    ``layout_search`` and the log; ``parallelism.layout: auto`` searches anyway."""
