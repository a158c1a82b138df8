"""System metrics: local rank 0 of a node samples into the run under its node id."""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import pytest
from mlflow_store import migrated_store

from titan_kedro.tracking.system_metrics import NodeSystemMetrics


def test_node_monitor_logs_system_metrics_under_node_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = migrated_store(tmp_path / "mlflow.db")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("system-metrics-test")  # not an id left over by another test
    try:
        with mlflow.start_run() as run:
            monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
            monkeypatch.setenv("GROUP_RANK", "1")
            monkeypatch.setenv("LOCAL_RANK", "1")
            assert not NodeSystemMetrics(0.2).active  # only local rank 0 samples
            monkeypatch.setenv("LOCAL_RANK", "0")
            assert not NodeSystemMetrics(0).active  # 0 disables
            monitor = NodeSystemMetrics(0.2)
            monitor.start()
            time.sleep(1.0)
            monitor.stop()
        keys = set(mlflow.get_run(run.info.run_id).data.metrics)
    finally:
        mlflow.set_tracking_uri(None)
    assert "system/node-1/cpu_utilization_percentage" in keys
    assert "system/node-1/system_memory_usage_megabytes" in keys
    history = mlflow.MlflowClient(uri).get_metric_history(
        run.info.run_id, "system/node-1/cpu_utilization_percentage"
    )
    assert len(history) >= 2
