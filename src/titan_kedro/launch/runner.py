"""TorchX's runner with every scheduler it registers, Slurm made to read Slurm 22.05's queue.

torchx-nightly describes a Slurm job from ``squeue --json -j <id>`` and gives the job the
state of the last entry it lists. That is wrong three ways on Slurm 22.05 (Debian's, the
test cluster's):

- ``--json`` ignores ``-j``: squeue lists every job it still remembers (``MinJobAge``),
  so the "job's" state was whichever job was listed last, another user's included;
- a heterogeneous job (TorchX: one component per node) is several entries: after
  ``scancel`` one can read ``CANCELLED`` while another is still ``COMPLETING``, and a
  crashed component listed before one that completed read as a success;
- a pending entry has no ``job_resources``, and TorchX failed with ``KeyError`` (also
  inside ``cancel``, which asks for the state first).

Here the entries are filtered to the job's own (its id, or its heterogeneous job id), and
the job runs while any of them runs, and failed when any of them failed.

A job whose AppDef asks for it (``launch.save_before_limit_s``) is submitted with
``sbatch --signal``, and a replica group's job with ``sbatch --no-requeue`` (over the
script's ``--requeue``): the launcher, not Slurm, starts a dead group again.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from typing import Any

from torchx.runner import Runner
from torchx.schedulers import get_scheduler_factories
from torchx.schedulers.api import DescribeAppResponse
from torchx.schedulers.slurm_scheduler import SlurmScheduler, get_appstate_from_job
from torchx.specs import (
    AppDef,
    AppDryRunInfo,
    AppState,
    ReplicaStatus,
    Role,
    RoleStatus,
    is_terminal,
)

SLURM_SIGNAL_KEY = "titan_kedro/slurm_signal"
"""AppDef metadata: the ``sbatch --signal`` value of a Slurm job (``appdef.build_appdef``)."""
SLURM_NO_REQUEUE_KEY = "titan_kedro/slurm_no_requeue"
"""AppDef metadata: submit with ``sbatch --no-requeue`` (a replica group's job)."""
SESSION = "torchx"
"""TorchX's default session name (handles read ``slurm://torchx/<job id>``)."""


class JobAwareSlurmScheduler(SlurmScheduler):
    """TorchX's Slurm scheduler, describing a job from its own ``squeue`` entries only."""

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        output = subprocess.check_output(
            ["squeue", "--json", "-j", app_id], stderr=subprocess.PIPE, encoding="utf-8"
        )
        return describe_entries(app_id, json.loads(output).get("jobs", []))

    def _submit_dryrun(self, app: AppDef, cfg: Any) -> AppDryRunInfo:
        """TorchX's request, with ``sbatch --signal`` and ``--no-requeue`` from
        ``app.metadata`` if asked for (options on the command line win over the script's)."""
        info = super()._submit_dryrun(app, cfg)
        warning = app.metadata.get(SLURM_SIGNAL_KEY)
        if warning:
            info.request.cmd.append(f"--signal={warning}")
        if app.metadata.get(SLURM_NO_REQUEUE_KEY):
            info.request.cmd.append("--no-requeue")
        return info


def _number(value: Any) -> int:
    """An id field: a plain int before Slurm 23.02, ``{"set", "number"}`` after."""
    if isinstance(value, Mapping):
        return int(value.get("number", 0)) if value.get("set", True) else 0
    return int(value or 0)


def _own(entry: Mapping[str, Any], app_id: str) -> bool:
    job = int(app_id)
    return _number(entry.get("het_job_id")) == job or _number(entry.get("job_id")) == job


def describe_entries(app_id: str, entries: list[dict[str, Any]]) -> DescribeAppResponse | None:
    """The job ``app_id`` from ``squeue --json``'s entries (None: squeue no longer has it).

    Each TorchX replica is an entry named ``<role>-<replica>``; entries of other jobs, and
    entries not named so, are skipped.
    """
    roles: dict[str, Role] = {}
    statuses: dict[str, RoleStatus] = {}
    for entry in (e for e in entries if _own(e, app_id)):
        role_name, _, replica = str(entry.get("name", "")).rpartition("-")
        if not role_name or not replica.isdigit():
            continue
        state = get_appstate_from_job(entry)
        role = roles.setdefault(
            role_name,
            Role(
                name=role_name,
                image=entry.get("current_working_directory", ""),
                entrypoint=entry.get("command", ""),
                num_replicas=0,
            ),
        )
        role.num_replicas += 1
        statuses.setdefault(role_name, RoleStatus(role_name, replicas=[])).replicas.append(
            ReplicaStatus(id=int(replica), role=role_name, state=state, hostname=_host(entry))
        )
    if not roles:
        return None
    parts = [r.state for status in statuses.values() for r in status.replicas]
    return DescribeAppResponse(
        app_id=app_id,
        roles=list(roles.values()),
        roles_statuses=list(statuses.values()),
        state=whole_job_state(parts),
    )


def _host(entry: Mapping[str, Any]) -> str:
    nodes = (entry.get("job_resources") or {}).get("nodes") or entry.get("nodes") or ""
    return nodes.get("list", "") if isinstance(nodes, Mapping) else str(nodes)


def whole_job_state(parts: list[AppState]) -> AppState:
    """One state for a job of several parts: running while any part has not ended (pending
    while all that have not ended are pending), else failed if any part failed, cancelled
    if any was, succeeded if all did."""
    waiting = [state for state in parts if not is_terminal(state)]
    if waiting:
        pending = all(state == AppState.PENDING for state in waiting)
        return AppState.PENDING if pending else AppState.RUNNING
    for state in (AppState.FAILED, AppState.CANCELLED):
        if state in parts:
            return state
    return AppState.SUCCEEDED if parts else AppState.UNKNOWN


def _create_slurm(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return JobAwareSlurmScheduler(session_name, kwargs.get("docker_client"))


def get_runner() -> Runner:
    """A TorchX runner like ``torchx.runner.get_runner()``, with the Slurm fix above."""
    factories = {**get_scheduler_factories(), "slurm": _create_slurm}
    return Runner(SESSION, factories)
