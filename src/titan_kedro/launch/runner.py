"""TorchX's runner with every scheduler it registers, Slurm made to read Slurm 22.05's queue.

torchx-nightly describes a Slurm job with ``squeue --json`` and expects a ``job_resources``
entry on every job; Slurm before 23.02 leaves it out while the job is pending, and TorchX
then fails with ``KeyError: 'job_resources'``, also inside ``cancel`` (which asks for the
state first), so a job could not even be cancelled. Here such a job is described as
pending, or as ended once all its components have (a job cancelled before it started never
gets resources; cancelling waited a minute for it).

TorchX also gives a heterogeneous job (one component per node) the state of the component
``squeue`` lists last. After ``scancel`` one component can read ``CANCELLED`` while another
is still ``COMPLETING`` (its processes being killed), and the job looked ended while it was
still in the queue. Here a job is ended only when every component listed has ended.
A job whose AppDef asks for it (``launch.save_before_limit_s``) is submitted with
``sbatch --signal``.

And Slurm 22.05's ``squeue --json -j <id>`` ignores ``-j``: it lists every job it knows
(finished ones too, for ``MinJobAge``), and TorchX read them all as components of the one
job, so with two jobs queued (one per replica group) each read the other's state. Here
TorchX's module sees only the components of the job it asked for.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from torchx.runner import Runner
from torchx.schedulers import get_scheduler_factories, slurm_scheduler
from torchx.schedulers.api import DescribeAppResponse
from torchx.schedulers.slurm_scheduler import SlurmScheduler
from torchx.specs import AppDef, AppDryRunInfo, AppState, is_terminal

SLURM_SIGNAL_KEY = "titan_kedro/slurm_signal"
"""AppDef metadata: the ``sbatch --signal`` value of a Slurm job (``appdef.build_appdef``)."""
SESSION = "torchx"
"""TorchX's default session name (handles read ``slurm://torchx/<job id>``)."""


def only_job(squeue_json: str, job_id: str) -> str:
    """``squeue --json`` output with the components of job ``job_id`` alone (a component
    without a ``job_id`` is kept)."""
    data = json.loads(squeue_json)
    data["jobs"] = [
        job
        for job in data.get("jobs", [])
        if job_id in (str(job.get("job_id", job_id)), str(job.get("het_job_id")))
    ]
    return json.dumps(data)


class _SubprocessOfOneJob:
    """``subprocess`` for TorchX's Slurm module: ``squeue --json -j <id>`` lists that job only."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def check_output(args: Any, *rest: Any, **kwargs: Any) -> Any:
        out = subprocess.check_output(args, *rest, **kwargs)
        if isinstance(out, str) and list(args[:3]) == ["squeue", "--json", "-j"]:
            return only_job(out, str(args[3]))
        return out


slurm_scheduler.subprocess = _SubprocessOfOneJob()  # type: ignore[assignment]


def _state_without_resources(job_id: str) -> AppState:
    """A job listed without ``job_resources``: pending, or its end state once every
    component has ended (a job cancelled before it started never gets resources)."""
    out = slurm_scheduler.subprocess.check_output(
        ["squeue", "--json", "-j", job_id], stderr=subprocess.PIPE, encoding="utf-8"
    )
    states = [slurm_scheduler.get_appstate_from_job(job) for job in json.loads(out)["jobs"]]
    if states and all(is_terminal(state) for state in states):
        return states[-1]
    return AppState.PENDING


class PendingAwareSlurmScheduler(SlurmScheduler):
    """TorchX's Slurm scheduler, pending without ``job_resources``, ended when all parts are."""

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        try:
            described = super()._describe_squeue(app_id)
        except KeyError as err:
            if err.args != ("job_resources",):
                raise
            return DescribeAppResponse(app_id=app_id, state=_state_without_resources(app_id))
        if described is not None and is_terminal(described.state):
            states = [r.state for role in described.roles_statuses for r in role.replicas]
            if any(not is_terminal(state) for state in states):
                described.state = AppState.RUNNING
        return described

    def _submit_dryrun(self, app: AppDef, cfg: Any) -> AppDryRunInfo:
        """TorchX's request, with ``sbatch --signal`` from ``app.metadata`` if asked for."""
        info = super()._submit_dryrun(app, cfg)
        warning = app.metadata.get(SLURM_SIGNAL_KEY)
        if warning:
            info.request.cmd.append(f"--signal={warning}")
        return info


def _create_slurm(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return PendingAwareSlurmScheduler(session_name, kwargs.get("docker_client"))


def get_runner() -> Runner:
    """A TorchX runner like ``torchx.runner.get_runner()``, with the Slurm fix above."""
    factories = {**get_scheduler_factories(), "slurm": _create_slurm}
    return Runner(SESSION, factories)
