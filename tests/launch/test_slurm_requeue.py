"""Requeued, timed-out and warned Slurm jobs (``launch.auto_continue``,
``launch.save_before_limit_s``), no cluster."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from torchx.specs import AppDef, AppState, AppStatus, Role

from titan_kedro.config import build_job_config
from titan_kedro.launch.slurm_jobs import RequeueBound, slurm_job_id
from titan_kedro.launch.torchrun import TrainingFailedError
from titan_kedro.runs.restarts import job_restarted


def test_requeues_are_counted_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    launch = build_job_config({"launch": {"scheduler": "slurm", "auto_continue": 1}}).launch
    counts = iter([0, 1, 1, 2])
    bound = RequeueBound(launch, "slurm://torchx/93", read_count=lambda job: next(counts))
    running = AppStatus(AppState.RUNNING)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert bound.check(running) is running
    assert caplog.text.count("Slurm requeued job 93 (1 of launch.auto_continue=1)") == 1
    with pytest.raises(TrainingFailedError, match=r"requeued 2 times, more than launch\.auto"):
        bound.check(running)


def test_only_slurm_jobs_still_queued_are_read() -> None:
    launch = build_job_config({"launch": {"scheduler": "slurm"}}).launch

    def unread(job: str) -> int:
        raise AssertionError(f"read {job}")

    assert slurm_job_id("local_cwd://torchx/app-1") is None
    RequeueBound(launch, "local_cwd://torchx/app-1", read_count=unread).check(
        AppStatus(AppState.RUNNING)
    )
    RequeueBound(launch, "slurm://torchx/7", read_count=unread).check(AppStatus(AppState.SUCCEEDED))


def test_a_requeued_job_counts_as_restarted() -> None:
    assert not job_restarted({})
    assert not job_restarted({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert job_restarted({"SLURM_RESTART_COUNT": "1"})
    assert job_restarted({"TORCHELASTIC_RESTART_COUNT": "2"})


def test_a_job_ended_at_its_time_limit_is_continued_by_a_new_one() -> None:
    from titan_kedro.launch.slurm_jobs import continuable_end, continuing
    from titan_kedro.runs.restarts import own_run_ids

    def state(value: str) -> object:
        return lambda job: {"JobId": job, "JobState": value}

    assert continuable_end("slurm://torchx/9", state("TIMEOUT")) == "TIMEOUT"
    assert continuable_end("slurm://torchx/9", state("NODE_FAIL")) == "NODE_FAIL"
    assert continuable_end("slurm://torchx/9", state("FAILED")) is None  # the training's own
    assert continuable_end("slurm://torchx/9", state("CANCELLED")) is None  # a person's
    assert continuable_end("local_cwd://torchx/a", state("TIMEOUT")) is None
    app = AppDef("run", roles=[Role("train", image="/x", env={"A": "1"})])
    assert continuing(app, []) is app
    again = continuing(app, ["9", "12"])
    assert again.roles[0].env == {"A": "1", "TITAN_KEDRO_EARLIER_JOBS": "9,12"}
    assert app.roles[0].env == {"A": "1"}  # the first submission's app is left alone
    worker = {"TORCHELASTIC_RUN_ID": "13", **again.roles[0].env}
    assert job_restarted(worker) and own_run_ids(worker) == {"9", "12", "13"}


def test_before_a_time_limit_slurm_warns_the_workers_and_not_the_agent() -> None:
    from titan_kedro.launch import build_appdef
    from titan_kedro.launch.runner import get_runner
    from titan_kedro.launch.scheduler import dryrun_info

    job = {"launch": {"scheduler": "slurm", "shared_dir": "/shared", "save_before_limit_s": 90}}
    cfg = build_job_config(job)
    app = build_appdef(cfg, "/shared/job.yaml", {})
    (role,) = app.roles
    assert role.env["TITAN_KEDRO_SAVE_SIGNAL"] == "USR1"
    assert role.args[1].startswith("trap '' USR1; ")  # torchrun ignores it, the workers save
    request = dryrun_info(get_runner(), app, cfg.launch).request
    assert "--signal=USR1@90" in request.cmd
    assert "--no-requeue" not in request.cmd  # a whole job: Slurm requeues it
    job["launch"]["save_before_limit_s"] = None
    off = build_appdef(build_job_config(job), "/shared/job.yaml", {})
    assert "TITAN_KEDRO_SAVE_SIGNAL" not in off.roles[0].env and "trap" not in off.roles[0].args[1]


def test_a_warned_rank_makes_its_group_save_once(tmp_path: Path) -> None:
    import os
    import signal

    import torch.distributed as dist

    from titan_kedro.train.save_signal import SaveSignal

    assert not SaveSignal({}).enabled and SaveSignal({}).due() is False
    with pytest.raises(ValueError, match="no signal name"):
        SaveSignal({"TITAN_KEDRO_SAVE_SIGNAL": "NOPE"})
    previous = signal.getsignal(signal.SIGUSR1)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)  # fmt: skip
    try:
        warned = SaveSignal({"TITAN_KEDRO_SAVE_SIGNAL": "USR1"})
        assert warned.due() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert warned.due() is True  # the step after the warning saves …
        assert warned.due() is False  # … once
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGUSR1, previous)


def test_a_dry_run_of_groups_on_slurm_writes_one_groups_job(tmp_path: Path) -> None:
    import json

    from titan_kedro.config import dump_job_config
    from titan_kedro.launch import launch_job, prepare_job

    job = {
        "job": {"name": "run", "dump_folder": str(tmp_path / "dump")},
        "data": {"token_dir": str(tmp_path / "tokens")},
        "checkpoint": {"folder": str(tmp_path / "ckpt")},
        "fault_tolerance": {"enable": True, "replica_groups": 2},
        "launch": {"scheduler": "slurm", "nnodes": 2, "shared_dir": str(tmp_path),
                   "log_dir": str(tmp_path / "logs"), "dryrun": True,
                   "dryrun_dir": str(tmp_path / "dryrun")},
        "metrics": {"enable_mlflow": False},
    }  # fmt: skip
    cfg = prepare_job(build_job_config(job), {})
    summary = launch_job(cfg, dump_job_config(cfg, tmp_path / "job.yaml"), {})
    app = json.loads(Path(summary["appdef_file"]).read_text())
    assert app["name"] == "run-group0" and app["roles"][0]["num_replicas"] == 2
    # A group's job is not requeued by Slurm (the launcher submits it again); a whole job is.
    request = Path(summary["request_file"]).read_text()
    assert "sbatch --parsable" in request and " --no-requeue" in request
    assert app["roles"][0]["env"]["TITAN_KEDRO_REPLICA_ID"] == "0"
