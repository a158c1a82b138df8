"""TorchX's runner with every scheduler it registers, Slurm made to read Slurm 22.05's queue.

torchx-nightly describes a Slurm job with ``squeue --json`` and expects a ``job_resources``
entry on every job; Slurm before 23.02 leaves it out while the job is pending, and TorchX
then fails with ``KeyError: 'job_resources'``, also inside ``cancel`` (which asks for the
state first), so a job could not even be cancelled. Here such a job is described as pending.
"""

from __future__ import annotations

from typing import Any

from torchx.runner import Runner
from torchx.schedulers import get_scheduler_factories
from torchx.schedulers.api import DescribeAppResponse
from torchx.schedulers.slurm_scheduler import SlurmScheduler
from torchx.specs import AppState

SESSION = "torchx"
"""TorchX's default session name (handles read ``slurm://torchx/<job id>``)."""


class PendingAwareSlurmScheduler(SlurmScheduler):
    """TorchX's Slurm scheduler; a queued job without ``job_resources`` is pending."""

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        try:
            return super()._describe_squeue(app_id)
        except KeyError as err:
            if err.args != ("job_resources",):
                raise
            return DescribeAppResponse(app_id=app_id, state=AppState.PENDING)


def _create_slurm(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return PendingAwareSlurmScheduler(session_name, kwargs.get("docker_client"))


def get_runner() -> Runner:
    """A TorchX runner like ``torchx.runner.get_runner()``, with the Slurm fix above."""
    factories = {**get_scheduler_factories(), "slurm": _create_slurm}
    return Runner(SESSION, factories)
