"""Kedro hook that completes the kedro-mlflow run: tags, all parameters, provenance artifacts.

kedro-mlflow opens one MLflow run per ``kedro run`` and logs the parameters that nodes
consume. This hook runs after it and adds what makes a run reproducible and comparable:

- tags: git commit (and whether the tree was dirty), Kedro environment, model spec and
  flavor, and, once the data stage has run or its output is read, the tokenizer and data
  fingerprints;
- every parameter, flattened (``optimizer.lr``), also those no node reads directly;
- artifacts: the resolved job config (``config/job_config.yaml``), the model card
  (``model/model_spec.json``), the token metadata (``data/metadata.json``) and the training
  summary (``training/summary.json``);
- dataset inputs (``tracking/lineage.py``): the raw C4 source and the token splits, logged
  with the token metadata.

Everything goes through ``MlflowClient`` with the run id captured when the run starts, so
it lands in the right run whatever thread a node runs in. With tracking disabled for the
pipeline (``mlflow.yml``), no run is active and the hook does nothing.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
import yaml
from kedro.framework.hooks import hook_impl
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from titan_kedro.data.token_store import token_fingerprints
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.tracking.lineage import log_lineage
from titan_kedro.tracking.mlflow_params import loggable_params

logger = logging.getLogger(__name__)

DATASET_ARTIFACTS: Mapping[str, str] = {
    "token_metadata": "data/metadata.json",
    "model_spec": "model/model_spec.json",
    "training_summary": "training/summary.json",
}
"""Catalog dataset → artifact path, logged the first time the dataset is saved or loaded."""

_PARAM_BATCH = 100


def git_revision(*folders: Path) -> tuple[str, bool] | None:
    """The commit and dirtiness of the first folder that is inside a git work tree.

    Returns:
        ``(sha, dirty)``, or None when no folder is in a repository or git is missing.
    """
    for folder in folders:
        try:
            sha = subprocess.run(
                ["git", "-C", str(folder), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()
            status = subprocess.run(
                ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if sha:
            return sha, bool(status.strip())
    return None


def fingerprint_tags(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Tokenizer and data fingerprints from the data stage's ``metadata.json``, as tags."""
    return {key: str(value) for key, value in token_fingerprints(metadata).items()}


class MlflowRunTagsHook:
    """Tags, flattened parameters and provenance artifacts for the kedro-mlflow run."""

    def __init__(self) -> None:
        self._context: Any = None
        self._run_id: str | None = None
        self._logged: set[str] = set()

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        self._context = context

    @hook_impl(trylast=True)  # after kedro-mlflow has started the run
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        run = mlflow.active_run()
        if run is None or self._context is None:
            self._run_id = None
            return
        self._run_id = run.info.run_id
        self._logged.clear()
        client = MlflowClient()
        params = self._context.params
        resolved = resolve_job_config(params, source="MLflow tags hook")

        tags = {
            "kedro_env": str(self._context.env or run_params.get("env") or "local"),
            "model.spec": resolved.config.model.name,
            "model.flavor": resolved.config.model.flavor,
            "job.name": resolved.config.job.name,
        }
        import titan_kedro

        revision = git_revision(Path(self._context.project_path), Path(titan_kedro.__file__).parent)
        tags["git_commit"] = revision[0] if revision else "unknown"
        if revision:
            tags["mlflow.source.git.commit"] = revision[0]
            tags["git_dirty"] = str(revision[1]).lower()
        for key, value in tags.items():
            client.set_tag(self._run_id, key, value)
        mlflow_config = getattr(self._context, "mlflow", None)
        if mlflow_config is None or not mlflow_config.tracking.run.name:
            # mlflow.yml names no run: use job.name instead of the pipeline name.
            client.set_tag(self._run_id, "mlflow.runName", resolved.config.job.name)

        self._log_params(client, params)
        config_yaml = yaml.safe_dump(resolved.config.model_dump(mode="json"), sort_keys=False)
        client.log_text(self._run_id, config_yaml, "config/job_config.yaml")

    def _log_params(self, client: MlflowClient, params: Mapping[str, Any]) -> None:
        assert self._run_id is not None
        existing = client.get_run(self._run_id).data.params
        pending = [
            Param(key, value)
            for key, value in loggable_params(params).items()
            if key not in existing
        ]
        for start in range(0, len(pending), _PARAM_BATCH):
            client.log_batch(self._run_id, params=pending[start : start + _PARAM_BATCH])

    def _on_dataset(self, dataset_name: str, data: Any) -> None:
        if self._run_id is None or dataset_name in self._logged:
            return
        artifact = DATASET_ARTIFACTS.get(dataset_name)
        if artifact is None or not isinstance(data, Mapping):
            return
        self._logged.add(dataset_name)
        client = MlflowClient()
        client.log_dict(self._run_id, dict(data), artifact)
        if dataset_name == "token_metadata":
            for key, value in fingerprint_tags(data).items():
                client.set_tag(self._run_id, key, value)
            count = log_lineage(self._run_id, data, self._context.params.get("data") or {})
            logger.info("logged %d dataset inputs (raw C4 and token splits)", count)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data: Any, node: Any) -> None:
        self._on_dataset(dataset_name, data)

    @hook_impl
    def after_dataset_loaded(self, dataset_name: str, data: Any, node: Any) -> None:
        if dataset_name == "token_files" and isinstance(data, Mapping):
            # The token folder read whole (later stages run alone) holds the same
            # metadata.json. Only on load: what is saved lacks the fields the dataset adds.
            dataset_name, data = "token_metadata", data.get("metadata")
        self._on_dataset(dataset_name, data)

    @hook_impl
    def after_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self._run_id = None

    @hook_impl
    def on_pipeline_error(
        self, error: Exception, run_params: dict[str, Any], pipeline: Any, catalog: Any
    ) -> None:
        self._run_id = None
