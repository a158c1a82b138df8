"""Sections of the training step: training, optimizer, lr_scheduler, parallelism, fault_tolerance."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, StrictInt, field_validator

from titan_kedro.config.sections.base import Section

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
"""An Adam beta: a decay rate in [0, 1)."""


class TrainingSection(Section):
    steps: StrictInt = Field(200, gt=0)
    """Optimizer steps to train for."""
    seq_len: StrictInt = Field(256, gt=0)
    """Tokens per sample (windows of ``seq_len + 1`` give inputs and shifted labels)."""
    local_batch_size: StrictInt = Field(4, gt=0)
    """Samples per device per micro-batch."""
    global_batch_size: StrictInt | None = Field(None, gt=0)
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
    num_threads: StrictInt = Field(0, ge=0)
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
    lr: float = Field(8e-4, gt=0, allow_inf_nan=False)
    """Peak learning rate (finite, above 0)."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """Adam betas, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    """Adam epsilon."""
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False)
    """Decoupled weight decay."""
    no_decay_norm_bias_embed: bool = True
    """Exempt norms, biases and embeddings from weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: ``fused`` (one pass per tensor, CPU and CUDA), ``foreach`` or ``for-loop``."""


class LRSchedulerSection(Section):
    warmup_steps: StrictInt = Field(10, ge=0)
    """Linear warmup from ~0 to ``optimizer.lr`` (at most ``training.steps``)."""
    decay_ratio: float | None = Field(None, ge=0.0, le=1.0)
    """Share of steps spent decaying at the end; None = decay over all steps after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "cosine"
    """Shape of the decay phase."""
    min_lr: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Learning rate reached at the last step (at most ``optimizer.lr``)."""


class ParallelismSection(Section):
    layout: Literal["explicit", "auto"] = "explicit"
    """``explicit``: train with the degrees below. ``auto``: the ``model_spec`` and
    ``training`` nodes search the layouts of the launch's world (``plan.search``,
    ``titan_kedro.plan.search``), train with the best one that fits (the degrees below are
    replaced) and write the ranked table into the model card; nothing fitting fails there."""
    data_parallel_replicate_degree: StrictInt = Field(1, ge=1)
    """HSDP replicas (pure data parallel, gradients all-reduced)."""
    data_parallel_shard_degree: StrictInt = Field(-1, ge=-1)
    """FSDP2 shard degree; -1 takes whatever the world size leaves."""
    expert_parallel_degree: StrictInt = Field(1, ge=1)
    """Routed experts are sharded over this many ranks and tokens are exchanged with
    all-to-all; must divide the data-parallel shard degree and the model's routed experts
    (1: every rank holds every expert). Only for specs with ``expert_parallel`` (DeepSeek);
    a dense model trains with 1 and logs a warning."""
    tensor_parallel_degree: StrictInt = Field(1, ge=1)
    """Tensor parallelism (Megatron-style, through DTensor) with sequence parallelism: the
    attention heads, the dense and shared-expert MLPs and the vocabulary are split over this
    many ranks (the innermost mesh dimension; put them on one node), and the residual
    stream between blocks is split along the sequence. Must divide the world size, the
    model's heads and MLP widths, its vocabulary and ``training.seq_len`` (checked before
    any worker starts). Routed experts stay on expert parallelism, which borrows these
    ranks (for a MoE model ``expert_parallel_degree`` must be a multiple of this). 1: none."""
    pipeline_parallel_degree: StrictInt = Field(1, ge=1)
    """Pipeline stages' ranks: the model's blocks are split into stages held by different
    ranks (``train/pipeline``); the world is ``pipeline × replicate × shard × tensor`` (1: none)."""
    pipeline_schedule: str = "1F1B"
    """``torch.distributed.pipelining`` schedule: ``1F1B`` or ``Interleaved1F1B`` (several
    stages per rank, a smaller bubble); anything else is refused with the list."""
    pipeline_microbatch_size: StrictInt | None = Field(None, ge=1)
    """Samples per pipeline microbatch; each rank's ``local_batch_size × accumulation
    steps`` samples of a step are split into microbatches of this size (None:
    ``training.local_batch_size``, one microbatch per accumulation step)."""
    pipeline_stages_per_rank: StrictInt | None = Field(None, ge=1)
    """Stages each pipeline rank holds (None: 2 for ``Interleaved1F1B``, 1 for ``1F1B``)."""
    pipeline_layout: list[StrictInt] | None = None
    """Main blocks per stage, in stage order (e.g. ``[3, 5]``); None: split to balance the
    estimated FLOPs of each stage (``models/pipeline_split.py``)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free a block's gathered parameters after its forward (``always``: ZeRO-3, gathered
    again for backward) or keep them until its backward (``never``: ZeRO-2-like, one
    all-gather per block per step, more memory). ``default``: ``never`` under pipeline
    parallelism, where the schedule runs every microbatch of a stage with its gradients
    unsharded anyway and ``always`` would gather the stage again for each microbatch's
    backward; ``always`` otherwise (torchtitan's rule)."""


