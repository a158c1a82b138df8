"""``checkpoint.resume`` is resolved once: the reopened MLflow run, the training node and
its workers all continue the same concrete checkpoint."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from kedro_mlflow.config.kedro_mlflow_config import KedroMlflowConfig
from mlflow.tracking import MlflowClient
from train.helpers import live_holder, tiny_job

from titan_kedro.hooks.continue_run import CHANGED_TAG, CONTINUED_TAG, ContinueRunHook
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.runs.identity import ResumeMismatchError, checkpoint_metadata, prepare_run
from titan_kedro.runs.lock import RunFolderLockedError
from titan_kedro.runs.resume import CheckpointRunIdError, find_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src" / "titan_kedro"


def _checkpoint(root: Path, run_id: str, step: int, mtime: float) -> Path:
    folder = root / run_id / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    os.utime(folder / "metadata.json", (mtime, mtime))
    return folder


@pytest.fixture
def tracking(tracking_store: str) -> MlflowClient:
    return MlflowClient(tracking_store)


def test_latest_is_resolved_once_and_a_newer_concurrent_save_changes_nothing(
    tmp_path: Path, tracking: MlflowClient
) -> None:
    root = tmp_path / "ckpt"
    experiment = tracking.create_experiment(f"continue-{tmp_path.name}")
    first = tracking.create_run(experiment).info.run_id
    tracking.log_param(first, "training.steps", "4")
    tracking.log_param(first, "checkpoint.resume", "never")
    _checkpoint(root, "0" * 32, 2, mtime=1_000)
    continued = _checkpoint(root, first, 4, mtime=2_000)
    params = tiny_job(tmp_path, tmp_path / "tokens", training={"steps": 6})
    params["checkpoint"]["resume"] = "latest"
    context = SimpleNamespace(params=params, mlflow=KedroMlflowConfig())

    hook = ContinueRunHook()
    hook.after_context_created(context)
    hook.before_pipeline_run({}, None, None)
    assert context.mlflow.tracking.run.id == first  # kedro-mlflow reopens this run
    tags = tracking.get_run(first).data.tags
    assert tags[CONTINUED_TAG] == str(continued)
    assert "checkpoint.resume: never -> latest" in tags[CHANGED_TAG]
    assert "training.steps: 4 -> 6" in tags[CHANGED_TAG]

    # Another run saves a newer checkpoint while data_processing runs.
    newer = _checkpoint(root, "f" * 32, 9, mtime=3_000)
    assert find_checkpoint(root, "latest") == newer

    inputs = {"params:checkpoint": dict(params["checkpoint"]), "token_metadata": {}}
    update = hook.before_node_run(None, inputs)
    assert update is not None
    assert update["params:checkpoint"] == {**params["checkpoint"], "resume": str(continued)}
    node_params = {**params, "checkpoint": update["params:checkpoint"]}
    workers = prepare_run(resolve_job_config(node_params).config, {"vocab_size": 512}, first)
    assert workers.job.run_id == first
    assert workers.checkpoint.resume == str(continued)
    assert workers.checkpoint.folder == str(root / first)
    assert hook.before_node_run(None, {"token_metadata": {}}) is None  # other nodes


def test_a_new_run_is_left_alone(tmp_path: Path) -> None:
    params = tiny_job(tmp_path, tmp_path / "tokens")
    context = SimpleNamespace(params=params, mlflow=KedroMlflowConfig())
    hook = ContinueRunHook()
    hook.after_context_created(context)
    hook.before_pipeline_run({}, None, None)
    assert context.mlflow.tracking.run.id is None
    assert hook.before_node_run(None, {"params:checkpoint": params["checkpoint"]}) is None


@pytest.mark.parametrize("bad", ["../..", "/tmp/x"])
def test_a_checkpoint_naming_a_path_as_its_run_fails_before_the_run_opens(
    tmp_path: Path, bad: str
) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", "a" * 32, 3, mtime=1_000)
    (checkpoint / "metadata.json").write_text(json.dumps({"step": 3, "run_id": bad}))
    params = tiny_job(tmp_path, tmp_path / "tokens", checkpoint={"resume": "latest"})
    context = SimpleNamespace(params=params, mlflow=KedroMlflowConfig())
    hook = ContinueRunHook()
    hook.after_context_created(context)
    with pytest.raises(CheckpointRunIdError) as err:
        hook.before_pipeline_run({}, None, None)
    assert str(checkpoint / "metadata.json") in str(err.value) and repr(bad) in str(err.value)
    assert context.mlflow.tracking.run.id is None


def test_no_module_outside_hooks_is_a_kedro_hook() -> None:
    hooks = []
    for path in SRC.rglob("*.py"):
        names = {
            node.id if isinstance(node, ast.Name) else node.attr
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.Name, ast.Attribute))
        }
        if "hook_impl" in names:
            hooks.append(path.relative_to(SRC).as_posix())
    assert "hooks/continue_run.py" in hooks  # the scan finds hooks
    assert [p for p in hooks if not p.startswith("hooks/")] == []


def test_continuing_a_run_a_live_writer_holds_is_refused_before_its_mlflow_run_is_touched(
    tmp_path: Path, tracking: MlflowClient
) -> None:
    experiment = tracking.create_experiment(f"locked-{tmp_path.name}")
    run_id = tracking.create_run(experiment).info.run_id
    checkpoint = _checkpoint(tmp_path / "ckpt", run_id, 3, mtime=1_000)
    params = tiny_job(tmp_path, tmp_path / "tokens", checkpoint={"resume": "latest"})
    context = SimpleNamespace(params=params, mlflow=KedroMlflowConfig())
    hook = ContinueRunHook()
    hook.after_context_created(context)
    with live_holder(checkpoint.parent) as holder, pytest.raises(RunFolderLockedError) as err:
        hook.before_pipeline_run({}, None, None)
    assert f"pid {holder.pid}" in str(err.value)
    assert context.mlflow.tracking.run.id is None
    assert CONTINUED_TAG not in tracking.get_run(run_id).data.tags


def test_continuing_with_another_seed_is_refused_before_its_mlflow_run_is_touched(
    tmp_path: Path, tracking: MlflowClient
) -> None:
    experiment = tracking.create_experiment(f"seed-{tmp_path.name}")
    run_id = tracking.create_run(experiment).info.run_id
    saved = tiny_job(tmp_path, tmp_path / "tokens", job={"run_id": run_id})
    meta = checkpoint_metadata(resolve_job_config(saved).config, None)
    checkpoint = _checkpoint(tmp_path / "ckpt", run_id, 3, mtime=1_000)
    (checkpoint / "metadata.json").write_text(json.dumps({**meta.to_dict(), "step": 3}))
    params = tiny_job(
        tmp_path, tmp_path / "tokens", job={"seed": 8}, checkpoint={"resume": "latest"}
    )
    context = SimpleNamespace(params=params, mlflow=KedroMlflowConfig())
    hook = ContinueRunHook()
    hook.after_context_created(context)
    with pytest.raises(ResumeMismatchError) as err:
        hook.before_pipeline_run({}, None, None)
    message = str(err.value)
    assert "job.seed: checkpoint 7, now 8" in message and "--params job.seed=7" in message
    assert context.mlflow.tracking.run.id is None  # not reopened
    assert CONTINUED_TAG not in tracking.get_run(run_id).data.tags
    assert hook.before_node_run(None, {"params:checkpoint": params["checkpoint"]}) is None

    # With the checkpoint's seed (and a longer schedule: allowed) the run is continued.
    params["job"]["seed"] = 7
    params["training"]["steps"] = 9
    hook.before_pipeline_run({}, None, None)
    assert context.mlflow.tracking.run.id == run_id
    assert tracking.get_run(run_id).data.tags[CONTINUED_TAG] == str(checkpoint)
