"""MLflow for tests: migrated sqlite stores (copied from one made per session), and a
quick real tracking server.

A new sqlite store costs MLflow its whole schema migration (about 3–4 s of alembic on the
2-core test machine), paid again by every ``kedro run`` in a fresh project copy and every
test with its own ``mlflow.db``. The copy is the same file MLflow's own first open writes
(the ``Default`` experiment, the latest schema), made by this process's MLflow.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


MLFLOW_SERVER = """
import os, sys
os.environ["_MLFLOW_SERVER_FILE_STORE"] = sys.argv[1]
os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = sys.argv[2]
from mlflow.server import app, handlers
from werkzeug.serving import make_server
handlers._get_tracking_store()  # creates the database before the port is announced
server = make_server("127.0.0.1", 0, app, threaded=True)
print(server.server_port, flush=True)
server.serve_forever()
"""
"""MLflow's tracking server app on a free loopback port (``mlflow server`` itself, with its
gunicorn/uvicorn workers, takes about 25 s to start here; this about 5 s)."""


@contextmanager
def mlflow_server(
    root: Path, *, host_names: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[str]]:
    """A real MLflow server storing under ``root`` (its request log included); it prints
    its port once it answers.

    Args:
        root: A new folder for its store, artifacts and log.
        host_names: Names besides 127.0.0.1 and localhost that clients may reach it by
            (MLflow refuses other ``Host`` headers).
    """
    root.mkdir()
    hosts = ("127.0.0.1", "localhost", *host_names)
    allowed = ",".join(f"{h}{port}" for h in hosts for port in ("", ":*"))
    proc = subprocess.Popen(
        [sys.executable, "-c", MLFLOW_SERVER, migrated_store(root / "mlflow.db"), str(root / "art")],
        stdout=subprocess.PIPE, stderr=(root / "server.log").open("w"), text=True, cwd=root,
        env={**os.environ, "MLFLOW_SERVER_ALLOWED_HOSTS": allowed},
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