class FaultToleranceSection(Section):
    enable: bool = False
    """Train as ``replica_groups`` independent torchrun groups that average gradients through
    TorchFT every step, keep training when a group dies and heal a restarted group from a
    live peer (``titan_kedro.ft``)."""
    replica_groups: StrictInt = Field(1, ge=1)
    """Number of replica groups G (at least 2 with ``enable``); each runs ``launch.nproc_per_node``
    ranks that shard the model among themselves."""
    min_replicas: StrictInt = Field(1, ge=1)
    """Fewest live groups a step may commit with (at most ``replica_groups``)."""
    lighthouse_address: str | None = None
    """``http://host:port`` of a running TorchFT lighthouse; None: the launcher starts one on
    ``lighthouse_bind`` for the run and stops it afterwards."""
    lighthouse_bind: str = "127.0.0.1"
    """The one address the launcher's lighthouses listen on: an address of one of the submit
    host's interfaces that every group's nodes reach (on Slurm, the host's cluster-network
    address; loopback serves a one-host cluster). ``0.0.0.0`` listens on every interface,
    only when asked for (anyone who reaches the host may then join or disturb the quorum)."""

    @field_validator("lighthouse_bind")
    @classmethod
    def _one_address(cls, value: str) -> str:
        if not value or (any(c in value for c in " /:[]@") and not _is_ipv6(value)):
            raise ValueError(
                f"fault_tolerance.lighthouse_bind={value!r} is not an address: set one IP "
                "address or host name of this machine (e.g. 10.0.0.5), without a port"
            )
        return value

    @field_validator("lighthouse_address")
    @classmethod
    def _http_host_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        problem = _address_problem(value)
        if problem:
            raise ValueError(
                f"{problem}; set fault_tolerance.lighthouse_address to http://host:port (e.g. "
                "http://10.0.0.5:29510), or to null to have the launcher start one"
            )
        return value

    quorum_timeout_s: float = Field(60.0, gt=0)
    """How long a group waits for the lighthouse to form a step's quorum."""
    join_timeout_s: float = Field(60.0, gt=0)
    """How long the launcher's startup barrier waits for every group before step 1, and how
    long the lighthouse waits for heartbeating stragglers before a new quorum."""
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    """A group silent this long is dropped from the next quorum (the launcher's lighthouse)."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Timeout of the cross-group collectives, the commit vote and the healing transfer."""
    max_group_restarts: StrictInt = Field(3, ge=0)
    """How often a dead group is restarted (per group) before the job fails: by the launcher
    (``launch.scheduler: local``; ``slurm``: its job is submitted again) or by the group's own
    torchrun (``local_cwd``)."""


def _is_ipv6(value: str) -> bool:
    try:
        return ipaddress.ip_address(value).version == 6
    except ValueError:
        return False


def _address_problem(value: str) -> str | None:
    """Why ``value`` is not an ``http(s)://host:port`` address (None: it is one)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme or 'missing'!r} is not http or https"
    try:
        port = parts.port
    except ValueError:
        return "the port is not a number from 0 to 65535"
    if not parts.hostname:
        return "the host is missing"
    if port is None or port == 0:
        return "the port is missing"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return "only http://host:port is accepted (no path, query or user)"
    return None
