"""Migrated MLflow sqlite stores for tests, copied from one made per test session.

A new sqlite store costs MLflow its whole schema migration (about 3–4 s of alembic on the
2-core test machine), paid again by every ``kedro run`` in a fresh project copy and every
test with its own ``mlflow.db``. The copy is the same file MLflow's own first open writes
(the ``Default`` experiment, the latest schema), made by this process's MLflow.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def _template() -> Path:
    from mlflow import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="titan-mlflow-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # runs the migration
    return path


def migrated_store(path: Path) -> str:
    """Put a freshly migrated, empty MLflow store at ``path``; returns its ``sqlite:///`` URI.

    Raises:
        FileExistsError: ``path`` exists (a test would silently share a store).
    """
    if path.exists():
        raise FileExistsError(f"{path} exists; migrated_store makes new stores only")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template(), path)
    return f"sqlite:///{path}"
