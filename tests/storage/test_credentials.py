"""Object-storage credentials: from credentials.yml into the environment, never shown."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from titan_kedro.hooks.storage_credentials import StorageCredentialsHook
from titan_kedro.storage.credentials import (
    FIELDS,
    StorageCredentialsError,
    environment_from_credentials,
)
from titan_kedro.tracking.credentials import mask_record, redact

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in FIELDS.values():
        monkeypatch.delenv(name, raising=False)  # restored after the test, set or not
    return monkeypatch


def test_the_credentials_entry_becomes_aws_variables_and_the_environment_wins(
    clean_env: pytest.MonkeyPatch,
) -> None:
    import os

    clean_env.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    entry = {"key": "from-the-file", "secret": SECRET, "endpoint_url": "http://127.0.0.1:9"}
    context = SimpleNamespace(config_loader={"credentials": {"object_storage": entry}})
    StorageCredentialsHook().after_context_created(context)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "from-the-environment"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert os.environ["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9"


def test_a_bad_entry_is_named_without_its_value() -> None:
    with pytest.raises(StorageCredentialsError, match=r"object_storage\.secret_key") as err:
        environment_from_credentials({"secret_key": SECRET})
    assert SECRET not in str(err.value)
    with pytest.raises(StorageCredentialsError, match="must be a string"):
        environment_from_credentials({"secret": 12345})


def test_the_secret_in_the_environment_is_masked_in_text_and_log_records(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert SECRET not in redact(f"botocore said: signature for {SECRET} did not match")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "key %s", (SECRET,), None)
    assert SECRET not in mask_record(record).getMessage()
