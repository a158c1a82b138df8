"""Run identity: every ``kedro run`` is a new run; continuing one is explicit.

A run's id is its MLflow run id (a generated hex id of the same shape without MLflow).
Its checkpoints live in ``checkpoint.folder/<run id>/step-<n>``. ``checkpoint.resume``
picks what to continue (``never``, ``latest``, a run id or a checkpoint path), resolved
once by ``runs.resume.resolve_resume`` (under ``kedro run``, by the hook that
reopens the MLflow run, which hands the node the concrete path); continuing keeps the
checkpoint's run id, so metrics go on in the same MLflow run and checkpoints in the same
folder.

A checkpoint's ``metadata.json`` (``runs.checkpoint_metadata.CheckpointMetadata``) holds the
resolved job config its workers trained with. Continuing compares it with the current
config (``maths_differences``): every setting is a maths setting, refused when changed,
except those ``ALLOWED_CHANGES`` names (the schedule, where and how the job runs, what it
logs); the effective global batch and the token fingerprints are compared too. Allowed
changes are reported (``allowed_changes``). A checkpoint of an older version, saved
without its config, is compared on the keys it recorded (``math``), with a warning.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_kedro.data.token_store import token_fingerprints
from titan_kedro.runs.checkpoint_metadata import (
    RUN_ID_SHAPE,
    CheckpointMetadata,
    CheckpointRunIdError,
)
from titan_kedro.runs.resume import resolve_resume
from titan_kedro.storage import StoragePath, as_path

logger = logging.getLogger(__name__)

ALLOWED_CHANGES: tuple[str, ...] = (
    # Who and where: names and output folders, the run id the node sets.
    "job.name",
    "job.dump_folder",
    "job.run_id",
    # Where the data lives and how fast it is tokenized (its content is fingerprinted).
    "data.token_dir",
    "data.raw_dir",
    "data.intermediate_dir",
    "data.num_workers",
    "data.batch_size",
    "tokenizer.name_or_path",
    "model.custom_model_path",
    # The schedule: how long, how fast the learning rate goes (reported).
    "training.steps",
    "optimizer.lr",
    "lr_scheduler",
    # How a step runs, not what it computes (the global batch is compared as a number).
    "training.local_batch_size",
    "training.global_batch_size",
    "training.device",
    "training.num_threads",
    "training.compile",
    "training.fused_loss",
    "training.deterministic",
    "training.activation_checkpoint",
    "training.activation_checkpoint_blocks",
    "optimizer.implementation",
    # Layout and launching (DCP reshards onto another world size), fault tolerance.
    "parallelism",
    "fault_tolerance",
    "launch",
    "checkpoint",
    # What is logged, validated, evaluated, exported and planned.
    "metrics",
    "validation",
    "evaluation",
    "export",
    "plan",
)
"""The job-config settings (``section.field``, or a whole ``section``) a continued run may
change. Every other setting, any added later included, changes the maths and must match
the checkpoint's."""

DERIVED_MATHS = ("global_batch_size", "tokenizer_fingerprint", "data_fingerprint")
"""``math`` keys compared besides the config: the effective global batch (its fields may
change with the world size) and the token files' identity (their folder may move)."""

RUN_SETS = ("job.run_id", "checkpoint.folder", "checkpoint.resume")
"""Allowed settings the run itself sets when continuing (not reported as changes)."""


class ResumeMismatchError(ValueError):
    """Continuing a checkpoint with settings that change the maths (seed, model, data, …)."""


@dataclass(frozen=True)
class RunPlan:
    """Where a run writes and what it continues."""

    run_id: str
    """The run's identity: the MLflow run id (or a generated one)."""
    checkpoint_dir: StoragePath
    """``checkpoint.folder/<run_id>``: this run's checkpoints."""
    resume_from: StoragePath | None
    """The checkpoint continued, or None for a new run."""
    resume_metadata: CheckpointMetadata | None = None
    """That checkpoint's parsed ``metadata.json`` (read once, by ``resolve_resume``)."""


def new_run_id() -> str:
    """A fresh run id for a run without MLflow (32 hex digits, like MLflow's:
    ``runs.checkpoint_metadata.RUN_ID_SHAPE``)."""
    return uuid.uuid4().hex


def plan_run(root: str | Path, resume: str, active_run_id: str | None) -> RunPlan:
    """Resolve ``checkpoint.resume`` against the checkpoint root into a ``RunPlan``.

    A checkpoint that records no run id (a worker started by hand) is continued as a new
    run: the active MLflow run's id, or a generated one.

    Args:
        root: ``checkpoint.folder``.
        resume: ``checkpoint.resume`` (a concrete path when the hook resolved it).
        active_run_id: The active MLflow run (None without MLflow).

    Raises:
        FileNotFoundError: ``resume`` names no checkpoint.
        CheckpointRunIdError: The checkpoint's recorded run id is unsafe to use.
    """
    point = resolve_resume(root, resume)
    run_id = (point.run_id if point else None) or active_run_id or new_run_id()
    if point is None:
        return RunPlan(run_id, as_path(root, "checkpoint.folder") / run_id, None)
    return RunPlan(
        run_id, as_path(root, "checkpoint.folder") / run_id, point.checkpoint, point.metadata
    )


