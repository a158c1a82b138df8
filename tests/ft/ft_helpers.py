"""A copied Kedro project whose ``training`` pipeline runs a tiny DeepSeek on CPU, and its MLflow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
from mlflow.tracking import MlflowClient
from small_project import small_vocab_project

ENV = "ftcheck"
KEDRO = Path(sys.executable).with_name("kedro")


def ft_project(root: Path, **sections: dict[str, Any]) -> Path:
    """A small-vocabulary project copy (``small_vocab_project``) with a model card and a conf
    env ``ftcheck`` whose fault-tolerance timeouts are short."""
    ft = {"heartbeat_timeout_s": 2.0, "step_timeout_s": 20.0, **sections.pop("fault_tolerance", {})}
    return small_vocab_project(root, ENV, model_card=True, fault_tolerance=ft, **sections)


def kedro_training(
    project: Path, params: str = "", extra_env: dict[str, str] | None = None, timeout_s: int = 400
) -> subprocess.CompletedProcess[str]:
    """``kedro run --env ftcheck --pipeline training [--params …]`` in ``project``; must succeed."""
    cmd = [str(KEDRO), "run", "--env", ENV, "--pipeline", "training"]
    if params:
        cmd += ["--params", params]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    for name in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    proc = subprocess.run(
        cmd, cwd=project, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, f"kedro run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return proc


def latest_run(project: Path) -> tuple[MlflowClient, str]:
    """A client of the project's ``mlflow.db`` and the id of its newest run."""
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    run = client.search_runs(experiments, order_by=["attributes.start_time DESC"])[0]
    return client, run.info.run_id


def descendants_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
