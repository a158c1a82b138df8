"""Checks before a job goes to a remote scheduler: storage the workers see, a reachable MLflow.

A remote job runs on other machines: every file the workers read or write must lie on
storage they mount at the same path (``launch.shared_dir``), and the MLflow tracking URI
must be a server they reach, not this machine's sqlite file or ``localhost``. Each failure
names the setting to change.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from titan_kedro.config.schema import LOCAL_CWD_SCHEDULER, LOCAL_SCHEDULER
from titan_kedro.launch.appdef import HOST_SCHEDULERS
from titan_kedro.launch.lighthouse_check import lighthouse_problems
from titan_kedro.launch.secrets import SECRET_ARG, SECRET_SCHEDULERS, redact, split_tracking_uri
from titan_kedro.storage import is_remote as is_object_storage
from titan_kedro.tracking.mlflow_logger import TRACKING_URI_ENV

logger = logging.getLogger(__name__)

THIS_MACHINE = frozenset({LOCAL_SCHEDULER, LOCAL_CWD_SCHEDULER})
"""Schedulers whose workers run on this machine (they see its files and its MLflow)."""
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


class LaunchCheckError(ValueError):
    """The job cannot work on the chosen scheduler; the message says which setting to change."""


def is_remote(scheduler: str) -> bool:
    """Whether the scheduler's workers run on other machines."""
    return scheduler not in THIS_MACHINE


NOT_PATHS = frozenset({"never", "latest"})
"""``checkpoint.resume`` values that name no path."""


def _resume_path(resume: str) -> str | None:
    """``checkpoint.resume`` if it is a path (a run id is a single name that is no folder here)."""
    if resume in NOT_PATHS or ("/" not in resume and not os.path.exists(resume)):
        return None
    return resume


def worker_paths(cfg: Any) -> dict[str, str]:
    """Setting → path of every file or folder a remote job reads or writes (object-storage
    URIs, ``s3://…``, name the same objects on every node: not listed)."""
    paths = {
        "job.dump_folder": cfg.job.dump_folder,
        "data.token_dir": cfg.data.token_dir,
        "launch.log_dir": cfg.launch.log_dir,
    }
    if cfg.checkpoint.enable:
        paths["checkpoint.folder"] = cfg.checkpoint.folder
        resume = _resume_path(cfg.checkpoint.resume)
        if resume:
            paths["checkpoint.resume"] = resume
    if cfg.checkpoint.initial_load_hf:
        paths["checkpoint.initial_load_hf"] = cfg.checkpoint.initial_load_hf
    if os.path.exists(cfg.tokenizer.name_or_path):  # a hub id is no path
        paths["tokenizer.name_or_path"] = cfg.tokenizer.name_or_path
    if cfg.model.custom_model_path:
        paths["model.custom_model_path"] = cfg.model.custom_model_path
    return {setting: path for setting, path in paths.items() if not is_object_storage(path)}


def with_absolute_paths(cfg: Any) -> Any:
    """A copy of ``cfg`` whose worker paths are absolute (a remote job has another cwd)."""
    update: dict[str, dict[str, str]] = {}
    for setting, path in worker_paths(cfg).items():
        section, key = setting.split(".")
        update.setdefault(section, {})[key] = os.path.abspath(path)
    return cfg.model_copy(
        update={
            name: getattr(cfg, name).model_copy(update=values) for name, values in update.items()
        }
    )


