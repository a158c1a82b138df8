"""Kedro hook that makes ``--params checkpoint.resume=…`` continue one run, resolved once.

Every ``kedro run`` is a new MLflow run unless ``checkpoint.resume`` names a checkpoint.
Then, before kedro-mlflow opens its run, this hook resolves ``checkpoint.resume`` once
(``runs.resume.resolve_resume``: a concrete ``step-<n>`` folder and its
checked run id), refuses settings that change the maths (the job config saved with the
checkpoint against this one, all but ``runs.identity.ALLOWED_CHANGES``, ``job.seed``
included: ``check_resume_compatible``, which the training node runs again with the token
fingerprints), sets kedro-mlflow's public ``tracking.run.id`` so that run is reopened, and
tags it ``titan_kedro.continued_from`` / ``titan_kedro.changed_params``. Every node that reads ``params:checkpoint`` then gets the
concrete folder as ``checkpoint.resume`` (``before_node_run``'s returned inputs, Kedro's
way for a hook to update a node's inputs), so the training node and its workers continue
exactly the checkpoint whose MLflow run was reopened, even if another run saved a newer
one in the meantime.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kedro.framework.hooks import hook_impl
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.runs.identity import check_resume_compatible, describe_changes, differences
from titan_kedro.runs.lock import check_run_folder
from titan_kedro.runs.resume import ResumePoint, resolve_resume
from titan_kedro.tracking.mlflow_params import loggable_params

logger = logging.getLogger(__name__)

CONTINUED_TAG = "titan_kedro.continued_from"
CHANGED_TAG = "titan_kedro.changed_params"
CHECKPOINT_INPUT = "params:checkpoint"


class ContinueRunHook:
    """Resolves ``checkpoint.resume`` once, reopens its MLflow run, hands nodes the path."""

    def __init__(self) -> None:
        self._context: Any = None
        self.resume_point: ResumePoint | None = None
        """This pipeline run's resolution (None: a new run)."""

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        self._context = context
        self.resume_point = None

    @hook_impl(tryfirst=True)  # before kedro-mlflow's, which opens tracking.run.id
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        """Resolve ``checkpoint.resume`` and point kedro-mlflow at the checkpoint's run.

        Raises:
            FileNotFoundError: ``checkpoint.resume`` names no complete checkpoint.
            CheckpointRunIdError: The checkpoint's recorded run id is unsafe to use.
            ResumeMismatchError: A maths-changing setting differs from the checkpoint's.
            RunFolderLockedError: A live run still trains into the checkpoint's run folder.
        """
        self.resume_point = None
        params = self._context.params
        resume = str((params.get("checkpoint") or {}).get("resume", "never"))
        if resume == "never":
            return
        cfg = resolve_job_config(params, source="checkpoint.resume").config
        point = resolve_resume(cfg.checkpoint.folder, resume)
        if point is None:
            return
        # The token files may still be (re)written by this run: the node checks their
        # fingerprints; everything else is refused here, before MLflow is touched.
        check_resume_compatible(point.checkpoint, cfg, None, point.metadata)
        # A run that still trains into the folder is refused before its MLflow run is touched.
        ckpt = cfg.checkpoint
        check_run_folder(
            point.checkpoint.parent, timeout_s=ckpt.lock_timeout_s, break_lock=ckpt.break_lock
        )
        self.resume_point = point
        logger.info("checkpoint.resume=%s resolved to %s", resume, point.checkpoint)
        self._reopen_mlflow_run(point, params)

    def _reopen_mlflow_run(self, point: ResumePoint, params: Mapping[str, Any]) -> None:
        mlflow_config = getattr(self._context, "mlflow", None)
        if mlflow_config is None or point.run_id is None:
            return
        client = MlflowClient()
        try:
            existing = client.get_run(point.run_id).data.params
        except MlflowException:
            logger.warning(
                "continuing %s: its run %s is not in the MLflow store, so a new MLflow run "
                "is started",
                point.checkpoint,
                point.run_id,
            )
            return
        mlflow_config.tracking.run.id = point.run_id
        client.set_tag(point.run_id, CONTINUED_TAG, str(point.checkpoint))
        changes = differences(existing, loggable_params(params))
        if changes:
            text = describe_changes(changes)
            client.set_tag(point.run_id, CHANGED_TAG, text[:5000])
            logger.info("continuing run %s with changed parameters: %s", point.run_id, text)
        logger.info("continuing MLflow run %s from %s", point.run_id, point.checkpoint)

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> dict[str, Any] | None:
        """Give a node that reads ``params:checkpoint`` the resolved checkpoint folder."""
        if self.resume_point is None or CHECKPOINT_INPUT not in inputs:
            return None
        # From the context, not ``inputs``: ``KeepLoggedParamsHook`` hides the logged keys
        # of ``inputs`` while the other hooks run.
        section = dict(self._context.params.get("checkpoint") or {})
        section["resume"] = str(self.resume_point.checkpoint)
        return {CHECKPOINT_INPUT: section}
