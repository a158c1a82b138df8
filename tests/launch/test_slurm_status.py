"""How a Slurm job's state is read from ``squeue --json`` (Slurm 22.05's shapes), no cluster.

Slurm 22.05's ``squeue --json -j 55`` lists every job still remembered, not job 55 alone;
the entries below are shaped like what it printed on the test cluster.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from torchx.specs import AppState

from titan_kedro.launch import runner
from titan_kedro.launch.runner import JobAwareSlurmScheduler


def _entry(job_id: int, name: str, state: str, *, het: int = 0, pending: bool = False) -> dict:
    entry: dict[str, Any] = {
        "job_id": job_id,
        "het_job_id": het,
        "name": name,
        "command": "/bin/true",
        "current_working_directory": "/tmp",
        "job_state": state,
    }
    if not pending:  # Slurm 22.05 leaves job_resources out while a job is pending
        entry["job_resources"] = {"nodes": "n1", "allocated_nodes": [{"nodename": "n1"}]}
    return entry


def _job_55(state_0: str, state_1: str, **kw: Any) -> list[dict]:
    """Job 55: a heterogeneous job of two components (entries 55 and 56)."""
    return [_entry(55, "train-0", state_0, het=55, **kw), _entry(56, "train-1", state_1, het=55, **kw)]  # fmt: skip


def _describe(monkeypatch: pytest.MonkeyPatch, entries: list[dict]) -> Any:
    out = json.dumps({"jobs": entries})
    monkeypatch.setattr(runner.subprocess, "check_output", lambda *a, **k: out)
    return JobAwareSlurmScheduler("torchx")._describe_squeue("55")


def _state(monkeypatch: pytest.MonkeyPatch, entries: list[dict]) -> AppState:
    described = _describe(monkeypatch, entries)
    assert described is not None
    return described.state


def test_only_the_jobs_own_entries_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another job listed last (TorchX took the last entry's state) and one listed first.
    others_before = [_entry(40, "train-0", "FAILED")]
    others_after = [_entry(60, "train-0", "RUNNING"), _entry(61, "tokenize-0", "FAILED")]
    entries = others_before + _job_55("COMPLETED", "COMPLETED") + others_after
    described = _describe(monkeypatch, entries)
    assert described.state == AppState.SUCCEEDED
    assert [r.id for r in described.roles_statuses[0].replicas] == [0, 1]
    assert described.roles[0].num_replicas == 2
    # A job squeue no longer lists is not described by the others.
    assert _describe(monkeypatch, others_before + others_after) is None


def test_a_single_job_is_found_by_its_own_id(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [_entry(55, "train-0", "RUNNING"), _entry(56, "train-0", "FAILED")]
    assert _state(monkeypatch, entries) == AppState.RUNNING


def test_a_job_with_a_component_still_completing_has_not_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After scancel, squeue listed 55+0 COMPLETING and 55+1 CANCELLED.
    assert _state(monkeypatch, _job_55("COMPLETING", "CANCELLED")) == AppState.RUNNING
    assert _state(monkeypatch, _job_55("CANCELLED", "CANCELLED")) == AppState.CANCELLED


def test_a_job_failed_when_any_component_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = list(reversed(_job_55("COMPLETED", "FAILED")))  # the crashed node listed first
    assert _state(monkeypatch, entries) == AppState.FAILED


def test_a_pending_job_without_job_resources_is_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _state(monkeypatch, _job_55("PENDING", "PENDING", pending=True)) == AppState.PENDING
    assert _state(monkeypatch, _job_55("RUNNING", "PENDING")) == AppState.RUNNING
    # Cancelled before it started: it never got resources, and it has ended.
    cancelled = _job_55("CANCELLED", "CANCELLED", pending=True)
    assert _state(monkeypatch, cancelled) == AppState.CANCELLED


def test_ids_in_the_shape_of_newer_slurm_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = _job_55("COMPLETED", "FAILED")
    for entry in entries:
        entry["het_job_id"] = {"set": True, "infinite": False, "number": 55}
        entry["job_state"] = [entry["job_state"]]
    assert _state(monkeypatch, [_entry(70, "train-0", "RUNNING"), *entries]) == AppState.FAILED
