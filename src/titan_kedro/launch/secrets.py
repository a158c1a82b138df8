"""Secrets of a remote job: the MLflow credentials travel by name, and nothing shows them.

A tracking URI may carry credentials (``https://alice:s3cret@host``, ``https://tok3n@host``,
``https://host/?token=…``). The nodes get the URI without them (:func:`split_tracking_uri`)
and MLflow's own variables (``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN``), which
each scheduler carries its own way: Slurm exports the submitter's environment by name
(:func:`exported`), Kubernetes reads a Secret named in ``launch.scheduler_args``. Every text
that leaves the launcher (requests, ``appdef.json``, echoed logs, error messages) goes
through :func:`redact`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from titan_kedro.tracking.mlflow_logger import TRACKING_URI_ENV

USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
CREDENTIAL_ENVS = (USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV)
"""MLflow's credential variables, read by its client on the nodes."""
MASK = "***"
SECRET_QUERY_KEYS = frozenset(
    {"token", "access_token", "auth", "password", "passwd", "pwd", "secret", "key", "api_key",
     "apikey", "sig", "signature", "credential", "credentials"}
)  # fmt: skip
"""Query parameters whose value is a secret (``?token=…``)."""

# Separators as written plainly, JSON-escaped (``\/``, ``\u0040``) or percent-encoded.
_SCHEME_SEP = r"(?::(?://|\\/\\/)|%3A%2F%2F)"
_AT = r"(?:@|%40|\\u0040)"
_COLON = r"(?::|%3A)"
_USERINFO_CHAR = r"(?:(?!%40|%3A|\\u0040)[^\s/@:'\"\\<>])"
_USERINFO = re.compile(
    rf"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*{_SCHEME_SEP})(?P<user>{_USERINFO_CHAR}+)"
    rf"(?:(?P<colon>{_COLON})(?P<password>{_USERINFO_CHAR}*))?(?P<at>{_AT})",
    re.IGNORECASE,
)
_QUERY = re.compile(
    r"(?P<prefix>(?:[?&;]|%3F|%26|\\u0026)(?:"
    + "|".join(sorted(SECRET_QUERY_KEYS, key=len, reverse=True))
    + r")(?:=|%3D))(?P<value>(?:(?!%26|\\u0026)[^&\s'\"#\\])+)",
    re.IGNORECASE,
)
_SECRET_VARIABLE = re.compile(
    r"(?P<prefix>\b[A-Z0-9_]*(?:PASSWORD|TOKEN|SECRET)[A-Z0-9_]*\b\\?[\"']?\s*(?:=|:)\s*\\?[\"']?)"
    r"(?P<value>[^\s'\"\\,}]+)"
)


@dataclass(frozen=True)
class TrackingSecrets:
    """The tracking URI as the nodes get it, and the credentials taken out of it."""

    uri: str | None
    """The URI without user info or secret query parameters (None: no URI)."""
    credentials: dict[str, str] = field(default_factory=dict)
    """``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN`` found in the URI or in this
    process's environment."""

    def values(self) -> list[str]:
        """The secret values (passwords and tokens; user names are not secret)."""
        return secret_values(self.credentials)


def secret_values(credentials: Mapping[str, str]) -> list[str]:
    """The passwords and tokens among MLflow's credential variables (user names are not secret)."""
    return [v for k, v in credentials.items() if k != USERNAME_ENV and v]


def split_tracking_uri(
    uri: str | None, environ: Mapping[str, str] | None = None
) -> TrackingSecrets:
    """``uri`` without its credentials, and the credentials as MLflow's variables.

    ``user:password@`` becomes ``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD``; a user part
    alone (``tok3n@``) and a secret query parameter (``?token=…``) become
    ``MLFLOW_TRACKING_TOKEN``. Credentials already in ``environ`` (default
    ``os.environ``) are kept unless the URI names others.
    """
    environ = os.environ if environ is None else environ
    credentials = {k: environ[k] for k in CREDENTIAL_ENVS if environ.get(k)}
    if not uri:
        return TrackingSecrets(uri, credentials)
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, password = userinfo.partition(":")
        if colon:
            credentials.update({USERNAME_ENV: user, PASSWORD_ENV: password})
        else:
            credentials[TOKEN_ENV] = user
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key.lower() in SECRET_QUERY_KEYS:
            credentials[TOKEN_ENV] = value
        else:
            query.append((key, value))
    if netloc == parts.netloc and len(query) == len(parse_qsl(parts.query, True)):
        # Nothing secret: keep the URI as written (a rebuilt sqlite:////abs/path loses a /).
        return TrackingSecrets(uri, credentials)
    clean = parts._replace(netloc=netloc, query=urlencode(query)).geturl()
    return TrackingSecrets(clean, credentials)


def _encoded_forms(secret: str) -> set[str]:
    return {secret, json.dumps(secret)[1:-1], quote(secret, safe=""), quote(secret)}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential masked; the one function for every output path.

    Masks the password of ``scheme://user:password@`` (a lone user part, a token, as a
    whole), secret query parameters (``?token=…``), values of ``*PASSWORD*`` /
    ``*TOKEN*`` / ``*SECRET*`` variables (``NAME=value``, ``"NAME": "value"``), in plain,
    shell-quoted, JSON-escaped and percent-encoded forms, and every known value in
    ``secrets`` (with this process's MLflow credential variables) wherever it appears.
    """

    def _userinfo(match: re.Match[str]) -> str:
        if match["colon"] is None:
            return f"{match['prefix']}{MASK}{match['at']}"
        return f"{match['prefix']}{match['user']}{match['colon']}{MASK}{match['at']}"

    text = _USERINFO.sub(_userinfo, text)
    text = _QUERY.sub(lambda m: m["prefix"] + MASK, text)
    text = _SECRET_VARIABLE.sub(lambda m: m["prefix"] + MASK, text)
    known = {*secrets, *split_tracking_uri(None).values()}
    for form in sorted({f for s in known if s for f in _encoded_forms(s)}, key=len, reverse=True):
        text = text.replace(form, MASK)
    return text


def tracking_secrets(env: Mapping[str, str]) -> list[str]:
    """The secret values in the tracking URI of ``env`` and in this process's environment."""
    return split_tracking_uri(env.get(TRACKING_URI_ENV)).values()


def node_env(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as a remote job's nodes get it, and the credentials that travel by name.

    Returns:
        ``(env, credentials)``: ``env`` with the tracking URI stripped of its credentials
        (and no credential variable), and MLflow's credential variables.
    """
    secrets = split_tracking_uri(env.get(TRACKING_URI_ENV))
    clean = {k: v for k, v in env.items() if k not in CREDENTIAL_ENVS}
    if secrets.uri:
        clean[TRACKING_URI_ENV] = secrets.uri
    return clean, secrets.credentials


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
