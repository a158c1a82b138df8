"""The typed job config: one pydantic section per concern, every field documented.

The same model is built from Kedro parameters (``conf/<env>/parameters_*.yml``) and from
a TOML/YAML/JSON file plus dotted command-line overrides (the torchrun worker). Unknown
keys are rejected everywhere (``extra="forbid"``); model train specs may add fields to a
section through extensions (see ``titan_kedro.config.extensions``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from titan_kedro.config.layout import Layout
from titan_kedro.config.sections.base import Section, SectionT, section_from_params
from titan_kedro.config.sections.inputs import (
    DataSection,
    JobSection,
    ModelSection,
    TokenizerSection,
)
from titan_kedro.config.sections.launch import (
    FT_JOB_PER_GROUP_SCHEDULERS,
    FT_SCHEDULERS,
    LOCAL_CWD_SCHEDULER,
    LOCAL_SCHEDULER,
    LaunchResources,
    LaunchSection,
    PlanSection,
    scheduler_names,
)
from titan_kedro.config.sections.outputs import (
    CheckpointSection,
    EvaluationSection,
    ExportSection,
    MetricsSection,
    ValidationSection,
)
from titan_kedro.config.sections.training import (
    FaultToleranceSection,
    LRSchedulerSection,
    OptimizerSection,
    ParallelismSection,
    TrainingSection,
)

__all__ = [
    "FT_JOB_PER_GROUP_SCHEDULERS",
    "FT_SCHEDULERS",
    "LOCAL_CWD_SCHEDULER",
    "LOCAL_SCHEDULER",
    "CheckpointSection",
    "DataSection",
    "EvaluationSection",
    "ExportSection",
    "FaultToleranceSection",
    "JobConfig",
    "JobSection",
    "LRSchedulerSection",
    "LaunchResources",
    "LaunchSection",
    "Layout",
    "MetricsSection",
    "ModelSection",
    "OptimizerSection",
    "ParallelismSection",
    "PlanSection",
    "Section",
    "SectionT",
    "TokenizerSection",
    "TrainingSection",
    "ValidationSection",
    "scheduler_names",
    "section_from_params",
]


class JobConfig(BaseModel):
    """The whole job. Sections may be widened by train-spec extensions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    job: JobSection = Field(default_factory=JobSection)
    data: DataSection = Field(default_factory=DataSection)
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    model: ModelSection = Field(default_factory=ModelSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = Field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    fault_tolerance: FaultToleranceSection = Field(default_factory=FaultToleranceSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    export: ExportSection = Field(default_factory=ExportSection)
    plan: PlanSection = Field(default_factory=PlanSection)

    @model_validator(mode="after")
    def _check_layout(self) -> JobConfig:
        self.layout  # noqa: B018  (derives and validates the degrees and the batch split)
        self._check_fault_tolerance()
        self._check_schedule()
        if self.model.custom_model_path and self.model.custom_import:
            raise ValueError("set only one of model.custom_model_path and model.custom_import")
        return self

    def _check_schedule(self) -> None:
        schedule, lr, steps = self.lr_scheduler, self.optimizer.lr, self.training.steps
        if schedule.min_lr > lr:
            raise ValueError(
                f"lr_scheduler.min_lr={schedule.min_lr} is above optimizer.lr={lr}, the peak it "
                "decays from; lower lr_scheduler.min_lr (0 decays to zero) or raise optimizer.lr"
            )
        # Warmup step n runs at lr * n / warmup_steps. A warmup of exactly training.steps
        # runs as written (the last step reaches optimizer.lr, no decay follows); a longer
        # one used to be squeezed into the run (a steeper ramp than configured) unnoticed.
        if schedule.warmup_steps > steps:
            raise ValueError(
                f"lr_scheduler.warmup_steps={schedule.warmup_steps} is longer than the run "
                f"(training.steps={steps}), so the configured warm-up cannot run; "
                f"set lr_scheduler.warmup_steps to at most {steps} (e.g. --params "
                f"lr_scheduler.warmup_steps={max(steps // 10, 0)}) or raise training.steps"
            )

    def _check_fault_tolerance(self) -> None:
        ft = self.fault_tolerance
        if not ft.enable:
            return
        if ft.replica_groups < 2:
            raise ValueError(
                "fault_tolerance.enable needs fault_tolerance.replica_groups >= 2: with one group "
                "there is no live peer to keep training or to heal from; set replica_groups: 2 "
                "or more, or disable fault_tolerance (launch.max_restarts restarts one group)"
            )
        if self.parallelism.data_parallel_replicate_degree > 1:
            raise ValueError(
                f"fault_tolerance.replica_groups={ft.replica_groups} and "
                f"parallelism.data_parallel_replicate_degree="
                f"{self.parallelism.data_parallel_replicate_degree} are both above 1: replica "
                "groups already replicate the model; set data_parallel_replicate_degree: 1"
            )
        if ft.min_replicas > ft.replica_groups:
            raise ValueError(
                f"fault_tolerance.min_replicas={ft.min_replicas} exceeds replica_groups="
                f"{ft.replica_groups}; no step could ever commit"
            )
        if self.launch.scheduler in FT_JOB_PER_GROUP_SCHEDULERS:
            return  # one job of launch.nnodes nodes per group (launch/slurm_groups.py)
        if self.launch.scheduler == "kubernetes" and self.launch.dryrun:
            return  # rendered only (launch/k8s_groups.py)
        if self.launch.nnodes > 1 or self.launch.scheduler not in FT_SCHEDULERS:
            raise ValueError(
                "fault_tolerance runs its replica groups on this machine, or as one Slurm job "
                f"each (launch.scheduler={self.launch.scheduler!r}, launch.nnodes="
                f"{self.launch.nnodes}): TorchX's other remote schedulers restart whole jobs, "
                "not one replica (Kubernetes: launch.dryrun renders the plan); use "
                "launch.scheduler: slurm, or local / local_cwd with "
                "launch.nnodes: 1 (one node per group)"
            )

    @property
    def layout(self) -> Layout:
        """The degrees, the batch split and the accumulation steps (``config/layout.py``)."""
        return Layout.from_config(self)

    @property
    def replica_groups(self) -> int:
        """Fault-tolerant replica groups (1 without ``fault_tolerance.enable``)."""
        return self.layout.replica_groups
