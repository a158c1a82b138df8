"""Fault-tolerant replica groups as Slurm jobs on the one-host test cluster (2 groups × 1 × 1).

One run answers most checks: group 1's rank waits at step 4 (a test hook) and the test
``scancel``s its job, as a lost node looks to Slurm, and sends group 0 the signal Slurm
sends before a time limit (group 0 saves a checkpoint at the next step and trains on). The launcher submits the group again,
it heals from group 0, and both finish 8 steps in one MLflow run. A second, short launch is
interrupted (Ctrl-C, in this process, right after submitting) and must leave nothing in
``squeue`` and no lighthouse port open.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_store import mlflow_server
from small_project import small_vocab_project
from test_slurm import (
    HOST,
    PASSWORD,
    TRAIN,
    Server,
    _files_with,
    _queued,
    _require_cluster,
    _state_environment,
)
from test_torchx_launch import shared_job
from train.helpers import node_job_config, rerun_here, write_token_dir

from titan_kedro.config import build_job_config, dump_job_config
from titan_kedro.launch import launch_job, prepare_job

pytestmark = [pytest.mark.slow, pytest.mark.slurm_cluster]

ENV = "slurmft"
STEPS = 8
FT = (
    "fault_tolerance.enable=true,fault_tolerance.replica_groups=2,"
    "fault_tolerance.heartbeat_timeout_s=2.0,fault_tolerance.step_timeout_s=20.0,"
    "launch.scheduler=slurm,launch.nnodes=1,launch.nproc_per_node=1,launch.resources.cpus=1,"
    "metrics.system_metrics_interval_s=0,launch.shared_dir={project}"
)
SUBMITTED = re.compile(r"\[group (\d)\] submitted slurm://torchx/(\d+) \(attempt (\d)\)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An MLflow server of ours on 127.0.0.1, answering to this host's name (``test_slurm``)."""
    _require_cluster()
    root = tmp_path_factory.mktemp("mlflow_server") / "server"
    with mlflow_server(root, host_names=(HOST,)) as proc:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip().isdigit(), (root / "server.log").read_text()
        yield Server(int(line), MlflowClient(f"http://{HOST}:{int(line)}"))


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_vocab_project(tmp_path_factory.mktemp("slurmft") / "project", ENV)