def math_settings(cfg: Any, token_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The derived settings a continued run must share with its checkpoint (JSON-safe).

    Saved as ``math``: the effective global batch and the token fingerprints (compared
    besides the config), and the model and sequence keys older checkpoints were compared on.

    Args:
        cfg: The job config.
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unknown).
    """
    settings: dict[str, Any] = {
        "model.name": cfg.model.name,
        "model.flavor": cfg.model.flavor,
        "model.overrides": _json(cfg.model.overrides),
        "training.seq_len": cfg.training.seq_len,
        "global_batch_size": cfg.layout.global_batch_size,
    }
    settings.update(token_fingerprints(token_metadata or {}))
    return settings


def schedule_settings(cfg: Any) -> dict[str, Any]:
    """Settings a continued run may change (reported, not refused)."""
    return {
        "training.steps": cfg.training.steps,
        "optimizer.lr": cfg.optimizer.lr,
        "lr_scheduler.min_lr": cfg.lr_scheduler.min_lr,
        "lr_scheduler.warmup_steps": cfg.lr_scheduler.warmup_steps,
    }


def config_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """``section.field → value`` of a job config dumped as JSON (a field's value whole)."""
    return {
        f"{section}.{name}": value
        for section, fields in config.items()
        if isinstance(fields, Mapping)
        for name, value in fields.items()
    }


def is_allowed_change(setting: str) -> bool:
    """Whether ``setting`` (``section.field``) is one a continued run may change."""
    return any(setting == a or setting.startswith(f"{a}.") for a in ALLOWED_CHANGES)


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key: (saved, current)`` for keys both sides know and that differ."""
    return {
        key: (saved[key], current[key])
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    }


_ABSENT = "<not set>"


def maths_differences(
    metadata: CheckpointMetadata,
    cfg: Any,
    token_metadata: Mapping[str, Any] | None = None,
    *,
    where: str | Path = "the checkpoint",
) -> dict[str, tuple[Any, Any]]:
    """``setting: (checkpoint's, current)`` for every maths setting that differs.

    With the checkpoint's saved job config: every setting outside ``ALLOWED_CHANGES``,
    plus ``DERIVED_MATHS`` (fingerprints only when ``token_metadata`` is given). Without
    one (an older checkpoint): the ``math`` keys it recorded, with a warning.

    Args:
        metadata: The checkpoint's parsed ``metadata.json``.
        cfg: This run's job config.
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unchecked).
        where: The checkpoint, for log lines.
    """
    current_math = math_settings(cfg, token_metadata)
    if metadata.config is None:
        logger.warning(
            "%s was saved without its job config (by an older titan_kedro): only %s are "
            "compared with this run; other maths settings (job.seed, the optimizer, …) are "
            "not checked",
            where,
            ", ".join(sorted(metadata.math)) or "no settings",
        )
        return differences(metadata.math, current_math)
    saved = config_settings(metadata.config)
    current = config_settings(_json(cfg.model_dump(mode="json")))
    diff = {
        key: (saved[key], current.get(key, _ABSENT))
        for key in sorted(saved)
        if not is_allowed_change(key) and saved[key] != current.get(key, _ABSENT)
    }
    unseen = sorted(k for k in current.keys() - saved.keys() if not is_allowed_change(k))
    if unseen:
        logger.warning(
            "%s: its job config has no %s (saved by an older titan_kedro?); not compared",
            where,
            ", ".join(unseen),
        )
    derived = {k: v for k, v in metadata.math.items() if k in DERIVED_MATHS}
    diff.update(differences(derived, current_math))
    return diff


def check_resume_compatible(
    checkpoint: str | Path,
    cfg: Any,
    token_metadata: Mapping[str, Any] | None = None,
    metadata: CheckpointMetadata | None = None,
) -> None:
    """Refuse to continue ``checkpoint`` when a maths setting differs (the one check: the
    continue hook runs it before the MLflow run is reopened, the training node again with
    the token fingerprints).

    Args:
        checkpoint: The checkpoint to continue.
        cfg: This run's job config.
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unchecked).
        metadata: The checkpoint's parsed ``metadata.json`` when already read (``ResumePoint``).

    Raises:
        ResumeMismatchError: Lists every differing setting with both values and the fix.
    """
    if metadata is None:
        metadata = CheckpointMetadata.read(checkpoint)
    diff = maths_differences(metadata, cfg, token_metadata, where=checkpoint)
    if not diff:
        return
    listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
    restore = [
        f"{k}={_param_value(a)}"
        for k, (a, _) in diff.items()
        if k not in DERIVED_MATHS and "." in k and _param_value(a) is not None
    ]
    fix = f" (--params {','.join(restore)})" if restore else ""
    raise ResumeMismatchError(
        f"cannot continue {checkpoint}: settings that change the maths differ ({listed}). "
        f"Set them back to the checkpoint's values{fix}, or start a new run with "
        "checkpoint.resume=never. What a continued run may change: "
        "titan_kedro.runs.identity.ALLOWED_CHANGES"
    )


def allowed_changes(
    checkpoint: str | Path, cfg: Any, metadata: CheckpointMetadata | None = None
) -> dict[str, tuple[Any, Any]]:
    """The allowed changes (steps, learning rate, layout, …) between ``checkpoint`` and ``cfg``.

    From the saved job config (the settings the run sets itself left out), else from the
    ``schedule`` an older checkpoint recorded.
    """
    if metadata is None:
        metadata = CheckpointMetadata.read(checkpoint)
    if metadata.config is None:
        return differences(metadata.schedule, schedule_settings(cfg))
    saved = config_settings(metadata.config)
    current = config_settings(_json(cfg.model_dump(mode="json")))
    return {
        key: change
        for key, change in differences(saved, current).items()
        if is_allowed_change(key) and key not in RUN_SETS
    }


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``key: old -> new; …`` for an MLflow tag or a log line."""
    return "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())


