"""kedro-viz: ``kedro viz build`` lists every pipeline, with layers raw → … → reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_end_to_end import copy_project

PIPELINES = {
    "__default__",
    "data_processing",
    "model_spec",
    "training",
    "evaluation",
    "reporting",
    "export_hf",
}
LAYER_ORDER = (
    "raw", "intermediate", "primary", "model_input", "models", "model_output", "reporting",
)  # fmt: skip


@pytest.fixture(scope="module")
def viz_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kedro viz build`` (project hooks off, the default) in a copy of the project."""
    project = copy_project(tmp_path_factory.mktemp("viz") / "project", mlflow_store=False)
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "kedro", "viz", "build"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Success" in proc.stdout + proc.stderr
    assert not (project / "mlflow.db").exists()  # without hooks, no MLflow run is opened
    return project / "build"


def _read(build: Path, name: str) -> dict:
    return json.loads((build / "api" / name).read_text(encoding="utf-8"))


@pytest.mark.slow
def test_build_lists_every_pipeline(viz_build: Path) -> None:
    main = _read(viz_build, "main")
    assert {p["id"] for p in main["pipelines"]} == PIPELINES
    assert main["selected_pipeline"] == "__default__"
    assert {p.name for p in (viz_build / "api" / "pipelines").iterdir()} == PIPELINES
    assert (viz_build / "index.html").is_file()


@pytest.mark.slow
def test_each_pipeline_response_holds_its_nodes(viz_build: Path) -> None:
    expected = {
        "evaluation": {"load_final_model", "compute_validation_loss", "generate_samples"},
        "reporting": {
            "parse_training_metrics",
            "plot_loss_curves",
            "plot_expert_load",
            "summarize_report",
        },
        "export_hf": {"load_final_model", "export_final_model"},
        "training": {"train_model"},
    }
    for pipeline, names in expected.items():
        nodes = _read(viz_build, f"pipelines/{pipeline}")["nodes"]
        assert names <= {n["name"] for n in nodes if n["type"] == "task"}, pipeline


@pytest.mark.slow
def test_every_dataset_has_a_layer_and_layers_flow_forwards(viz_build: Path) -> None:
    main = _read(viz_build, "main")
    missing = [n["name"] for n in main["nodes"] if n["type"] == "data" and not n.get("layer")]
    assert missing == [], f"catalog entries without a kedro-viz layer: {missing}"
    layers = main["layers"]  # empty when layers form a cycle
    assert layers == list(LAYER_ORDER)
