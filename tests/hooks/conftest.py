"""One MLflow store for the hook tests (creating its tables takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import mlflow
import pytest
from mlflow_store import migrated_store


@pytest.fixture(scope="package")
def tracking_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SQLite tracking URI, set as MLflow's while the hook tests run."""
    uri = migrated_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(None)