def checkpoint_metadata(cfg: Any, token_metadata: Mapping[str, Any] | None) -> CheckpointMetadata:
    """What every checkpoint of this run records (the trainer sets ``loss``, the manager
    ``step``, ``world_size`` and ``saved_at``).

    Args:
        cfg: The workers' job config (saved whole as ``config``).
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unknown).

    Raises:
        CheckpointRunIdError: ``job.run_id`` is not a run id (32 lowercase hex digits), so
            the run could not be continued from its checkpoints.
    """
    run_id = cfg.job.run_id
    if run_id is not None and not RUN_ID_SHAPE.match(run_id):
        raise CheckpointRunIdError(
            f"job.run_id={run_id!r} is not a run id (32 lowercase hex digits, like an MLflow "
            "run id): its checkpoints could not be continued. Leave job.run_id unset (the "
            "training node sets it) or use titan_kedro.runs.identity.new_run_id()"
        )
    return CheckpointMetadata(
        step=0,
        run_id=run_id,
        config=_json(cfg.model_dump(mode="json")),
        math=math_settings(cfg, token_metadata),
        schedule=schedule_settings(cfg),
    )


def _json(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value, sort_keys=True))


def _param_value(value: Any) -> str | None:
    """``value`` as a ``--params`` override, or None when it has no short form."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


def apply_run_plan(cfg: Any, plan: RunPlan) -> Any:
    """A copy of ``cfg`` whose workers write to ``plan``'s folder and resume its checkpoint."""
    checkpoint = cfg.checkpoint.model_copy(
        update={
            "folder": str(plan.checkpoint_dir),
            "resume": str(plan.resume_from) if plan.resume_from else "never",
        }
    )
    job = cfg.job.model_copy(update={"run_id": plan.run_id})
    return cfg.model_copy(update={"checkpoint": checkpoint, "job": job})


def prepare_run(cfg: Any, token_metadata: Mapping[str, Any] | None, active_run: str | None) -> Any:
    """Plan the run, refuse an incompatible continuation, and return the workers' config.

    Raises:
        FileNotFoundError: ``checkpoint.resume`` names no checkpoint.
        ResumeMismatchError: A maths-changing setting differs from the checkpoint's.
    """
    plan = plan_run(cfg.checkpoint.folder, cfg.checkpoint.resume, active_run)
    if plan.resume_from is None:
        logger.info("new run %s: checkpoints in %s", plan.run_id, plan.checkpoint_dir)
    else:
        meta = plan.resume_metadata
        check_resume_compatible(plan.resume_from, cfg, token_metadata, meta)
        changes = allowed_changes(plan.resume_from, cfg, meta)
        logger.info(
            "continuing run %s from %s%s",
            plan.run_id,
            plan.resume_from,
            f" (changed: {describe_changes(changes)})" if changes else "",
        )
        if active_run is not None and active_run != plan.run_id:
            logger.warning(
                "continuing run %s, but metrics go to the active MLflow run %s (kedro-mlflow "
                "did not reopen it: is tracking disabled, or was the run deleted?)",
                plan.run_id,
                active_run,
            )
    return apply_run_plan(cfg, plan)
