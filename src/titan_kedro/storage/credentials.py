"""Object-storage credentials: found the usual way, given by name, never shown.

Where they come from, first found wins: the environment (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible server), an AWS profile (``AWS_PROFILE``, ``~/.aws``), or the
``object_storage`` entry of ``conf/local/credentials.yml``, which the Kedro hook
``hooks.storage_credentials`` turns into those variables (:func:`environment_from_credentials`)
for the run and the workers it starts (local workers inherit them, ``sbatch`` exports them
by name, nothing is written into a script or request). The secret values are known to the
one redaction (``tracking.credentials.redact``, :func:`storage_secrets`), so a log line or
error that quotes them is masked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

CREDENTIALS_ENTRY = "object_storage"
"""The key of ``conf/local/credentials.yml`` read by ``hooks.storage_credentials``."""
FIELDS = {
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN",
    "endpoint_url": "AWS_ENDPOINT_URL_S3",
    "profile": "AWS_PROFILE",
    "region": "AWS_DEFAULT_REGION",
}
"""``object_storage`` field → the variable botocore (and so s3fs) reads."""
SECRET_ENVS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class StorageCredentialsError(ValueError):
    """The ``object_storage`` credentials entry is malformed (no value is quoted)."""


def environment_from_credentials(entry: Mapping[str, object]) -> dict[str, str]:
    """The variables an ``object_storage`` credentials entry stands for.

    Raises:
        StorageCredentialsError: A field is unknown or not a string (named, value not shown).
    """
    if not isinstance(entry, Mapping):
        raise StorageCredentialsError(
            f"conf/local/credentials.yml: {CREDENTIALS_ENTRY} must be a mapping of "
            f"{', '.join(FIELDS)}"
        )
    env = {}
    for name, value in entry.items():
        if name not in FIELDS:
            raise StorageCredentialsError(
                f"conf/local/credentials.yml: {CREDENTIALS_ENTRY}.{name} is not a known field; "
                f"use {', '.join(FIELDS)}"
            )
        if value is None:
            continue
        if not isinstance(value, str):
            raise StorageCredentialsError(
                f"conf/local/credentials.yml: {CREDENTIALS_ENTRY}.{name} must be a string"
            )
        env[FIELDS[name]] = value
    return env


def adopt_storage_credentials(
    entry: Mapping[str, object] | None, environ: MutableMapping[str, str] | None = None
) -> list[str]:
    """Set the variables of ``entry`` that ``environ`` (default ``os.environ``) lacks: the
    environment and profile a user set win over the file. Returns the names set."""
    environ = os.environ if environ is None else environ
    wanted = environment_from_credentials(entry) if entry else {}
    added = {name: value for name, value in wanted.items() if not environ.get(name)}
    environ.update(added)
    return sorted(added)


def storage_secrets(environ: Mapping[str, str] | None = None) -> set[str]:
    """The object-storage secret values in ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return {environ[k] for k in SECRET_ENVS if environ.get(k)}
