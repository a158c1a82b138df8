"""The typed job config: one pydantic section per concern, every field documented.

The same model is built from Kedro parameters (``conf/<env>/parameters_*.yml``) and from
a TOML/YAML/JSON file plus dotted command-line overrides (the torchrun worker). Unknown
keys are rejected everywhere (``extra="forbid"``); model train specs may add fields to a
section through extensions (see ``titan_kedro.config.extensions``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """Base of every config section: strict about unknown keys, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SectionT = TypeVar("SectionT", bound=BaseModel)


def section_from_params(model: type[SectionT], params: Mapping[str, Any] | None) -> SectionT:
    """One section from its Kedro parameters, keeping only the base section's own fields.

    Fields that train-spec extensions add were validated already by the project hook.
    """
    known = {k: v for k, v in (params or {}).items() if k in model.model_fields}
    return model.model_validate(known)


class JobSection(Section):
    name: str = "titan-kedro"
    """Human-readable run name, used as the MLflow run name and in log lines."""
    seed: int = 42
    """Seed for model init, data order and sampling; the same seed gives the same losses."""
    dump_folder: str = "data/07_model_output/job"
    """Where the resolved job config and worker summaries are written."""
    run_id: str | None = None
    """This run's identity (the MLflow run id, or a generated one); set by the training node."""


class DataSection(Section):
    source: Literal["local", "hub"] = "local"
    """``local``: C4 JSON-lines shards under ``raw_dir``; ``hub``: stream ``hub_dataset``."""
    raw_dir: str = "data/01_raw/c4"
    """Folder of ``*.json`` / ``*.json.gz`` C4 shards; in the Kedro project both this and the
    catalog's ``c4_raw`` come from the ``c4_raw_dir`` global (``conf/<env>/globals.yml``)."""
    hub_dataset: str = "allenai/c4"
    """Hugging Face dataset id streamed when ``source`` is ``hub``."""
    hub_config: str = "en"
    """Dataset config name on the hub."""
    hub_split: str = "train"
    """Split streamed from the hub."""
    hub_max_documents: int = Field(10_000, gt=0)
    """How many documents to take from the hub stream."""
    token_dir: str = "data/05_model_input/tokens"
    """Where packed ``uint32`` token files and ``metadata.json`` live (must match the catalog's ``token_files``)."""
    intermediate_dir: str = "data/02_intermediate/c4_tokens"
    """Per-shard token files and their ``manifest.json``; re-runs only process shards not recorded there."""
    validation_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of documents held out for validation, chosen by a stable hash of the text."""
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    """Fail the run if more than this share of records is skipped as bad input."""
    min_chars: int = Field(1, ge=1)
    """Documents shorter than this (after stripping) are skipped as ``empty``."""
    num_workers: int = Field(0, ge=0)
    """Tokenizer lanes: this process plus ``num_workers - 1`` helper processes; 0 = one per core."""
    batch_size: int = Field(512, gt=0)
    """Documents per tokenizer batch."""
    max_documents: int | None = Field(None, gt=0)
    """Stop after this many documents in total (None: the whole corpus)."""


class TokenizerSection(Section):
    name_or_path: str = "deepseek-ai/DeepSeek-V2-Lite"
    """A local folder, a hub id (via the HF cache), else the offline DeepSeek-V2 files."""


class ModelSection(Section):
    name: str = "deepseek_v2"
    """Registered train spec name (``deepseek_v2``, ``llama3`` or a custom one)."""
    flavor: str = "debugmodel"
    """Named model size inside the spec (``debugmodel``, ``v2-lite``, ``v2``, ``8B`` …)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Model-argument overrides applied on top of the flavor (``{n_layers: 2}``)."""
    custom_model_path: str | None = None
    """A ``.py`` file imported before resolution; it calls ``register_train_spec``. Runs user code.
    A relative path is taken from the working directory (the project root under ``kedro run``)."""
    custom_import: str | None = None
    """A dotted module imported before resolution; it calls ``register_train_spec``. Runs user code."""

    @field_validator("name", "flavor")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("custom_model_path")
    @classmethod
    def _python_file(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(".py"):
            raise ValueError(
                "must be the path of a .py file; use model.custom_import for a dotted module name"
            )
        return value

    @field_validator("custom_import")
    @classmethod
    def _dotted_name(cls, value: str | None) -> str | None:
        if value is not None and not all(part.isidentifier() for part in value.split(".")):
            raise ValueError(
                "must be a dotted module name such as 'my_models.tiny_gpt'; "
                "use model.custom_model_path for a .py file"
            )
        return value


class TrainingSection(Section):
    steps: int = Field(200, gt=0)
    """Optimizer steps to train for."""
    seq_len: int = Field(256, gt=0)
    """Tokens per sample (windows of ``seq_len + 1`` give inputs and shifted labels)."""
    local_batch_size: int = Field(4, gt=0)
    """Samples per device per micro-batch."""
    global_batch_size: int | None = Field(None, gt=0)
    """Samples per optimizer step over all data-parallel ranks; None = local × dp (no accumulation)."""
    max_norm: float = Field(1.0, ge=0.0)
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA + NCCL when GPUs exist, else CPU + gloo."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype on GPU (CPU trains in float32): FSDP's gathered parameters, or the
    autocast dtype on one rank, where the model is not sharded."""
    mixed_precision_reduce: Literal["bfloat16", "float32"] = "float32"
    """Gradient reduce-scatter dtype on GPU."""
    mixed_precision_cpu: bool = False
    """Also compute in ``mixed_precision_param`` on CPU (bf16 matmuls run ~3.5× faster than
    fp32 on CPUs with AVX512-BF16/AMX; losses then differ from fp32 at the 1e-2 level)."""
    fused_loss: bool = True
    """With the default cross-entropy, apply the output projection inside the loss in token
    chunks, never materialising the full ``tokens × vocab`` logits (same result, less memory)."""
    activation_checkpoint: Literal["none", "selective", "full", "auto"] = "none"
    """Recompute activations in backward: none, every other block (selective), every block
    (full), or the blocks the plan chooses so the step fits ``plan.device_memory_gib`` with
    the least recompute (auto; the training pipeline fills ``activation_checkpoint_blocks``)."""
    activation_checkpoint_blocks: list[str] | None = None
    """With ``activation_checkpoint: auto``, the ``model.layers`` keys to recompute; None lets
    the plan choose (the training pipeline writes its choice here for the workers)."""
    compile: bool = False
    """``torch.compile`` each transformer block and the fused loss's per-chunk softmax."""
    document_masking: bool = True
    """Attend only within each document of a packed window (documents start at the token
    metadata's ``bos_id``) and restart RoPE positions there."""
    deterministic: bool = False
    """Use deterministic algorithms (slower on GPU)."""
    num_threads: int = Field(0, ge=0)
    """CPU threads per worker; 0 = cores / local processes."""
    cpu_keep_freed_memory: bool = True
    """CPU workers: serve every tensor from glibc's heap and never trim it, so the next step
    reuses the memory without page faults (``train.device.keep_freed_memory_mapped``);
    the resident set then stays at its peak, which heap fragmentation makes larger than
    the peak of live tensors. False leaves glibc's defaults (or its ``MALLOC_*``
    environment) in place."""


