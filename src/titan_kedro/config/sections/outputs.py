"""Sections of what a run keeps and reports: checkpoint, metrics, validation, evaluation, export."""

from __future__ import annotations

from pydantic import Field, StrictInt

from titan_kedro.config.sections.base import Section


class CheckpointSection(Section):
    enable: bool = True
    """Write distributed checkpoints."""
    folder: str = "data/06_models/checkpoints"
    """Checkpoint root; each run writes ``<run id>/step-<n>`` (the node points the workers
    at their run's folder)."""
    interval: StrictInt = Field(50, gt=0)
    """Save every this many steps (and always at the end)."""
    keep_latest_k: StrictInt = Field(2, ge=1)
    """Keep only the newest k complete checkpoints."""
    resume: str = "never"
    """``never``: a new run; ``latest``: continue the most recently saved run; a run id; or a
    checkpoint path. Continuing reopens that run's MLflow run."""
    initial_load_hf: str | None = None
    """Hugging Face folder (safetensors + ``config.json``) whose weights start a new run
    (continued pretraining); ignored when the run continues from its own checkpoint."""
    lock_timeout_s: StrictInt = Field(900, gt=0)
    """A run folder's lock (``writer.lock``, held by rank 0 while it trains) whose holder runs
    on another host counts as stale once its heartbeat is older than this (same host: once
    the holder's process is gone); a stale lock is taken over with a warning."""
    break_lock: bool = False
    """Take the run folder's lock even from a holder that looks alive (another host's job
    you know is gone); two live writers in one folder would mix their checkpoints."""


class MetricsSection(Section):
    log_freq: StrictInt = Field(1, gt=0)
    """Log step metrics every this many steps (rank 0 only)."""
    enable_mlflow: bool = True
    """Send metrics to the MLflow run given by ``MLFLOW_RUN_ID``."""
    peak_tflops: float | None = Field(None, gt=0)
    """Override the device peak used for MFU (None: table for GPUs, measured on CPU)."""
    system_metrics_interval_s: float = Field(10.0, ge=0)
    """Seconds between MLflow system-metric samples (CPU, memory, disk, network, GPU) of each
    node, logged as ``system/...`` into the run; 0 disables them."""


class ValidationSection(Section):
    freq: StrictInt = Field(0, ge=0)
    """Evaluate held-out loss every this many steps; 0 disables it during training."""
    steps: StrictInt = Field(4, gt=0)
    """Batches per validation pass."""


class EvaluationSection(Section):
    batches: StrictInt = Field(8, gt=0)
    """Validation batches for the final checkpoint's ``eval_loss`` (capped at the windows)."""
    num_prompts: StrictInt = Field(3, gt=0)
    """Prompts taken from validation documents for sample generations."""
    prompt_tokens: StrictInt = Field(16, gt=0)
    """Tokens of each prompt."""
    max_new_tokens: StrictInt = Field(32, gt=0)
    """Tokens generated per prompt."""
    top_k: StrictInt = Field(20, gt=0)
    """Top-k for sampled generations (greedy is always included)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""


class ExportSection(Section):
    folder: str = "data/06_models/hf"
    """Hugging Face export folder, replaced as a whole by each export; a folder that is not a
    previous export (no ``.titan_kedro_export.json``, or other files in it) is refused."""
    verify: bool = True
    """Load the export with transformers and compare its logits with ours on validation tokens."""
    verify_tokens: StrictInt = Field(64, gt=0)
    """Validation tokens fed to both models for that comparison."""
    tolerance: float = Field(1e-4, gt=0)
    """Largest absolute logit difference (float32) that counts as a faithful export."""
    max_shard_gib: float = Field(5.0, gt=0)
    """Weights larger than this are split into ``model-0000i-of-0000n.safetensors`` shards."""
    registered_model_name: str | None = None
    """MLflow registry name the export is registered under (None: ``job.name``)."""
    alias: str = "candidate"
    """Alias set on the new registered version (``models:/<name>@<alias>``)."""
