"""The hooks and nodes of one ``kedro run`` share one resolution of the job config."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from titan_kedro.hooks.continue_run import ContinueRunHook
from titan_kedro.hooks.mlflow_run_tags import MlflowRunTagsHook
from titan_kedro.models import resolve
from titan_kedro.pipelines.evaluation import nodes as evaluation_nodes
from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.pipelines.model_spec import nodes as model_spec_nodes
from titan_kedro.pipelines.training import nodes as training_nodes
from titan_kedro.train import evaluate

REPO = Path(__file__).resolve().parents[2]


def test_hooks_and_nodes_of_one_run_resolve_the_job_config_once(
    tracking_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve, "_CACHE", OrderedDict())
    resolutions: list[Any] = []
    uncached = resolve._resolve

    def counted(*args: Any) -> Any:
        resolutions.append(args[1].name)
        return uncached(*args)

    monkeypatch.setattr(resolve, "_resolve", counted)
    monkeypatch.setenv("KEDRO_DISABLE_TELEMETRY", "true")
    # What a plan or a checkpoint would cost is not the point: the nodes stop after resolving.
    monkeypatch.setattr(model_spec_nodes, "build_plan", lambda resolved: {})
    monkeypatch.setattr(model_spec_nodes, "format_plan", lambda plan: "")
    monkeypatch.setattr(evaluate, "resolve_checkpoint", lambda summary, folder: tmp_path)
    monkeypatch.setattr(evaluate, "evaluation_device", lambda resolved: "cpu")
    monkeypatch.setattr(evaluate, "load_checkpoint_model", lambda resolved, path, device: None)
    bootstrap_project(REPO)
    checkpoint = {"folder": str(tmp_path / "checkpoints"), "resume": "latest"}
    with KedroSession.create(
        project_path=REPO, env="test", runtime_params={"checkpoint": checkpoint}
    ) as session:
        context = session.load_context()  # ValidateJobConfigHook resolves here
        continue_hook, tags_hook = ContinueRunHook(), MlflowRunTagsHook()
        continue_hook.after_context_created(context)
        with pytest.raises(FileNotFoundError, match="no run under"):  # after resolving
            continue_hook.before_pipeline_run({}, None, None)
        tags_hook.after_context_created(context)
        with mlflow.start_run():
            tags_hook.before_pipeline_run({}, None, None)
        sections = {name: context.catalog.load(dataset) for name, dataset in JOB_PARAMS.items()}
    model_spec_nodes.build_model_spec(None, **sections)
    with pytest.raises(ValueError, match="vocab"):  # stops the training node after resolving
        training_nodes.train_model({"vocab_size": 10**7}, {}, **sections)
    evaluation_nodes.load_final_model({}, **sections)
    assert resolutions == ["deepseek_v2"]


def test_equal_params_share_a_resolution_but_not_a_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "_CACHE", OrderedDict())
    raw = {"training": {"steps": 7}, "lr_scheduler": {"warmup_steps": 1}}
    first = resolve.resolve_job_config(raw)
    again = resolve.resolve_job_config({"lr_scheduler": {"warmup_steps": 1}, **raw})  # reordered
    assert again.config == first.config and again.spec is first.spec
    first.config.training.activation_checkpoint = "full"  # the training node applies the plan
    assert again.config.training.activation_checkpoint == "none"
    assert resolve.resolve_job_config(raw).config.training.activation_checkpoint == "none"
    assert len(resolve._CACHE) == 1
    resolve.resolve_job_config({"training": {"steps": 8}, "lr_scheduler": {"warmup_steps": 1}})
    assert len(resolve._CACHE) == 2
