"""Kedro hook that makes ``--params checkpoint.resume=…`` reopen the run it continues.

Every ``kedro run`` is a new MLflow run unless ``checkpoint.resume`` names a checkpoint.
Then, right after kedro-mlflow has read ``mlflow.yml`` and before it starts its run, this
hook resolves the checkpoint, refuses settings that change the maths (model, seq_len,
global batch; the token fingerprints are checked by the training node), and sets
kedro-mlflow's ``tracking.run.id`` to the checkpoint's run, so the run is reopened.

MLflow refuses a parameter logged again with another value; a continued run may change
``training.steps``, the learning rate and ``checkpoint.resume`` itself. So while a run is
continued, kedro-mlflow's parameter logging keeps the first value of such keys, and the
changes are recorded in the ``titan_kedro.changed_params`` tag.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from titan_kedro.mlflow_hooks import loggable_params
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.checkpoint import find_checkpoint
from titan_kedro.train.run_identity import (
    check_resume_compatible,
    checkpoint_run_id,
    math_settings,
)

logger = logging.getLogger(__name__)

CONTINUED_TAG = "titan_kedro.continued_from"
CHANGED_TAG = "titan_kedro.changed_params"


def changed_params(
    existing: Mapping[str, str], params: Mapping[str, Any]
) -> dict[str, tuple[str, str]]:
    """``key: (logged, now)`` for flattened parameters whose value changed."""
    now = loggable_params(params)
    return {
        k: (existing[k], v) for k, v in sorted(now.items()) if k in existing and existing[k] != v
    }


class ContinueRunHook:
    """Reopens the MLflow run of the checkpoint ``checkpoint.resume`` names."""

    def __init__(self) -> None:
        self._run_id: str | None = None
        self._checkpoint: Path | None = None
        self._params: Mapping[str, Any] = {}

    @hook_impl(trylast=True)  # after kedro-mlflow's: it creates context.mlflow
    def after_context_created(self, context: Any) -> None:
        self._run_id = None
        params = context.params
        resume = str((params.get("checkpoint") or {}).get("resume", "never"))
        if resume == "never":
            return
        cfg = resolve_job_config(params, source="checkpoint.resume").config
        checkpoint = find_checkpoint(cfg.checkpoint.folder, resume)
        if checkpoint is None:
            return
        check_resume_compatible(checkpoint, math_settings(cfg, None))
        run_id = checkpoint_run_id(checkpoint)
        self._checkpoint, self._params = checkpoint, params
        mlflow_config = getattr(context, "mlflow", None)
        if mlflow_config is None:
            return
        try:
            existing = MlflowClient().get_run(run_id).data.params
        except MlflowException:
            logger.warning(
                "continuing %s: its run %s is not in the MLflow store, so a new MLflow run "
                "is started",
                checkpoint,
                run_id,
            )
            return
        mlflow_config.tracking.run.id = run_id
        self._run_id = run_id
        _keep_first_param_values(existing)
        logger.info("continuing MLflow run %s from %s", run_id, checkpoint)

    @hook_impl(trylast=True)  # after kedro-mlflow has reopened the run
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        run = mlflow.active_run()
        if self._run_id is None or run is None or run.info.run_id != self._run_id:
            return
        client = MlflowClient()
        client.set_tag(self._run_id, CONTINUED_TAG, str(self._checkpoint))
        changes = changed_params(client.get_run(self._run_id).data.params, self._params)
        if changes:
            text = "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())
            client.set_tag(self._run_id, CHANGED_TAG, text[:5000])
            logger.info("continued run %s with changed parameters: %s", self._run_id, text)

    @hook_impl
    def after_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        _restore_param_logging()

    @hook_impl
    def on_pipeline_error(
        self, error: Exception, run_params: dict[str, Any], pipeline: Any, catalog: Any
    ) -> None:
        _restore_param_logging()


def _keep_first_param_values(existing: Mapping[str, str]) -> None:
    """Make kedro-mlflow skip parameters already logged with another value in this run."""
    from kedro_mlflow.framework.hooks.mlflow_hook import mlflow_hook

    original = type(mlflow_hook)._log_param

    def log_param(name: str, value: Any) -> Any:
        old = existing.get(name)
        if old is not None and old != str(value)[:MAX_PARAM_VAL_LENGTH]:
            return None
        return original(mlflow_hook, name, value)

    mlflow_hook._log_param = log_param  # type: ignore[method-assign]


def _restore_param_logging() -> None:
    from kedro_mlflow.framework.hooks.mlflow_hook import mlflow_hook

    mlflow_hook.__dict__.pop("_log_param", None)
