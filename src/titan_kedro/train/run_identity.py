"""Run identity: every ``kedro run`` is a new run; continuing one is explicit.

A run's id is its MLflow run id (a generated hex id of the same shape without MLflow).
Its checkpoints live in ``checkpoint.folder/<run id>/step-<n>``. ``checkpoint.resume``
picks what to continue (``never``, ``latest``, a run id or a checkpoint path), resolved
once by ``checkpoint.resume.resolve_resume`` (under ``kedro run``, by the hook that
reopens the MLflow run, which hands the node the concrete path); continuing keeps the
checkpoint's run id, so metrics go on in the same MLflow run and checkpoints in the same
folder.

A checkpoint's ``metadata.json`` records the settings that change the maths
(``math_settings``); continuing with any of them changed is refused, listing the keys.
Schedule settings (``training.steps``, learning rate) may change and are reported.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_kedro.data.token_store import token_fingerprints
from titan_kedro.train.checkpoint.layout import read_checkpoint_metadata
from titan_kedro.train.checkpoint.resume import RUN_ID_KEY, resolve_resume

MATH_KEY = "math"
SCHEDULE_KEY = "schedule"

logger = logging.getLogger(__name__)


class ResumeMismatchError(ValueError):
    """Continuing a checkpoint with settings that change the maths (model, data, batch)."""


@dataclass(frozen=True)
class RunPlan:
    """Where a run writes and what it continues."""

    run_id: str
    """The run's identity: the MLflow run id (or a generated one)."""
    checkpoint_dir: Path
    """``checkpoint.folder/<run_id>``: this run's checkpoints."""
    resume_from: Path | None
    """The checkpoint continued, or None for a new run."""
    resume_metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """That checkpoint's ``metadata.json`` (read once, by ``resolve_resume``)."""


def new_run_id() -> str:
    """A fresh run id for a run without MLflow (32 hex digits, like MLflow's:
    ``checkpoint.resume.RUN_ID_SHAPE``)."""
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
        return RunPlan(run_id, Path(root) / run_id, None)
    return RunPlan(run_id, Path(root) / run_id, point.checkpoint, point.metadata)


def math_settings(cfg: Any, token_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings a continued run must share with its checkpoint (JSON-safe).

    Args:
        cfg: The job config.
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unknown).
    """
    settings: dict[str, Any] = {
        "model.name": cfg.model.name,
        "model.flavor": cfg.model.flavor,
        "model.overrides": json.loads(json.dumps(cfg.model.overrides, sort_keys=True)),
        "training.seq_len": cfg.training.seq_len,
        "global_batch_size": cfg.global_batch_size,
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


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key: (saved, current)`` for keys both sides know and that differ."""
    return {
        key: (saved[key], current[key])
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    }


def check_resume_compatible(
    checkpoint: str | Path,
    current: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Refuse to continue ``checkpoint`` when a maths-changing setting differs.

    Args:
        checkpoint: The checkpoint to continue.
        current: This run's ``math_settings``.
        metadata: The checkpoint's ``metadata.json`` when already read (``ResumePoint``).

    Raises:
        ResumeMismatchError: Lists every differing key with both values.
    """
    if metadata is None:
        metadata = read_checkpoint_metadata(checkpoint)
    saved = metadata.get(MATH_KEY) or {}
    diff = differences(saved, current)
    if diff:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ResumeMismatchError(
            f"cannot continue {checkpoint}: settings that change the maths differ ({listed}). "
            "Restore them, or start a new run with checkpoint.resume=never"
        )


def schedule_changes(
    checkpoint: str | Path, cfg: Any, metadata: Mapping[str, Any] | None = None
) -> dict[str, tuple[Any, Any]]:
    """Allowed changes (steps, learning rate) between ``checkpoint`` and ``cfg``."""
    if metadata is None:
        metadata = read_checkpoint_metadata(checkpoint)
    saved = metadata.get(SCHEDULE_KEY) or {}
    return differences(saved, schedule_settings(cfg))


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``key: old -> new; …`` for an MLflow tag or a log line."""
    return "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())


def checkpoint_metadata(cfg: Any, token_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint's ``metadata.json`` records about its run (rank 0 writes it).

    Args:
        cfg: The workers' job config.
        token_metadata: The token files' ``metadata.json`` (None: fingerprints unknown).
    """
    return {
        RUN_ID_KEY: cfg.job.run_id,
        MATH_KEY: math_settings(cfg, token_metadata),
        SCHEDULE_KEY: schedule_settings(cfg),
    }


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
        check_resume_compatible(plan.resume_from, math_settings(cfg, token_metadata), meta)
        changes = schedule_changes(plan.resume_from, cfg, meta)
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
