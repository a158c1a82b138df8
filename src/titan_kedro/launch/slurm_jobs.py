"""What Slurm itself says about a submitted job: its id, state and how often it was requeued.

TorchX's status folds Slurm's states into a few (``REQUEUED`` reads ``PENDING``,
``TIMEOUT`` and ``PREEMPTED`` read ``FAILED``) and does not count requeues. A job that
Slurm requeues (``scontrol requeue``, preemption, a lost node; TorchX submits every job
with ``--requeue``) keeps its id and starts again with ``SLURM_RESTART_COUNT`` set: its
workers continue from their run's latest complete checkpoint in the same MLflow run
(``train.resume``, ``runs.lock``). :class:`RequeueBound` lets that happen at most
``launch.auto_continue`` times, then cancels the job. A job that Slurm ends for good at
its time limit, by preemption without requeue or with its node (:data:`CONTINUABLE`) is
submitted again by ``scheduler.run_job`` (as often), with the ended jobs' ids in
``TITAN_KEDRO_EARLIER_JOBS``: its workers take over their lock and continue the same way
(``runs.restarts``).
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from typing import Any

from torchx.specs import AppDef

from titan_kedro.launch.torchrun import TrainingFailedError
from titan_kedro.runs.restarts import EARLIER_JOBS_ENV

logger = logging.getLogger(__name__)

SLURM_PREFIX = "slurm://"
CONTINUABLE = frozenset({"TIMEOUT", "PREEMPTED", "NODE_FAIL"})
"""Slurm end states that say nothing about the training itself: continue the run."""


def slurm_job_id(handle: str) -> str | None:
    """The Slurm job id of a TorchX handle (``slurm://torchx/123`` → ``123``); None elsewhere."""
    if not handle.startswith(SLURM_PREFIX):
        return None
    return handle.rsplit("/", 1)[-1]


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job -o <id>`` as ``{field: value}`` (empty once Slurm forgot the job)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        logger.warning("cannot read Slurm job %s: %s", job_id, err)
        return {}
    if out.returncode != 0:
        return {}
    # The first component of a heterogeneous job; values hold no spaces except Command=…
    line = out.stdout.splitlines()[0] if out.stdout else ""
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def continuable_end(handle: str, read_fields: Any = job_fields) -> str | None:
    """Slurm's end state of job ``handle`` if it is one to continue from (:data:`CONTINUABLE`)."""
    job_id = slurm_job_id(handle)
    state = read_fields(job_id).get("JobState") if job_id else None
    return state if state in CONTINUABLE else None


def continuing(app: AppDef, earlier: list[str]) -> AppDef:
    """``app`` whose workers continue the ended jobs ``earlier`` (unchanged if none)."""
    if not earlier:
        return app
    roles = [
        dataclasses.replace(role, env={**role.env, EARLIER_JOBS_ENV: ",".join(earlier)})
        for role in app.roles
    ]
    return dataclasses.replace(app, roles=roles)


def requeue_count(job_id: str) -> int:
    """How often Slurm has requeued the job (``Restarts``; 0 if unknown)."""
    value = job_fields(job_id).get("Restarts", "0")
    return int(value) if value.isdigit() else 0


class RequeueBound:
    """Counts a Slurm job's requeues while it is followed; too many end the launch.

    Args:
        launch: The ``launch`` section (``continues``: ``auto_continue`` resolved).
        handle: The job's TorchX handle (any other scheduler: nothing is checked).
        read_count: Reads the job's requeue count (default :func:`requeue_count`).
    """

    def __init__(self, launch: Any, handle: str, read_count: Any = requeue_count) -> None:
        self.limit = launch.continues
        self.job_id = slurm_job_id(handle)
        self.seen = 0
        self._read = read_count

    def check(self, status: Any) -> Any:
        """Pass ``status`` through after counting the job's requeues.

        Raises:
            TrainingFailedError: Requeued more than ``launch.auto_continue`` times (the
                caller cancels the job).
        """
        if self.job_id is None or status is None or status.is_terminal():
            return status
        count = self._read(self.job_id)
        if count > self.seen:
            self.seen = count
            if count > self.limit:
                raise TrainingFailedError(
                    f"Slurm job {self.job_id} was requeued {count} times, more than "
                    f"launch.auto_continue={self.limit}: it was cancelled; continue it by hand "
                    "(checkpoint.resume=latest) or raise launch.auto_continue"
                )
            logger.warning(
                "Slurm requeued job %s (%d of launch.auto_continue=%d): it continues from its "
                "latest checkpoint in the same MLflow run",
                self.job_id,
                count,
                self.limit,
            )
        return status