class OptimizerSection(Section):
    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = Field(8e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay."""
    no_decay_norm_bias_embed: bool = True
    """Exempt norms, biases and embeddings from weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: ``fused`` (one pass per tensor, CPU and CUDA), ``foreach`` or ``for-loop``."""


class LRSchedulerSection(Section):
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup from ~0 to ``optimizer.lr``."""
    decay_ratio: float | None = Field(None, ge=0.0, le=1.0)
    """Share of steps spent decaying at the end; None = decay over all steps after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "cosine"
    """Shape of the decay phase."""
    min_lr: float = Field(0.0, ge=0.0)
    """Learning rate reached at the last step."""


class ParallelismSection(Section):
    data_parallel_replicate_degree: int = Field(1, ge=1)
    """HSDP replicas (pure data parallel, gradients all-reduced)."""
    data_parallel_shard_degree: int = Field(-1, ge=-1)
    """FSDP2 shard degree; -1 takes whatever the world size leaves."""


class FaultToleranceSection(Section):
    enable: bool = False
    """Train as ``replica_groups`` independent torchrun groups that average gradients through
    TorchFT every step, keep training when a group dies and heal a restarted group from a
    live peer (``titan_kedro.ft``)."""
    replica_groups: int = Field(1, ge=1)
    """Number of replica groups G (at least 2 with ``enable``); each runs ``launch.nproc_per_node``
    ranks that shard the model among themselves."""
    min_replicas: int = Field(1, ge=1)
    """Fewest live groups a step may commit with (at most ``replica_groups``)."""
    lighthouse_address: str | None = None
    """``http://host:port`` of a running TorchFT lighthouse; None: the launcher starts one on
    127.0.0.1 for the run and stops it afterwards."""
    quorum_timeout_s: float = Field(60.0, gt=0)
    """How long a group waits for the lighthouse to form a step's quorum."""
    join_timeout_s: float = Field(60.0, gt=0)
    """How long the launcher's startup barrier waits for every group before step 1, and how
    long the lighthouse waits for heartbeating stragglers before a new quorum."""
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    """A group silent this long is dropped from the next quorum (the launcher's lighthouse)."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Timeout of the cross-group collectives, the commit vote and the healing transfer."""
    max_group_restarts: int = Field(3, ge=0)
    """How often a dead group is restarted (per group) before the job fails: by the launcher
    (``launch.scheduler: local``) or by the group's own torchrun (``local_cwd``)."""


LOCAL_SCHEDULER = "local"
"""``launch.scheduler`` value for torchrun on this machine, without TorchX."""
LOCAL_CWD_SCHEDULER = "local_cwd"
"""TorchX's scheduler for several torchrun agents on this machine (tests and demos)."""
FT_SCHEDULERS = (LOCAL_SCHEDULER, LOCAL_CWD_SCHEDULER)
"""Schedulers that run fault-tolerant replica groups (on this machine)."""


@functools.cache
def scheduler_names() -> tuple[str, ...]:
    """Valid ``launch.scheduler`` values: ``local`` and every scheduler TorchX offers."""
    from torchx.schedulers import get_scheduler_factories

    return (LOCAL_SCHEDULER, *get_scheduler_factories())


class LaunchResources(Section):
    gpus: int = Field(0, ge=0)
    """GPUs requested per node from a TorchX scheduler (one per worker on CUDA: ``nproc_per_node``)."""
    cpus: int = Field(2, ge=1)
    """CPU cores requested per node from a TorchX scheduler."""
    memory_mb: int = Field(1024, ge=1)
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
    nproc_per_node: int = Field(1, ge=1)
    """Worker processes per node (one per GPU on CUDA)."""
    nnodes: int = Field(1, ge=1)
    """Number of nodes (more than one needs a TorchX scheduler)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous. None: standalone (``local``), the rank-0 node's
    port 29500 (TorchX schedulers) or a free port here (``local_cwd``)."""
    rdzv_id: str = "titan-kedro"
    """Rendezvous id of a hand-started torchrun (TorchX jobs use their app id)."""
    max_restarts: int = Field(0, ge=0)
    """torchrun restarts the worker group this often; training resumes from the latest checkpoint."""
    log_dir: str = "data/07_model_output/logs"
    """torchrun's per-worker log folder (and the replicas' logs under ``local_cwd``)."""
    timeout_s: int | None = Field(None, gt=0)
    """Stop the whole launch (cancel the TorchX job) after this many seconds (None: no limit)."""

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


class CheckpointSection(Section):
    enable: bool = True
    """Write distributed checkpoints."""
    folder: str = "data/06_models/checkpoints"
    """Checkpoint root; each run writes ``<run id>/step-<n>`` (the node points the workers
    at their run's folder)."""
    interval: int = Field(50, gt=0)
    """Save every this many steps (and always at the end)."""
    keep_latest_k: int = Field(2, ge=1)
    """Keep only the newest k complete checkpoints."""
    resume: str = "never"
    """``never``: a new run; ``latest``: continue the most recently saved run; a run id; or a
    checkpoint path. Continuing reopens that run's MLflow run."""
    initial_load_hf: str | None = None
    """Hugging Face folder (safetensors + ``config.json``) whose weights start a new run
    (continued pretraining); ignored when the run continues from its own checkpoint."""
    lock_timeout_s: int = Field(900, gt=0)
    """A run folder's lock (``writer.lock``, held by rank 0 while it trains) whose holder runs
    on another host counts as stale once its heartbeat is older than this (same host: once
    the holder's process is gone); a stale lock is taken over with a warning."""
    break_lock: bool = False
    """Take the run folder's lock even from a holder that looks alive (another host's job
    you know is gone); two live writers in one folder would mix their checkpoints."""


class MetricsSection(Section):
    log_freq: int = Field(1, gt=0)
    """Log step metrics every this many steps (rank 0 only)."""
    enable_mlflow: bool = True
    """Send metrics to the MLflow run given by ``MLFLOW_RUN_ID``."""
    peak_tflops: float | None = Field(None, gt=0)
    """Override the device peak used for MFU (None: table for GPUs, measured on CPU)."""
    system_metrics_interval_s: float = Field(10.0, ge=0)
    """Seconds between MLflow system-metric samples (CPU, memory, disk, network, GPU) of each
    node, logged as ``system/...`` into the run; 0 disables them."""


class ValidationSection(Section):
    freq: int = Field(0, ge=0)
    """Evaluate held-out loss every this many steps; 0 disables it during training."""
    steps: int = Field(4, gt=0)
    """Batches per validation pass."""


class EvaluationSection(Section):
    batches: int = Field(8, gt=0)
    """Validation batches for the final checkpoint's ``eval_loss`` (capped at the windows)."""
    num_prompts: int = Field(3, gt=0)
    """Prompts taken from validation documents for sample generations."""
    prompt_tokens: int = Field(16, gt=0)
    """Tokens of each prompt."""
    max_new_tokens: int = Field(32, gt=0)
    """Tokens generated per prompt."""
    top_k: int = Field(20, gt=0)
    """Top-k for sampled generations (greedy is always included)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""


class ExportSection(Section):
    folder: str = "data/06_models/hf"
    """Hugging Face export folder (replaced as a whole by each export)."""
    verify: bool = True
    """Load the export with transformers and compare its logits with ours on validation tokens."""
    verify_tokens: int = Field(64, gt=0)
    """Validation tokens fed to both models for that comparison."""
    tolerance: float = Field(1e-4, gt=0)
    """Largest absolute logit difference (float32) that counts as a faithful export."""
    max_shard_gib: float = Field(5.0, gt=0)
    """Weights larger than this are split into ``model-0000i-of-0000n.safetensors`` shards."""
    registered_model_name: str | None = None
    """MLflow registry name the export is registered under (None: ``job.name``)."""
    alias: str = "candidate"
    """Alias set on the new registered version (``models:/<name>@<alias>``)."""


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
        world = self.launch.world_size
        rep = self.parallelism.data_parallel_replicate_degree
        shard = self.parallelism.data_parallel_shard_degree
        if shard == -1:
            if world % rep:
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree={rep} does not divide the world "
                    f"size {world} (launch.nproc_per_node × launch.nnodes); pick a divisor of {world}"
                )
        elif rep * shard != world:
            raise ValueError(
                f"parallelism: replicate {rep} × shard {shard} = {rep * shard}, but the world size "
                f"is {world} (launch.nproc_per_node={self.launch.nproc_per_node} × "
                f"launch.nnodes={self.launch.nnodes}); set data_parallel_shard_degree: -1 "
                "or make the product equal the world size"
            )
        self._check_fault_tolerance()
        dp = self.dp_degree
        gbs = self.training.global_batch_size
        if gbs is not None and gbs % (self.training.local_batch_size * dp):
            raise ValueError(
                f"training.global_batch_size={gbs} must be a multiple of training.local_batch_size="
                f"{self.training.local_batch_size} × data-parallel degree {dp}"
            )
        if self.model.custom_model_path and self.model.custom_import:
            raise ValueError("set only one of model.custom_model_path and model.custom_import")
        return self

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
        if self.launch.nnodes > 1 or self.launch.scheduler not in FT_SCHEDULERS:
            raise ValueError(
                "fault_tolerance launches its replica groups on this machine only "
                f"(launch.scheduler={self.launch.scheduler!r}, launch.nnodes={self.launch.nnodes}): "
                "the lighthouses it starts listen on 127.0.0.1, and TorchX's remote schedulers "
                "restart whole jobs, not one replica; use launch.scheduler: local or local_cwd "
                "and launch.nnodes: 1 (one node per group)"
            )

    @property
    def replica_groups(self) -> int:
        """Fault-tolerant replica groups (1 without ``fault_tolerance.enable``)."""
        ft = self.fault_tolerance
        return ft.replica_groups if ft.enable else 1

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree: every rank of every replica group reads different data."""
        return self.launch.world_size * self.replica_groups

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        gbs = self.training.global_batch_size
        if gbs is None:
            return 1
        return gbs // (self.training.local_batch_size * self.dp_degree)

    @property
    def global_batch_size(self) -> int:
        return self.training.local_batch_size * self.dp_degree * self.grad_accum_steps
