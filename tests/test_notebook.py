"""The notebook opens the newest MLflow run of a store it is pointed at and plots its curves."""

from __future__ import annotations

from pathlib import Path

import mlflow
import nbformat
import pytest
from mlflow.tracking import MlflowClient
from mlflow_store import migrated_store
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "mlflow_run_curves.ipynb"


def _log_run(client: MlflowClient, experiment_id: str, name: str, steps: int) -> str:
    run = client.create_run(experiment_id, run_name=name)
    run_id = run.info.run_id
    for step in range(1, steps + 1):
        client.log_metric(run_id, "loss", 10.0 / step, step=step)
        client.log_metric(run_id, "lr", 1e-3, step=step)
        client.log_metric(run_id, "tps", 900.0 + step, step=step)
        client.log_metric(run_id, "mfu_pct", 1.5, step=step)
    client.log_metric(run_id, "val_loss", 4.0, step=steps)
    client.set_tag(run_id, "model.spec", "deepseek_v2")
    client.set_terminated(run_id)
    return run_id


def _outputs(nb: nbformat.NotebookNode) -> tuple[str, list[str]]:
    text, images = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "data" in out and "image/png" in out["data"]:
                images.append(out["data"]["image/png"])
    return "".join(text), images


@pytest.mark.slow
def test_notebook_plots_the_latest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("titan_kedro")
    _log_run(client, experiment_id, "older", steps=3)
    mlflow.set_tracking_uri(None)  # leave no global state behind for other tests
    latest = _log_run(client, experiment_id, "newest", steps=6)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("TITAN_RUN_ID", raising=False)
    monkeypatch.delenv("TITAN_EXPERIMENT", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    text, images = _outputs(nb)
    assert f"run {latest} (newest): FINISHED" in text
    assert "model.spec = deepseek_v2" in text
    assert "loss: 6 points" in text and "val_loss: 1 points" in text and "mfu_pct: 6 points" in text
    assert len(images) == 1 and len(images[0]) > 10_000
