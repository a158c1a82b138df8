"""KedroSession smoke tests: environments layer softly and bad parameters fail first."""

from __future__ import annotations

from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from mlflow_store import migrated_store

from titan_kedro.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", migrated_store(tmp_path / "mlflow.db"))
    monkeypatch.setenv("KEDRO_DISABLE_TELEMETRY", "true")
    bootstrap_project(REPO)


def test_test_env_overrides_single_keys_and_keeps_the_rest() -> None:
    with KedroSession.create(project_path=REPO, env="test") as session:
        params = session.load_context().params
    assert params["training"]["steps"] == 12  # conf/test
    assert params["training"]["max_norm"] == 1.0  # conf/base, kept by the soft merge
    assert params["optimizer"]["lr"] == 3.0e-3  # a section conf/test does not touch


def test_runtime_params_override_env_and_are_validated() -> None:
    with KedroSession.create(
        project_path=REPO, env="test", runtime_params={"training": {"steps": 3}}
    ) as session:
        assert session.load_context().params["training"]["steps"] == 3


def test_unknown_runtime_param_fails_before_anything_runs() -> None:
    with pytest.raises(ConfigError) as err:
        with KedroSession.create(
            project_path=REPO, env="test", runtime_params={"training": {"stepz": 3}}
        ) as session:
            session.load_context()
    assert "training.stepz" in str(err.value)
    assert "training.steps" in str(err.value)


def test_gpu_env_is_a_valid_eight_gpu_layout() -> None:
    with KedroSession.create(project_path=REPO, env="gpu") as session:
        params = session.load_context().params
    assert params["launch"]["nproc_per_node"] == 8
    assert params["model"]["flavor"] == "v2-lite"


def test_gpu_v3_env_resolves_to_the_16b_shape_with_mtp() -> None:
    from titan_kedro.models.resolve import resolve_job_config

    with KedroSession.create(project_path=REPO, env="gpu_v3") as session:
        params = session.load_context().params
    resolved = resolve_job_config(params)
    assert resolved.spec.name == "deepseek_v3" and resolved.config.model.flavor == "16B"
    assert resolved.model_args.mtp_depth == 1 and resolved.model_args.dim == 2048
    assert resolved.config.parallelism.expert_parallel_degree == 8
    assert resolved.config.tokenizer.name_or_path == "deepseek-ai/DeepSeek-V3"
