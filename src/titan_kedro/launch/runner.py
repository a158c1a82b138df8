"""TorchX's runner with every scheduler it registers, Slurm made to read Slurm 22.05's queue.

torchx-nightly describes a Slurm job with ``squeue --json`` and expects a ``job_resources``
entry on every job; Slurm before 23.02 leaves it out while the job is pending, and TorchX
then fails with ``KeyError: 'job_resources'``, also inside ``cancel`` (which asks for the
state first), so a job could not even be cancelled. Here such a job is described as pending.

TorchX also gives a heterogeneous job (one component per node) the state of the component
``squeue`` lists last. After ``scancel`` one component can read ``CANCELLED`` while another
is still ``COMPLETING`` (its processes being killed), and the job looked ended while it was
still in the queue; and a job whose last-listed component completed read as succeeded
though another had failed. Here a job is ended when every component listed has ended,
and failed when any of them failed.
"""

from __future__ import annotations

from typing import Any

from torchx.runner import Runner
from torchx.schedulers import get_scheduler_factories
from torchx.schedulers.api import DescribeAppResponse
from torchx.schedulers.slurm_scheduler import SlurmScheduler
from torchx.specs import AppState, is_terminal

SESSION = "torchx"
"""TorchX's default session name (handles read ``slurm://torchx/<job id>``)."""


class PendingAwareSlurmScheduler(SlurmScheduler):
    """TorchX's Slurm scheduler, with a job's state read from all of its components."""

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        try:
            described = super()._describe_squeue(app_id)
        except KeyError as err:
            if err.args != ("job_resources",):
                raise
            return DescribeAppResponse(app_id=app_id, state=AppState.PENDING)
        if described is not None and is_terminal(described.state):
            described.state = _whole_job_state(
                [r.state for role in described.roles_statuses for r in role.replicas]
            )
        return described


def _whole_job_state(parts: list[AppState]) -> AppState:
    """Running while any part runs; else failed if any part failed, cancelled if any was."""
    if any(not is_terminal(state) for state in parts):
        return AppState.RUNNING
    for state in (AppState.FAILED, AppState.CANCELLED):
        if state in parts:
            return state
    return AppState.SUCCEEDED


def _create_slurm(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return PendingAwareSlurmScheduler(session_name, kwargs.get("docker_client"))


def get_runner() -> Runner:
    """A TorchX runner like ``torchx.runner.get_runner()``, with the Slurm fix above."""
    factories = {**get_scheduler_factories(), "slurm": _create_slurm}
    return Runner(SESSION, factories)
