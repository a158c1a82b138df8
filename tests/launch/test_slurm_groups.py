"""The launcher of one Slurm job per replica group (``launch.slurm_groups``) against a fake
TorchX runner: no cluster. A group's job that ends badly (``scancel``, a crash) is submitted
again as the next attempt while another group runs; past ``max_group_restarts`` every job
is cancelled. (The cluster test, ``test_slurm_ft.py``, loses a group's node instead: Slurm
requeues that job itself.)
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
from torchx.specs import AppState, AppStatus

from titan_kedro.config import build_job_config
from titan_kedro.ft.identity import GROUP_ATTEMPT_ENV, REPLICA_ID_ENV
from titan_kedro.launch import slurm_groups
from titan_kedro.launch.torchrun import TrainingFailedError

RUNNING, SUCCEEDED, CANCELLED = AppState.RUNNING, AppState.SUCCEEDED, AppState.CANCELLED


class FakeSlurm:
    """Hands out job ids from 100 and plays each job's states in turn (the last repeats)."""

    def __init__(self, plays: list[list[AppState]]) -> None:
        self.plays = plays
        """One list of states per submission, in submission order."""
        self.submitted: list[dict[str, str]] = []
        self.cancelled: list[str] = []
        self._reads: dict[str, int] = {}

    def submit(self, runner: Any, cfg: Any, app: Any, credentials: Any) -> str:
        self.submitted.append(dict(app.roles[0].env))
        return f"slurm://torchx/{99 + len(self.submitted)}"

    def status(self, handle: str) -> AppStatus:
        if handle in self.cancelled:
            return AppStatus(CANCELLED)
        states = self.plays[int(handle.rsplit("/", 1)[1]) - 100]
        read = self._reads[handle] = self._reads.get(handle, -1) + 1
        return AppStatus(states[min(read, len(states) - 1)])

    def cancel(self, handle: str) -> None:
        self.cancelled.append(handle)


class _Quiet:
    def __init__(self) -> None:
        self.tails: list[list[str]] = []

    def join(self, timeout_s: float) -> None:
        return None


class _NoRequeues:
    def __init__(self, launch: Any, handle: str) -> None:
        pass

    def check(self, status: Any) -> Any:
        return status


def _launcher(
    monkeypatch: pytest.MonkeyPatch, slurm: FakeSlurm, restarts: int, console: io.StringIO
) -> slurm_groups.SlurmGroupLauncher:
    services = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    monkeypatch.setattr(slurm_groups, "get_runner", lambda: contextlib.nullcontext(slurm))
    monkeypatch.setattr(slurm_groups, "submit", slurm.submit)
    monkeypatch.setattr(slurm_groups, "follow_output", lambda *args, **kwargs: _Quiet())
    monkeypatch.setattr(slurm_groups, "RequeueBound", _NoRequeues)
    monkeypatch.setattr(slurm_groups, "replica_group_services",
                        lambda cfg, echo: contextlib.nullcontext(services))  # fmt: skip
    cfg = build_job_config({
        "launch": {"scheduler": "slurm", "shared_dir": "/shared", "nnodes": 1,
                   "nproc_per_node": 1},
        "fault_tolerance": {"enable": True, "replica_groups": 2, "max_group_restarts": restarts},
    })  # fmt: skip
    return slurm_groups.SlurmGroupLauncher(
        cfg, "/shared/job_config.yaml", {}, {}, console=console, poll_s=0.001
    )


def test_a_cancelled_group_job_is_submitted_again_while_the_other_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slurm = FakeSlurm([
        [RUNNING, RUNNING, RUNNING, SUCCEEDED],  # job 100: group 0
        [RUNNING, CANCELLED],  # job 101: group 1, scancelled at its second read
        [RUNNING, SUCCEEDED],  # job 102: group 1 again
    ])  # fmt: skip
    console = io.StringIO()
    _launcher(monkeypatch, slurm, 1, console).run()
    out = console.getvalue()
    groups = [(env[REPLICA_ID_ENV], env[GROUP_ATTEMPT_ENV]) for env in slurm.submitted]
    assert groups == [("0", "0"), ("1", "0"), ("1", "1")]
    assert (
        "[group 1] job slurm://torchx/101 ended CANCELLED; submitting it again to heal from "
        "a live group\n[group 1] submitted slurm://torchx/102 (attempt 1)"
    ) in out
    assert "[group 0] finished" in out and "[group 1] finished" in out
    assert slurm.cancelled == []


def test_past_max_group_restarts_every_job_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm([[RUNNING], [RUNNING, CANCELLED]])  # group 0 would run on
    launcher = _launcher(monkeypatch, slurm, 0, io.StringIO())
    with pytest.raises(TrainingFailedError, match=r"max_group_restarts=0 resubmissions") as err:
        launcher.run()
    assert "replica group 1's job slurm://torchx/101 ended CANCELLED" in str(err.value)
    assert len(slurm.submitted) == 2  # not submitted again
    assert "slurm://torchx/100" in slurm.cancelled  # group 0's job, still running
