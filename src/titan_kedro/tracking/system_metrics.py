"""MLflow system metrics (CPU, memory, disk, network; GPU when present) of each node.

Local rank 0 of every node runs one ``SystemMetricsMonitor`` into ``$MLFLOW_RUN_ID``
with node id ``node-<GROUP_RANK>``, so the run shows ``system/node-0/cpu_utilization_percentage``
and so on for every machine; a fault-tolerant replica group's nodes are
``replica-<g>-node-<GROUP_RANK>`` (every group has its own node 0). Failures to log never
stop training.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from titan_kedro.ft.identity import REPLICA_ID_ENV
from titan_kedro.tracking.mlflow_logger import RUN_ID_ENV, TRACKING_URI_ENV

logger = logging.getLogger(__name__)


class NodeSystemMetrics:
    """One node's monitor; ``start`` / ``stop`` are no-ops where it does not apply."""

    def __init__(self, interval_s: float, *, enable: bool = True):
        self.interval_s = interval_s
        self.run_id = os.environ.get(RUN_ID_ENV) if enable else None
        self.node_id = f"node-{int(os.environ.get('GROUP_RANK', '0'))}"
        if os.environ.get(REPLICA_ID_ENV):
            self.node_id = f"replica-{int(os.environ[REPLICA_ID_ENV])}-{self.node_id}"
        self.active = (
            bool(self.run_id) and interval_s > 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0
        )
        self._monitor: Any = None

    def start(self) -> None:
        """Start sampling every ``interval_s`` seconds in a daemon thread."""
        if not self.active:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=self.interval_s,
                samples_before_logging=1,
                node_id=self.node_id,
                tracking_uri=os.environ.get(TRACKING_URI_ENV),
            )
            self._monitor.start()
        except Exception as err:  # tracking must not stop training
            logger.warning("system metrics for %s not started: %s", self.node_id, err)
            self._monitor = None

    def stop(self) -> None:
        """Stop sampling; log one last sample (a run shorter than the interval gets one too)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        try:
            monitor.finish()
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as err:
            logger.warning("system metrics for %s not flushed: %s", self.node_id, err)
