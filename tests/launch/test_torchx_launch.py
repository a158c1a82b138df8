"""Launch through TorchX: the AppDef, dry runs for Slurm and Kubernetes, remote checks,
and real ``local_cwd`` jobs (failure, timeout, Ctrl-C) that leave no process behind."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from launch.job_processes import descendants, interrupt_once_training, start_training_node
from torchx.components.dist import ddp
from train.helpers import TINY_DEEPSEEK, tiny_job, write_token_dir

from titan_kedro.config import build_job_config
from titan_kedro.hooks import ValidateJobConfigHook
from titan_kedro.launch import LaunchCheckError, build_appdef, prepare_job
from titan_kedro.launch.torchrun import TrainingFailedError, launch_training
from titan_kedro.pipelines.training import nodes

RUN_ENV = {
    "MLFLOW_RUN_ID": "0123456789abcdef0123456789abcdef",
    "MLFLOW_TRACKING_URI": "https://alice:s3cret@mlflow.example:5000",
}
CLUSTER = {
    "nnodes": 2,
    "nproc_per_node": 8,
    "resources": {"gpus": 8, "cpus": 64, "memory_mb": 512_000},
}
SCHEDULER_ARGS = {
    "slurm": {"partition": "gpu", "time": "24:00:00"},
    "kubernetes": {
        "queue": "default",
        "namespace": "ml",
        "validate_spec": False,  # torchx-nightly asks the API server otherwise
        "mlflow_secret": "mlflow-credentials",
        "image": "registry.example/titan-kedro:1",
        "mounts": ["type=bind,src=/shared,dst=/shared"],
    },
}


def shared_job(root: Path, **launch: Any) -> dict[str, Any]:
    """A tiny job whose every path lies under ``root`` (a built-in model: no file to share)."""
    model = {"name": "deepseek_v2", "flavor": "debugmodel", "custom_model_path": None}
    job = tiny_job(root, root / "tokens", model=model, metrics={"enable_mlflow": True})
    job["launch"] = {**job["launch"], "shared_dir": str(root), **launch}
    return job


def test_unknown_scheduler_fails_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"launch\.scheduler") as err:
        build_job_config({"launch": {"scheduler": "slurmm"}})
    for name in ("local", "local_cwd", "local_docker", "slurm", "kubernetes"):
        assert name in str(err.value)
    assert "aws_batch" not in str(err.value)  # removed from TorchX


def test_appdef_is_dist_ddp_with_our_torchrun_command(tmp_path: Path) -> None:
    cfg = build_job_config(shared_job(tmp_path, scheduler="kubernetes", **CLUSTER))
    ours = build_appdef(cfg, "/shared/job_config.yaml", RUN_ENV)
    theirs = ddp(
        "--config", "/shared/job_config.yaml", m="titan_kedro.train", j="2x8",
        gpu=8, cpu=64, memMB=512_000,
    )  # fmt: skip
    (role,), (ref,) = ours.roles, theirs.roles
    for field in ("name", "entrypoint", "num_replicas", "resource", "port_map", "max_retries"):
        assert getattr(role, field) == getattr(ref, field), field
    line = role.args[1]
    assert role.args[0] == ref.args[0] == "-c"
    # The same rendezvous as dist.ddp: c10d on the rank-0 host's port, the app id as id.
    assert "--rdzv-backend c10d --rdzv-endpoint $${${rank0_env}:=localhost}:29500" in line
    assert "--rdzv-id '${app_id}'" in line and "${app_id}" in ref.args[1]
    assert "--nnodes=2 --nproc-per-node=8" in line
    assert line.endswith("-m titan_kedro.train --config /shared/job_config.yaml")
    assert {**RUN_ENV, "PYTHONUNBUFFERED": "1"}.items() <= role.env.items()


@pytest.mark.parametrize("scheduler", ["slurm", "kubernetes"])
def test_dry_run_writes_the_request_and_trains_nothing(
    scheduler: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(nodes, "mlflow_env", lambda: dict(RUN_ENV))
    job = shared_job(
        tmp_path,
        scheduler=scheduler,
        scheduler_args=SCHEDULER_ARGS[scheduler],
        dryrun=True,
        dryrun_dir=str(tmp_path / "launch"),
        **CLUSTER,
    )
    # The request is about the launch, not the model: the node plans the small-vocabulary
    # debug model (the 102,400-row tables only slowed its fake step down).
    job["model"]["overrides"] = TINY_DEEPSEEK
    with caplog.at_level(logging.INFO):
        summary = nodes.train_model({"vocab_size": 512}, {}, **job)  # the model's vocabulary
    assert summary["dryrun"] is True and summary["final_step"] is None
    assert "dry run" in caplog.text and "nothing trained" in caplog.text
    request = Path(summary["request_file"]).read_text()
    assert Path(summary["request_file"]) == tmp_path / "launch" / f"request_{scheduler}.txt"
    for needle in (
        "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend c10d",
        "-m titan_kedro.train --config", str(tmp_path / "job" / "runs" / RUN_ENV["MLFLOW_RUN_ID"] / "job_config.yaml"),
        "MLFLOW_RUN_ID", RUN_ENV["MLFLOW_RUN_ID"],
    ):  # fmt: skip
        assert needle in request, needle
    # The nodes get the URI without credentials (they travel by name, see launch.secrets).
    assert "s3cret" not in request and "alice" not in request
    assert "https://mlflow.example:5000" in request and "@mlflow.example" not in request
    if scheduler == "slurm":
        assert "#SBATCH --job-name=train-0" in request and "--partition=gpu" in request
        assert "--gpus-per-task=8" in request and "${SLURM_JOB_NODELIST_HET_GROUP_0" in request
    else:
        assert "kind: Job" in request and "queue: default" in request
        assert (
            "nvidia.com/gpu: '8'" in request and "image: registry.example/titan-kedro:1" in request
        )
        # Every pod reads MLflow's credentials from the Secret, by name.
        assert len(re.findall(r"secretRef:\s+name: mlflow-credentials", request)) == 2
    appdef = json.loads(Path(summary["appdef_file"]).read_text())
    assert appdef["roles"][0]["num_replicas"] == 2 and appdef["roles"][0]["resource"]["gpu"] == 8
    assert not list((tmp_path / "job").rglob("summary.json")) and not (tmp_path / "ckpt").exists()


def test_a_dry_run_that_would_be_refused_is_written_then_fails(tmp_path: Path) -> None:
    from titan_kedro.launch import launch_job

    job = shared_job(tmp_path, scheduler="slurm", dryrun=True, dryrun_dir=str(tmp_path / "dry"))
    cfg = prepare_job(build_job_config(job), {**RUN_ENV, "MLFLOW_TRACKING_URI": "sqlite:///m.db"})
    with pytest.raises(LaunchCheckError, match=r"(?s)dry run written to .*sqlite file"):
        launch_job(cfg, tmp_path / "job.yaml", {**RUN_ENV, "MLFLOW_TRACKING_URI": "sqlite:///m.db"})
    assert "#SBATCH" in (tmp_path / "dry" / "request_slurm.txt").read_text()


def test_a_dry_run_refuses_the_nodes_that_read_its_summary() -> None:
    from titan_kedro.pipelines import evaluation, training

    hook = ValidateJobConfigHook()
    hook.dryrun = True
    hook.before_pipeline_run({}, training.create_pipeline())  # training alone is fine
    with pytest.raises(ValueError, match="--pipelines data_processing,model_spec,training"):
        hook.before_pipeline_run({}, training.create_pipeline() + evaluation.create_pipeline())


def test_remote_checks_name_the_setting_to_change(tmp_path: Path) -> None:
    def problems(job: dict[str, Any], env: dict[str, str] | None = None) -> str:
        with pytest.raises(LaunchCheckError) as err:
            prepare_job(build_job_config(job), RUN_ENV if env is None else env)
        return str(err.value)

    slurm = {"scheduler": "slurm"}
    job = shared_job(tmp_path, **slurm)
    assert prepare_job(build_job_config(job), RUN_ENV).job.dump_folder == str(tmp_path / "job")
    no_shared = {**job, "launch": {**job["launch"], "shared_dir": None}}
    assert "set launch.shared_dir" in problems(no_shared)
    outside = {**job, "data": {"token_dir": "data/05_model_input/tokens"}}
    assert "data.token_dir='data/05_model_input/tokens'" in problems(outside)
    for uri, kind in (
        ("sqlite:///mlflow.db", "sqlite file"),
        ("/home/me/mlruns", "folder"),
        ("http://127.0.0.1:5000", "server on localhost"),
    ):
        message = problems(job, {**RUN_ENV, "MLFLOW_TRACKING_URI": uri})
        assert kind in message and "MLFLOW_TRACKING_URI" in message, uri
    no_mlflow = {**job, "metrics": {**job["metrics"], "enable_mlflow": False}}
    prepare_job(build_job_config(no_mlflow), {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"})
    k8s = shared_job(tmp_path, scheduler="kubernetes")
    assert "launch.scheduler_args.image" in problems(k8s)
    assert "launch.scheduler_args.mlflow_secret" in problems(k8s)  # the URI holds a password
    cuda = {**job, "training": {**job["training"], "device": "cuda"}}
    cuda["launch"] = {**cuda["launch"], "nproc_per_node": 4}
    assert "launch.resources.gpus=4" in problems(cuda)


def test_a_secret_local_docker_cannot_pass_is_refused_not_dropped(tmp_path: Path) -> None:
    """``mlflow_secret`` is a Kubernetes Secret: a docker container would run without it."""
    image = {"image": "titan-kedro:1"}
    for env, args in ((RUN_ENV, {"mlflow_secret": "mlflow-credentials"}), (RUN_ENV, {})):
        job = build_job_config(
            shared_job(tmp_path, scheduler="local_docker", scheduler_args=image | args)
        )
        with pytest.raises(LaunchCheckError) as err:
            prepare_job(job, env)
        message = str(err.value)
        assert "launch.scheduler=local_docker" in message, args
        assert "s3cret" not in message
        if args:
            assert "remove launch.scheduler_args.mlflow_secret" in message
        else:
            assert "kubernetes with launch.scheduler_args.mlflow_secret" in message
    # A secret is refused on local_docker even when the URI holds no credential.
    plain = {**RUN_ENV, "MLFLOW_TRACKING_URI": "https://mlflow.example:5000"}
    docker = shared_job(
        tmp_path, scheduler="local_docker", scheduler_args=image | {"mlflow_secret": "s"}
    )
    with pytest.raises(LaunchCheckError, match="mlflow_secret='s' names a Kubernetes Secret"):
        prepare_job(build_job_config(docker), plain)
    prepare_job(
        build_job_config({**docker, "launch": {**docker["launch"], "scheduler_args": image}}), plain
    )


def test_relative_paths_become_absolute_for_remote_workers(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    job = shared_job(tmp_path, scheduler="slurm")
    job["data"] = {"token_dir": "data/tokens"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        cfg = prepare_job(build_job_config(job), RUN_ENV)
    finally:
        os.chdir(cwd)
    assert cfg.data.token_dir == str(tmp_path / "data" / "tokens")


def test_a_scheduler_option_it_does_not_take_fails_listing_the_valid_ones(tmp_path: Path) -> None:
    from titan_kedro.launch import launch_job

    job = shared_job(tmp_path, scheduler="slurm", dryrun=True, scheduler_args={"queue": "default"})
    with pytest.raises(
        ValueError, match=r"queue, which slurm does not take; valid keys: .*partition"
    ):
        launch_job(build_job_config(job), tmp_path / "job.yaml", RUN_ENV)


def test_local_torchrun_refuses_several_nodes(tmp_path: Path) -> None:
    cfg = build_job_config({"launch": {"nnodes": 2, "rdzv_endpoint": "h:29500"}})
    with pytest.raises(ValueError, match=r"launch\.scheduler to local_cwd"):
        launch_training(cfg, tmp_path / "job.yaml")


@pytest.mark.slow
def test_a_failing_local_cwd_job_raises_with_the_worker_error(tmp_path: Path) -> None:
    job = tiny_job(
        tmp_path, tmp_path / "no_tokens_here", launch={"scheduler": "local_cwd", "nnodes": 2}
    )
    with pytest.raises(TrainingFailedError) as err:
        nodes.train_model({}, {}, **job)
    message = str(err.value)
    assert "ended FAILED" in message and "--- node" in message
    assert "no token file" in message


@pytest.mark.slow
def test_a_local_cwd_job_past_its_timeout_is_cancelled(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4000)
    job = tiny_job(
        tmp_path,
        tokens,
        training={"steps": 100_000},
        launch={"scheduler": "local_cwd", "timeout_s": 3},
    )
    before = set(psutil.Process().children(recursive=True))
    start = time.monotonic()
    with pytest.raises(TrainingFailedError, match="timeout_s=3s and was cancelled"):
        nodes.train_model({"vocab_size": 512}, {}, **job)
    assert time.monotonic() - start < 60
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.slow
def test_interrupting_a_local_cwd_run_leaves_no_process_behind(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4000)
    job = tiny_job(
        tmp_path,
        tokens,
        training={"steps": 100_000},
        launch={"scheduler": "local_cwd", "nnodes": 2},
    )
    log = tmp_path / "node.log"
    node = start_training_node(job, log)
    _, family = interrupt_once_training(node, descendants(node))  # agents, wrappers, workers
    output = log.read_text(errors="replace")
    assert node.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert "cancelling" in output
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert len(gone) >= 4  # two agents and two workers at least
