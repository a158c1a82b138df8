"""How a Slurm job's state is read from ``squeue --json`` (Slurm 22.05's shapes), no cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest
from torchx.schedulers import slurm_scheduler
from torchx.specs import AppState

from titan_kedro.launch.runner import PendingAwareSlurmScheduler


def _component(replica: int, state: str, *, resources: bool = True) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": f"trainer-{replica}",
        "command": "/bin/true",
        "current_working_directory": "/tmp",
        "job_state": state,
    }
    if resources:
        job["job_resources"] = {"nodes": "n1", "allocated_nodes": [
            {"nodename": f"n{replica + 1}", "cpus_used": 1, "memory_allocated": 1024}
        ]}  # fmt: skip
    return job


def _state(monkeypatch: pytest.MonkeyPatch, jobs: list[dict[str, Any]]) -> AppState:
    monkeypatch.setattr(
        slurm_scheduler.subprocess, "check_output", lambda *a, **k: json.dumps({"jobs": jobs})
    )
    described = PendingAwareSlurmScheduler("torchx")._describe_squeue("55")
    assert described is not None
    return described.state


def test_a_job_with_a_component_still_completing_has_not_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After scancel, squeue listed 55+0 COMPLETING and 55+1 CANCELLED; TorchX read the
    # last component's state and called the job ended while it was still in the queue.
    jobs = [_component(0, "COMPLETING"), _component(1, "CANCELLED")]
    assert _state(monkeypatch, jobs) == AppState.RUNNING
    jobs = [_component(0, "CANCELLED"), _component(1, "CANCELLED")]
    assert _state(monkeypatch, jobs) == AppState.CANCELLED


def test_a_pending_component_without_job_resources_is_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [_component(0, "PENDING", resources=False), _component(1, "PENDING", resources=False)]
    assert _state(monkeypatch, jobs) == AppState.PENDING
    # Cancelled before it started: it never gets resources, and it has ended.
    jobs = [_component(k, "CANCELLED", resources=False) for k in (0, 1)]
    assert _state(monkeypatch, jobs) == AppState.CANCELLED


def test_a_job_is_read_from_its_own_components_only() -> None:
    from titan_kedro.launch.runner import only_job

    # Slurm 22.05 lists every job it knows for `squeue --json -j 74`: group 0's running job
    # made group 1's cancelled one look running, and the other way round.
    listed = {"jobs": [
        {**_component(0, "RUNNING"), "job_id": 73, "het_job_id": 0},
        {**_component(0, "CANCELLED"), "job_id": 74, "het_job_id": 0},
        {**_component(0, "COMPLETED"), "job_id": 75, "het_job_id": 75},
        {**_component(1, "COMPLETED"), "job_id": 76, "het_job_id": 75},
    ]}  # fmt: skip
    states = {
        job_id: [j["job_state"] for j in json.loads(only_job(json.dumps(listed), job_id))["jobs"]]
        for job_id in ("73", "74", "75")
    }
    assert states == {"73": ["RUNNING"], "74": ["CANCELLED"], "75": ["COMPLETED", "COMPLETED"]}
