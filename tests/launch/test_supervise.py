"""Following a worker group: a stop that fails never hides why the group was stopped."""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torchx.specs import AppDef, AppState, AppStatus, Role

from titan_kedro.config import build_job_config
from titan_kedro.launch import scheduler
from titan_kedro.launch.supervise import OutputFollower, supervise


class _Interrupted:
    """A poll that reports a running group, then is interrupted (Ctrl-C) on its third call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return "running"


def _failing_stop() -> None:
    raise PermissionError("cannot signal the agents")


def test_an_interrupt_survives_a_failing_stop(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KeyboardInterrupt) as err, caplog.at_level(logging.ERROR):
        supervise(_Interrupted(), lambda s: s == "done", _failing_stop, timeout_s=None, poll_s=0.01)
    assert "PermissionError('cannot signal the agents')" in " ".join(err.value.__notes__)
    assert "stopping the worker group failed too" in caplog.text


def test_a_group_past_its_time_is_stopped_once() -> None:
    stops: list[int] = []
    state, timed_out = supervise(
        lambda: "running", lambda s: s == "done", lambda: stops.append(1),
        timeout_s=0.2, poll_s=0.01,
    )  # fmt: skip
    assert (state, timed_out, stops) == ("running", True, [1])
    states = iter(["running", "running", "done"])
    assert supervise(lambda: next(states), lambda s: s == "done", _failing_stop,
                     timeout_s=60, poll_s=0.01) == ("done", False)  # fmt: skip


def test_the_follower_echoes_every_stream_with_its_prefix() -> None:
    console = io.StringIO()
    follower = OutputFollower(
        [lambda: iter(["a\n", "b"]), lambda: iter(["c\n"])], console, ["[0] ", "[1] "]
    )
    follower.join(10)
    assert sorted(console.getvalue().splitlines()) == ["[0] a", "[0] b", "[1] c"]
    assert [list(t) for t in follower.tails] == [["a\n", "b"], ["c\n"]]


class _CancelFails:
    """A TorchX runner whose job runs until Ctrl-C and whose ``cancel`` then fails."""

    cancelled = 0

    def __enter__(self) -> _CancelFails:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def scheduler_run_opts(self, name: str) -> list[tuple[str, Any]]:
        return [("log_dir", None)]

    def dryrun(self, app: Any, name: str, cfg: Any) -> Any:
        return SimpleNamespace(request="request")

    def schedule(self, info: Any) -> str:
        return "local_cwd://session/job"

    def log_lines(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        return iter(())

    polls = itertools.count()

    def status(self, handle: str) -> AppStatus:
        if next(self.polls) == 2:
            raise KeyboardInterrupt("SIGTERM")
        return AppStatus(AppState.RUNNING)

    def cancel(self, handle: str) -> None:
        type(self).cancelled += 1
        raise ConnectionError("the scheduler is unreachable")


def test_run_job_re_raises_the_interrupt_when_cancel_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler, "get_runner", _CancelFails)
    cfg = build_job_config({"launch": {"scheduler": "local_cwd", "log_dir": str(tmp_path)}})
    with pytest.raises(KeyboardInterrupt, match="SIGTERM") as err:
        app = AppDef("job", roles=[Role("train", image="", entrypoint="true")])
        scheduler.run_job(cfg, app=app, console=io.StringIO(), poll_s=0.01)
    assert _CancelFails.cancelled == 1
    assert "ConnectionError('the scheduler is unreachable')" in " ".join(err.value.__notes__)
