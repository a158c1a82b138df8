"""Step metrics from training workers into the MLflow run the Kedro session opened.

Workers never start a run: the launcher passes ``MLFLOW_RUN_ID`` (and
``MLFLOW_TRACKING_URI``) and rank 0 logs into that run with ``MlflowClient.log_batch``.
Without ``MLFLOW_RUN_ID`` there is no MLflow logging (console and files only). The URI
holds no credentials (``tracking.credentials``); an MLflow error is logged masked anyway.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from titan_kedro.tracking.credentials import TRACKING_URI_ENV, redact

logger = logging.getLogger(__name__)

RUN_ID_ENV = "MLFLOW_RUN_ID"
__all__ = ["RUN_ID_ENV", "TRACKING_URI_ENV", "MlflowMetricsSink"]


class MlflowMetricsSink:
    """Logs numeric metrics to one existing MLflow run; logging errors never stop training."""

    def __init__(self, run_id: str, tracking_uri: str | None = None):
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._client: Any = None
        self._warned = False

    @property
    def client(self) -> Any:
        """The ``MlflowClient``, made at the first log: importing MLflow and opening its
        store costs a worker about 2 CPU-s, which a rank that never logs (the replica
        groups other than the leader) should not pay."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @classmethod
    def from_env(cls, enable: bool = True) -> MlflowMetricsSink | None:
        """A sink for ``$MLFLOW_RUN_ID`` (None when disabled or the variable is unset)."""
        run_id = os.environ.get(RUN_ID_ENV)
        if not enable or not run_id:
            return None
        return cls(run_id, os.environ.get(TRACKING_URI_ENV))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log every finite numeric value of ``metrics`` at ``step`` in one batch."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key=key, value=float(value), timestamp=now, step=step)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        if not batch:
            return
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as err:  # the tracking server must not kill a training run
            if not self._warned:
                logger.warning(
                    "MLflow logging into run %s failed: %s", self.run_id, redact(str(err))
                )
                self._warned = True
