"""Kedro hook: dataset lineage (``tracking/lineage.py``) into the kedro-mlflow run.

Logs once per run, when ``token_metadata`` is saved (after data_processing) or the token
files are read (a later stage run on its own), so every run that trains on the tokens
records the raw source and the splits. Without an active MLflow run it does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

from titan_kedro.tracking.lineage import log_lineage

logger = logging.getLogger(__name__)


class DatasetLineageHook:
    """``mlflow.log_input`` records of the raw C4 source and the token splits."""

    def __init__(self) -> None:
        self._data: Mapping[str, Any] = {}
        self._run_id: str | None = None

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        self._data = dict(context.params.get("data") or {})

    @hook_impl(trylast=True)  # after kedro-mlflow has started the run
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        run = mlflow.active_run()
        self._run_id = run.info.run_id if run is not None else None

    def _log(self, metadata: Any) -> None:
        if self._run_id is None or not isinstance(metadata, Mapping):
            return
        run_id, self._run_id = self._run_id, None  # once per run
        count = log_lineage(run_id, metadata, self._data)
        logger.info("logged %d dataset inputs (raw C4 and token splits) to run %s", count, run_id)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data: Any, node: Any) -> None:
        if dataset_name == "token_metadata":
            self._log(data)

    @hook_impl
    def after_dataset_loaded(self, dataset_name: str, data: Any, node: Any) -> None:
        if dataset_name == "token_metadata":
            self._log(data)
        elif dataset_name == "token_files" and isinstance(data, Mapping):
            self._log(data.get("metadata"))

    @hook_impl
    def after_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self._run_id = None
