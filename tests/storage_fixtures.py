"""The S3 test server's fixtures: ``s3_server`` (session), ``s3_bucket`` (per test) and
``s3_module_bucket`` (per module).

``tests/services.sh`` (``make test``, ``.ci/run``) starts the server and exports its endpoint
and key (``TITAN_TEST_S3_*``); a pytest run without them (one test file run by hand) starts
its own for the session with the same script and stops it at the end.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.cluster import s3_up

ENDPOINT_ENV, KEY_ENV, SECRET_ENV = (
    "TITAN_TEST_S3_ENDPOINT",
    "TITAN_TEST_S3_KEY",
    "TITAN_TEST_S3_SECRET",
)


@dataclass(frozen=True)
class S3Server:
    """Where the test server listens and its one identity."""

    endpoint: str
    key: str
    secret: str


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket: ``uri`` is ``s3://<name>``; ``server`` the server it lives on."""

    name: str
    server: S3Server

    @property
    def uri(self) -> str:
        return f"s3://{self.name}"

    def fs(self) -> Any:
        """An ``s3fs.S3FileSystem`` on the test server (no instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=self.server.key,
            secret=self.server.secret,
            endpoint_url=self.server.endpoint,
            skip_instance_cache=True,
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The test S3 server: the one ``tests/services.sh`` exported, else one for this session."""
    if os.environ.get(ENDPOINT_ENV):
        yield S3Server(os.environ[ENDPOINT_ENV], os.environ[KEY_ENV], os.environ[SECRET_ENV])
        return
    state = tmp_path_factory.mktemp("s3-server")
    env = s3_up.start(state)
    try:
        yield S3Server(env[ENDPOINT_ENV], env[KEY_ENV], env[SECRET_ENV])
    finally:
        s3_up.stop(state)


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A fresh bucket on the test server, whose key the environment holds the way a user's
    would (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_ENDPOINT_URL_S3``), so
    the code under test and the processes it starts find it the usual way."""
    return new_bucket(s3_server, monkeypatch)


@pytest.fixture(scope="module")
def s3_module_bucket(s3_server: S3Server) -> Iterator[S3Bucket]:
    """``s3_bucket`` for a module's fixtures (one bucket and environment for the module)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield new_bucket(s3_server, monkeypatch)


def new_bucket(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """Make a bucket on ``server`` and export its key as ``AWS_*`` through ``monkeypatch``."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = S3Bucket(f"titan-test-{secrets.token_hex(6)}", server)
    bucket.fs().mkdir(bucket.name)
    # Left in place (deleting takes seconds); the server's data is wiped at its next start.
    return bucket