def _under(path: str, folder: str) -> bool:
    """Whether ``path`` lies in ``folder`` as written (symlinks are not followed: the nodes
    see the same paths, not necessarily the same link targets)."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def _check_storage(cfg: Any) -> list[str]:
    launch = cfg.launch
    if not launch.shared_dir:
        return [
            f"launch.scheduler={launch.scheduler} runs the workers on other machines: set "
            "launch.shared_dir to a folder every node mounts at the same path, and put "
            f"{', '.join(worker_paths(cfg))} under it"
        ]
    shared = Path(launch.shared_dir)
    if not shared.is_absolute():
        return [f"launch.shared_dir={launch.shared_dir!r} must be an absolute path"]
    problems = []
    for setting, path in worker_paths(cfg).items():
        where = os.path.abspath(path)
        if not _under(path, launch.shared_dir):
            problems.append(
                f"{setting}={path!r} ({where}) is outside launch.shared_dir={shared}, so the "
                f"workers cannot see it; set {setting} to a path under {shared}"
            )
    return problems


def _check_mlflow(cfg: Any, env: Mapping[str, str]) -> list[str]:
    uri = env.get(TRACKING_URI_ENV)
    if not cfg.metrics.enable_mlflow or not uri:
        return []
    parts = urlsplit(uri)
    if parts.scheme in ("", "file", "sqlite"):
        kind = "sqlite file" if parts.scheme == "sqlite" else "folder"
    elif (parts.hostname or "") in LOCAL_HOSTS:
        kind = "server on localhost"
    else:
        return []
    return [
        f"MLflow tracking URI {redact(uri)} is a {kind} on this machine, but rank 0 of a "
        f"launch.scheduler={cfg.launch.scheduler} job logs from another one: set "
        "MLFLOW_TRACKING_URI (conf/base/mlflow.yml server.mlflow_tracking_uri) to an MLflow "
        "server every node reaches, or metrics.enable_mlflow=false"
    ]


def _check_credentials(cfg: Any, env: Mapping[str, str]) -> list[str]:
    """Kubernetes pods get MLflow's credentials from a Secret, never from the request; the
    other image schedulers (``local_docker``, …) have no way to pass them but the request."""
    launch = cfg.launch
    secret = launch.scheduler_args.get(SECRET_ARG)
    if secret and launch.scheduler not in SECRET_SCHEDULERS:
        return [
            f"launch.scheduler_args.{SECRET_ARG}={secret!r} names a Kubernetes Secret, which "
            f"launch.scheduler={launch.scheduler} cannot hand to its workers (they would log "
            f"to MLflow without credentials): remove launch.scheduler_args.{SECRET_ARG}, and "
            "use launch.scheduler=kubernetes, slurm or local_cwd for a server that needs them"
        ]
    found = split_tracking_uri(env.get(TRACKING_URI_ENV)).credentials
    if launch.scheduler in HOST_SCHEDULERS or secret or not found:
        return []
    if not cfg.metrics.enable_mlflow:
        return []
    if launch.scheduler not in SECRET_SCHEDULERS:
        return [
            f"MLflow credentials ({', '.join(sorted(found))}) would travel in the "
            f"launch.scheduler={launch.scheduler} request (readable by anyone who can inspect "
            "the job): use launch.scheduler=kubernetes with launch.scheduler_args."
            f"{SECRET_ARG}, slurm or local_cwd, or a tracking server the workers reach "
            "without credentials, or metrics.enable_mlflow=false"
        ]
    return [
        f"MLflow credentials ({', '.join(sorted(found))}) must not travel in the "
        f"{launch.scheduler} request: create a Secret with those keys (kubectl create secret "
        f"generic mlflow-credentials --from-literal=MLFLOW_TRACKING_PASSWORD=…) and set "
        f"launch.scheduler_args.{SECRET_ARG} to its name"
    ]


def _check_role(cfg: Any) -> list[str]:
    launch = cfg.launch
    problems = []

    if launch.scheduler not in HOST_SCHEDULERS and not launch.scheduler_args.get("image"):
        problems.append(
            f"launch.scheduler={launch.scheduler} runs the workers in an image: set "
            "launch.scheduler_args.image to one with titan_kedro installed"
        )
    if cfg.training.device == "cuda" and launch.resources.gpus < launch.nproc_per_node:
        problems.append(
            f"training.device=cuda with launch.nproc_per_node={launch.nproc_per_node} needs one "
            f"GPU per worker: set launch.resources.gpus={launch.nproc_per_node} "
            f"(now {launch.resources.gpus})"
        )
    return problems


def remote_problems(cfg: Any, env: Mapping[str, str]) -> list[str]:
    """Why a remote job could not see its files or reach MLflow (empty: nothing found).

    Args:
        cfg: The job config (paths as this machine resolves them).
        env: The environment the job gets (``MLFLOW_TRACKING_URI``).
    """
    if not is_remote(cfg.launch.scheduler):
        return []
    shared = cfg.launch.shared_dir
    if cfg.launch.scheduler in HOST_SCHEDULERS and shared and not _under(sys.executable, shared):
        logger.warning(
            "the nodes will run %s, which is outside launch.shared_dir=%s: it must exist at "
            "the same path on every node",
            sys.executable,
            shared,
        )
    return [
        *_check_storage(cfg),
        *_check_mlflow(cfg, env),
        *_check_credentials(cfg, env),
        *_check_role(cfg),
        *lighthouse_problems(cfg),
    ]


def check_remote_launch(cfg: Any, env: Mapping[str, str], *, intro: str | None = None) -> None:
    """Fail before submitting if a remote job could not see its files or reach MLflow.

    Raises:
        LaunchCheckError: Every problem of :func:`remote_problems`, one per line, each
            naming its setting, after ``intro`` (default: "cannot submit to <scheduler>").
    """
    problems = remote_problems(cfg, env)
    if problems:
        raise LaunchCheckError(
            (intro or f"cannot submit to {cfg.launch.scheduler}")
            + ":\n"
            + "\n".join(f"- {p}" for p in problems)
        )
