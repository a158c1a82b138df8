"""Launch the training job: torchrun on this machine, or one torchrun per node via TorchX.

All launching lives here. ``launch.scheduler: local`` runs ``torchrun.launch_training``
(with ``fault_tolerance.enable``: ``replica_groups.ReplicaGroupLauncher``, G torchrun
groups; with ``local_cwd``, a TorchX job of G replicas inside ``replica_group_services``;
with ``slurm``, ``slurm_groups.SlurmGroupLauncher``, one Slurm job per group);
any TorchX scheduler (``local_cwd``, ``slurm``, ``kubernetes``, …) gets the
AppDef of ``appdef.build_appdef``, submitted and followed by ``scheduler.run_job``; both
follow their group with ``supervise``. A run folder that a live run trains into is refused
first (``runs.lock``), remote jobs are checked (``preflight``), and ``launch.dryrun``
writes the request instead (``dryrun``). The nodes get the MLflow URI without
credentials; those travel by name (``secrets``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from titan_kedro.config.schema import FT_JOB_PER_GROUP_SCHEDULERS, LOCAL_SCHEDULER
from titan_kedro.launch.appdef import build_appdef
from titan_kedro.launch.dryrun import write_dryrun
from titan_kedro.launch.k8s_groups import K8S_SCHEDULER, write_group_dryruns
from titan_kedro.launch.preflight import (
    LaunchCheckError,
    check_remote_launch,
    is_remote,
    with_absolute_paths,
)
from titan_kedro.launch.replica_groups import ReplicaGroupLauncher, replica_group_services
from titan_kedro.launch.scheduler import run_job
from titan_kedro.launch.secrets import node_env
from titan_kedro.launch.slurm_groups import SlurmGroupLauncher
from titan_kedro.launch.torchrun import TrainingFailedError, launch_training, mlflow_env
from titan_kedro.runs.lock import RunFolderLockedError, check_run_folder

__all__ = [
    "LaunchCheckError",
    "RunFolderLockedError",
    "TrainingFailedError",
    "build_appdef",
    "check_run_folder_free",
    "launch_job",
    "mlflow_env",
    "prepare_job",
    "run_job",
    "write_dryrun",
]

logger = logging.getLogger(__name__)


def prepare_job(cfg: Any, env: Mapping[str, str]) -> Any:
    """The config the workers get: absolute paths for a remote scheduler, after its checks.

    A dry run is checked after it has written the request (``write_dryrun``), so the user
    can read it either way.

    Raises:
        LaunchCheckError: A remote job could not see its files or reach MLflow.
        RunFolderLockedError: A live run trains into the run folder (see
            :func:`check_run_folder_free`).
    """
    if not cfg.launch.dryrun:
        check_run_folder_free(cfg)
    if not is_remote(cfg.launch.scheduler):
        return cfg
    if not cfg.launch.dryrun:
        check_remote_launch(cfg, env)
    return with_absolute_paths(cfg)


def check_run_folder_free(cfg: Any) -> None:
    """Refuse to start a second writer in a run folder that a live run trains into.

    The workers' rank 0 takes the lock (``runs.lock``); this check fails before
    anything is written or submitted.

    Raises:
        RunFolderLockedError: The holder is alive; the message names it.
    """
    ckpt = cfg.checkpoint
    if not ckpt.enable:
        return
    stale = check_run_folder(ckpt.folder, timeout_s=ckpt.lock_timeout_s, break_lock=ckpt.break_lock)
    if stale is not None:
        logger.warning(
            "run folder %s is locked by %s, which is gone: the workers take the lock over",
            ckpt.folder,
            stale.describe(),
        )


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
        env: ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` (and anything else) for the workers;
            a TorchX job's nodes get the URI without credentials, which travel by name
            (``secrets.node_env``).
        console: Where the workers' output is echoed (default ``sys.stdout``).

    Returns:
        The dry-run summary with ``launch.dryrun``, else None.

    Raises:
        TrainingFailedError: The workers failed; the message holds the failing log tail.
    """
    local = cfg.launch.scheduler == LOCAL_SCHEDULER
    nodes_env, credentials = node_env(env)
    ft = cfg.fault_tolerance.enable  # here, or one Slurm job per group (others are refused)
    per_group = ft and cfg.launch.scheduler in FT_JOB_PER_GROUP_SCHEDULERS
    if cfg.launch.dryrun and ft and cfg.launch.scheduler == K8S_SCHEDULER:
        summary = write_group_dryruns(cfg, config_path, nodes_env, env)
        check_remote_launch(cfg, env, intro="dry run written, but kubernetes would refuse it")
        return summary
    if cfg.launch.dryrun:  # one job per group on Slurm: group 0's stands for them all
        app = (
            None
            if local
            else build_appdef(cfg, config_path, nodes_env, group=0 if per_group else None)
        )
        return write_dryrun(cfg, app, config_path, env)
    if ft and local:
        ReplicaGroupLauncher(cfg, config_path, extra_env=env, console=console).run()
    elif per_group:
        SlurmGroupLauncher(cfg, config_path, nodes_env, credentials, console=console).run()
    elif local:
        launch_training(cfg, config_path, extra_env=env, console=console)
    else:
        echo = (console or sys.stdout).write
        with replica_group_services(cfg, echo) if ft else contextlib.nullcontext({}) as ft_env:
            app = build_appdef(cfg, config_path, {**nodes_env, **ft_env})
            run_job(cfg, app, console=console, credentials=credentials)
    return None