def _kedro(project: Path, server: Server, params: str, **env: str) -> subprocess.Popen[str]:
    environ = {**os.environ, "MLFLOW_TRACKING_URI": server.uri(), "OMP_NUM_THREADS": "1",
               "KEDRO_DISABLE_TELEMETRY": "true", **env}  # fmt: skip
    environ.pop("MLFLOW_RUN_ID", None)
    return subprocess.Popen(
        [sys.executable, "-m", "kedro", "run", "--env", ENV, "--pipelines", TRAIN,
         "--params", f"{FT.format(project=project)},{params}"],
        cwd=project, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@dataclass
class HealedRun:
    output: str
    returncode: int
    jobs: dict[int, list[str]]
    """Group → its Slurm job ids, one per attempt."""
    killed_at: float
    run_id: str
    seconds: float


@pytest.fixture(scope="module")
def healed(project: Path, server: Server) -> HealedRun:
    """The run whose group 1 is ``scancel``ed at step 4 (it waits there for the test)."""
    start = time.monotonic()
    proc = _kedro(
        project, server, f"training.steps={STEPS},checkpoint.interval=100",
        TITAN_KEDRO_TEST_HOOKS="1", TITAN_KEDRO_CRASH_AT_STEP="4", TITAN_KEDRO_CRASH_GROUP="1",
        TITAN_KEDRO_CRASH_HANG="1", TITAN_KEDRO_DEGRADED_STEP_DELAY_S="12",
    )  # fmt: skip
    lines, jobs, killed_at = [], {}, 0.0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if found := SUBMITTED.search(line):
                jobs.setdefault(int(found.group(1)), []).append(found.group(2))
            if "[group 1]" in line and "waits to be killed at step 4" in line and not killed_at:
                # Group 0 is warned as before a time limit (what sbatch --signal sends) …
                subprocess.run(["scancel", "--signal=USR1", jobs[0][0]], check=True)
                subprocess.run(["scancel", jobs[1][0]], check=True)  # … group 1 is lost
                killed_at = time.monotonic()
            if time.monotonic() - start > 600:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    (project.parent / "healed.log").write_text("".join(lines))  # to read when a check fails
    experiment = server.client.get_experiment_by_name("titan_kedro")
    runs = server.client.search_runs([experiment.experiment_id])
    return HealedRun(
        "".join(lines), proc.returncode, jobs, killed_at, runs[0].info.run_id,
        time.monotonic() - start,
    )  # fmt: skip


def _history(server: Server, run_id: str, key: str) -> list[tuple[int, float]]:
    history = server.client.get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def test_a_scancelled_group_job_is_submitted_again_and_heals(
    healed: HealedRun, server: Server, project: Path, tmp_path: Path
) -> None:
    out = healed.output
    assert healed.returncode == 0, out[-6000:]
    assert healed.killed_at, out[-4000:]
    assert len(healed.jobs[0]) == 1 and len(healed.jobs[1]) == 2, healed.jobs
    assert "submitting it again to heal from a live group" in out
    assert re.search(r"\[group 1\].*replica group 1 healed from a live peer at step \d+", out)
    losses = dict(_history(server, healed.run_id, "loss"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    participants = [int(v) for _, v in _history(server, healed.run_id, "ft/participants")]
    assert participants[:3] == [2, 2, 2] and 1 in participants and participants[-1] == 2
    assert participants == sorted(participants[:3]) + participants[3:]  # 2 … → 1 … → 2
    first_one = participants.index(1)
    assert all(p == 1 for p in participants[first_one : participants.index(2, first_one)])
    # Both groups end in lock-step: their final states are bitwise equal.
    digests = [
        json.loads(p.read_text())
        for p in sorted((project / "data" / "07_model_output" / "job").rglob("replica-*.json"))
    ]
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0]["step"] == STEPS
    # Each group's Slurm job ids and resubmissions are on the run.
    tags = server.client.get_run(healed.run_id).data.tags
    assert tags["slurm.job_ids.group_0"] == healed.jobs[0][0]
    assert tags["slurm.job_ids.group_1"] == ",".join(healed.jobs[1])
    assert (tags["ft.restarts.group_0"], tags["ft.restarts.group_1"]) == ("0", "1")
    assert not any(_queued(j) for ids in healed.jobs.values() for j in ids)
    # Group 0 saved at the step after the warning (the interval is 100) and trained on.
    run_folder = project / "data" / "06_models" / "checkpoints" / healed.run_id
    saved = sorted(int(p.name.split("-")[1]) for p in run_folder.glob("step-*"))
    assert len(saved) == 2 and 4 <= saved[0] < STEPS and saved[1] == STEPS, saved
    assert "saving a checkpoint" in out
    # Before the fault, 2 groups as 2 Slurm jobs train like HSDP with 2 replicas.
    hsdp = rerun_here(
        node_job_config(project / "data" / "07_model_output" / "job"),
        tmp_path / "hsdp",
        nproc=2,
        training={"steps": 3},
        fault_tolerance={"enable": False, "replica_groups": 1},
        parallelism={"data_parallel_replicate_degree": 2},
    )
    assert sorted(hsdp) == [1, 2, 3]
    for step, loss in hsdp.items():
        assert abs(losses[step] - loss) <= 1e-5, (step, losses[step], loss)


def test_no_group_job_shows_the_password(healed: HealedRun, server: Server, project: Path) -> None:
    assert PASSWORD not in healed.output
    assert _files_with(project, PASSWORD) == []
    for job_id in [j for ids in healed.jobs.values() for j in ids]:
        script = subprocess.run(
            ["scontrol", "write", "batch_script", job_id, "-"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert "#SBATCH" in script.stdout and PASSWORD not in script.stdout, script.stderr
        assert _state_environment(job_id)["MLFLOW_TRACKING_PASSWORD"] == PASSWORD  # by name
    data = server.client.get_run(healed.run_id).data
    assert PASSWORD not in json.dumps([data.params, data.tags])


class _InterruptAfterSubmitting(io.StringIO):
    """A console that raises SIGINT (Ctrl-C) in this process once group 1 is submitted."""

    def write(self, text: str) -> int:
        written = super().write(text)
        if "[group 1] submitted slurm://" in text:
            signal.raise_signal(signal.SIGINT)
        return written


def test_ctrl_c_cancels_every_group_job(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # Slurm writes the replicas' logs into the submit folder
    write_token_dir(tmp_path / "tokens", n_train=4000)
    job = shared_job(tmp_path, scheduler="slurm", nnodes=1, nproc_per_node=1)
    job["launch"]["resources"] = {"cpus": 1}
    job["checkpoint"] = {**job["checkpoint"], "enable": False}
    job["fault_tolerance"] = {"enable": True, "replica_groups": 2}
    run = server.client.create_run(server.client.create_experiment("ctrl-c"))
    env = {"MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_TRACKING_URI": server.uri()}
    cfg = prepare_job(build_job_config(job), env)
    console = _InterruptAfterSubmitting()
    with pytest.raises(KeyboardInterrupt):
        launch_job(cfg, dump_job_config(cfg, tmp_path / "job" / "job_config.yaml"), env,
                   console=console)  # fmt: skip
    out = console.getvalue()
    ids = SUBMITTED.findall(out)
    assert sorted(g for g, _, _ in ids) == ["0", "1"], out
    assert all(_queued(job_id) == [] for _, job_id, _ in ids), "a group's job is still queued"
    assert PASSWORD not in out
    lighthouse = re.search(r"\[ft\] lighthouse http://127\.0\.0\.1:(\d+)", out)
    assert lighthouse, out
    with socket.socket() as sock:  # the lighthouse stopped with the launch
        assert sock.connect_ex(("127.0.0.1", int(lighthouse.group(1)))) != 0
