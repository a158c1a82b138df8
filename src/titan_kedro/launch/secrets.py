"""Secrets of a job: the MLflow credentials travel by name, and nothing shows them.

The nodes get the tracking URI without credentials (``tracking.credentials``:
:func:`split_tracking_uri`, :func:`redact`, the one home of that code) and MLflow's own
variables (``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN``): local workers in their
environment (:func:`worker_env`); remote schedulers each their own way: Slurm exports the
submitter's environment by name (:func:`exported`), Kubernetes reads a Secret named in
``launch.scheduler_args``. Every text that leaves the launcher (requests, ``appdef.json``,
echoed logs, error messages) goes through :func:`redact`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from titan_kedro.tracking.credentials import (
    CREDENTIAL_ENVS,
    MASK,
    PASSWORD_ENV,
    TOKEN_ENV,
    TRACKING_URI_ENV,
    USERNAME_ENV,
    TrackingSecrets,
    is_secret_key,
    redact,
    secret_values,
    split_tracking_uri,
)

__all__ = [
    "CREDENTIAL_ENVS",
    "MASK",
    "PASSWORD_ENV",
    "SECRET_ARG",
    "TOKEN_ENV",
    "USERNAME_ENV",
    "TrackingSecrets",
    "exported",
    "is_secret_key",
    "node_env",
    "redact",
    "secret_values",
    "split_tracking_uri",
    "tracking_secrets",
    "with_secret_ref",
    "worker_env",
]


def tracking_secrets(env: Mapping[str, str]) -> list[str]:
    """The secret values in the tracking URI of ``env`` and in this process's environment."""
    return split_tracking_uri(env.get(TRACKING_URI_ENV)).values()


def node_env(
    env: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as a job's nodes get it, and the credentials that travel by name.

    Args:
        env: The job's variables (``MLFLOW_TRACKING_URI``, …).
        environ: Where credential variables already set are read (default ``os.environ``).

    Returns:
        ``(env, credentials)``: ``env`` with the tracking URI stripped of its credentials
        (and no credential variable), and MLflow's credential variables.
    """
    secrets = split_tracking_uri(env.get(TRACKING_URI_ENV), environ)
    clean = {k: v for k, v in env.items() if k not in CREDENTIAL_ENVS}
    if secrets.uri:
        clean[TRACKING_URI_ENV] = secrets.uri
    return clean, secrets.credentials


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """The full environment ``env`` of workers started here: the tracking URI without
    credentials, which are MLflow's credential variables instead (:func:`node_env`)."""
    clean, credentials = node_env(env, env)
    return {**clean, **credentials}


@contextlib.contextmanager
def exported(credentials: Mapping[str, str]) -> Iterator[None]:
    """This process's environment holds ``credentials`` (and any other variables given)
    meanwhile: ``sbatch`` exports it to the job by name, nothing is written into the
    script. Restored afterwards."""
    saved = {k: os.environ.get(k) for k in credentials}
    os.environ.update(credentials)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


SECRET_ARG = "mlflow_secret"
"""``launch.scheduler_args`` key naming the Kubernetes Secret with MLflow's credential
variables (keys ``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN``)."""
SECRET_SCHEDULERS = frozenset({"kubernetes"})
"""Schedulers whose request ``with_secret_ref`` points at the Secret (Volcano jobs); any other
would drop it, so the preflight refuses ``mlflow_secret`` there."""


def with_secret_ref(info: Any, scheduler_args: Mapping[str, Any]) -> Any:
    """``info`` (a TorchX dry run) whose Kubernetes containers read the Secret named by
    ``scheduler_args["mlflow_secret"]`` into their environment (``envFrom``); else as is."""
    name = scheduler_args.get(SECRET_ARG)
    if not name:
        return info
    resource = getattr(info.request, "resource", None)
    if not isinstance(resource, dict):
        return info
    from kubernetes.client import V1EnvFromSource, V1SecretEnvSource

    for task in resource["spec"]["tasks"]:
        for container in task["template"].spec.containers:
            source = V1EnvFromSource(secret_ref=V1SecretEnvSource(name=str(name)))
            container.env_from = [*(container.env_from or []), source]
    return info
