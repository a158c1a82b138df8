"""The replica-group launcher's bookkeeping, with each group's torchrun replaced by a tiny
Python process (the real start, output streaming and stop; only the command differs)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from train.helpers import tiny_job

from titan_kedro.launch import replica_groups
from titan_kedro.launch.replica_groups import ReplicaGroupLauncher
from titan_kedro.launch.torchrun import TrainingFailedError, start_torchrun
from titan_kedro.models.resolve import resolve_job_config

GROUP = """
import os, sys, time
group = int(os.environ["TITAN_KEDRO_REPLICA_ID"])
script = {script!r}
action = script[group]
time.sleep(action["sleep_s"])
print(f"group {{group}}: " + action["say"], flush=True)
sys.exit(action["rc"])
"""


def _launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_1: dict
) -> ReplicaGroupLauncher:
    """A two-group launcher: group 0 finishes at once, group 1 runs ``group_1`` (sleep,
    print, exit with ``rc``)."""
    script = {0: {"sleep_s": 0.0, "say": "done", "rc": 0}, 1: group_1}
    raw = tiny_job(
        tmp_path,
        tmp_path / "tokens",
        fault_tolerance={"enable": True, "replica_groups": 2, "max_group_restarts": 1},
    )
    cfg = resolve_job_config(raw, source="test").config
    command = [sys.executable, "-c", GROUP.format(script=script)]

    def fake_torchrun(launch, config_path, *, extra_env=None):
        return start_torchrun(launch, config_path, extra_env=extra_env, command=command)

    monkeypatch.setattr(replica_groups, "start_torchrun", fake_torchrun)
    return ReplicaGroupLauncher(cfg, tmp_path / "job_config.yaml", console=io.StringIO())


def test_a_group_failing_after_another_finished_fails_the_job_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(
        tmp_path,
        monkeypatch,
        {"sleep_s": 1.5, "say": "Traceback: the digest write failed", "rc": 3},
    )
    ft = launcher.cfg.fault_tolerance
    with pytest.raises(TrainingFailedError) as failure:
        launcher._run_groups(ft, deadline=None)
    message = str(failure.value)
    assert "replica group 1 exited with code 3" in message
    assert "group 1: Traceback: the digest write failed" in message  # its output's tail
    assert launcher.groups[0].finished and not launcher.groups[1].finished
    assert launcher.restarts == {}  # not restarted: the steps are done
    assert "[group 0] finished" in launcher.console.getvalue()


def test_groups_that_all_exit_zero_finish_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(tmp_path, monkeypatch, {"sleep_s": 1.0, "say": "done", "rc": 0})
    launcher._run_groups(launcher.cfg.fault_tolerance, deadline=None)
    assert all(group.finished for group in launcher.groups)
