"""Launch the training job: torchrun on this machine, or one torchrun per node via TorchX.

``launch.scheduler: local`` runs ``train.launch.launch_training`` (with
``fault_tolerance.enable``: ``replica_groups.ReplicaGroupLauncher``); any TorchX scheduler
(``local_cwd``, ``slurm``, ``kubernetes``, …) gets the AppDef of ``appdef.build_appdef``,
submitted and followed by ``scheduler.run_job``. Remote jobs are checked first
(``preflight``); ``launch.dryrun`` writes the request instead (``dryrun``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from titan_kedro.config.schema import LOCAL_SCHEDULER
from titan_kedro.launch.appdef import build_appdef
from titan_kedro.launch.dryrun import write_dryrun
from titan_kedro.launch.preflight import (
    LaunchCheckError,
    check_remote_launch,
    is_remote,
    with_absolute_paths,
)
from titan_kedro.launch.replica_groups import ReplicaGroupLauncher
from titan_kedro.launch.scheduler import run_job
from titan_kedro.train.launch import launch_training

__all__ = [
    "LaunchCheckError",
    "build_appdef",
    "launch_job",
    "prepare_job",
    "run_job",
    "write_dryrun",
]


def prepare_job(cfg: Any, env: Mapping[str, str]) -> Any:
    """The config the workers get: absolute paths for a remote scheduler, after its checks.

    A dry run is checked after it has written the request (``write_dryrun``), so the user
    can read it either way.

    Raises:
        LaunchCheckError: A remote job could not see its files or reach MLflow.
    """
    if not is_remote(cfg.launch.scheduler):
        return cfg
    if not cfg.launch.dryrun:
        check_remote_launch(cfg, env)
    return with_absolute_paths(cfg)


def launch_job(
    cfg: Any,
    config_path: str | Path,
    env: Mapping[str, str],
    *,
    console: IO[str] | None = None,
) -> dict[str, Any] | None:
    """Run the job to completion, or write its dry run.

    Args:
        cfg: The job config from :func:`prepare_job`.
        config_path: The job config file the workers load.
        env: ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` (and anything else) for the workers.
        console: Where the workers' output is echoed (default ``sys.stdout``).

    Returns:
        The dry-run summary with ``launch.dryrun``, else None.

    Raises:
        TrainingFailedError: The workers failed; the message holds the failing log tail.
    """
    local = cfg.launch.scheduler == LOCAL_SCHEDULER
    if cfg.launch.dryrun:
        app = None if local else build_appdef(cfg, config_path, env)
        return write_dryrun(cfg, app, config_path, env)
    if cfg.fault_tolerance.enable:  # G torchrun groups here (the config refuses other schedulers)
        ReplicaGroupLauncher(cfg, config_path, extra_env=env, console=console).run()
    elif local:
        launch_training(cfg, config_path, extra_env=env, console=console)
    else:
        run_job(cfg, build_appdef(cfg, config_path, env), console=console)
    return None
