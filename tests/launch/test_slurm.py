"""Training through a real Slurm cluster: ``sbatch``, ``squeue --json`` and ``scancel``.

They need the one-host test cluster of ``tests/cluster/slurm_up.sh`` (two slurmd nodes n1
and n2 on this machine; ``.ci/run`` starts it) and fail, never skip, without it. MLflow is
a server of ours on 127.0.0.1, reached by this machine's host name (a remote job refuses
``localhost``) with a password in the URI, which must be found nowhere it could leak.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from launch.job_processes import interrupt_once_training
from mlflow.tracking import MlflowClient
from mlflow_store import mlflow_server
from small_project import small_vocab_project
from test_torchx_launch import shared_job
from train.helpers import node_job_config, rerun_here, write_token_dir

from titan_kedro.config import build_job_config, dump_job_config
from titan_kedro.launch import launch_job, prepare_job
from titan_kedro.launch.slurm_jobs import requeue_count

pytestmark = [pytest.mark.slow, pytest.mark.slurm_cluster]

HOST = socket.gethostname()
PASSWORD = "s3cret-Pa55"
TOKEN = "t0ken-Qx9"
START_HINT = (
    "the Slurm tests need the one-host test cluster: run `sudo tests/cluster/slurm_up.sh` "
    "(installs Debian's slurmctld, slurmd, slurm-client and munge if missing, starts two "
    "slurmd nodes n1/n2; `tests/cluster/slurm_up.sh --stop` stops it). .ci/run starts it."
)
STEPS = 4
SLURM = (
    "launch.scheduler=slurm,launch.nnodes=2,launch.nproc_per_node=1,launch.resources.cpus=1,"
    "launch.shared_dir={project}"
)
TINY = f"training.steps={STEPS},checkpoint.interval=2,metrics.system_metrics_interval_s=0"


def _require_cluster() -> None:
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--format=%n %t"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:
        pytest.fail(f"no sinfo on this machine. {START_HINT}")
    states = dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())
    usable = {"idle", "mix", "alloc"}
    if out.returncode or not all(states.get(n) in usable for n in ("n1", "n2")):
        pytest.fail(f"Slurm nodes n1/n2 not up ({out.stdout or out.stderr}). {START_HINT}")


def _queued(job_id: str) -> list[str]:
    """The job's components still pending or running (``squeue``'s default states)."""
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--states=PD,R,CG", "--format=%i %T"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def _job_ids(output: str) -> list[str]:
    return [line.split("slurm://torchx/")[1].split()[0] for line in output.splitlines()
            if "submitted slurm://torchx/" in line]  # fmt: skip


@dataclass
class Server:
    port: int
    client: MlflowClient

    def uri(self, auth: str = f"alice:{PASSWORD}@") -> str:
        return f"http://{auth}{HOST}:{self.port}"


def serve_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An MLflow server of ours: bound to 127.0.0.1, answering to this host's name (the
    Slurm modules' ``server`` fixture)."""
    _require_cluster()
    root = tmp_path_factory.mktemp("mlflow_server") / "server"
    with mlflow_server(root, host_names=(HOST,)) as proc:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip().isdigit(), (root / "server.log").read_text()
        port = int(line)
        yield Server(port, MlflowClient(f"http://{HOST}:{port}"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's MLflow server (``serve_mlflow``)."""
    yield from serve_mlflow(tmp_path_factory)


ENV = "slurmcheck"
TRAIN = "model_spec,training"  # the project's token files are written directly


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small-vocabulary project: Slurm's mechanics need no tokenizer or 102,400-row tables."""
    return small_vocab_project(tmp_path_factory.mktemp("slurm") / "project", ENV)


def kedro_run(
    project: Path, uri: str, params: str, pipelines: str = TRAIN, **env: str
) -> subprocess.CompletedProcess[str]:
    """``kedro run --env slurmcheck`` of ``pipelines`` in ``project``, tracking to ``uri``."""
    environ = {**os.environ, "MLFLOW_TRACKING_URI": uri, "KEDRO_DISABLE_TELEMETRY": "true", **env}
    environ.pop("MLFLOW_RUN_ID", None)
    return subprocess.run(
        [sys.executable, "-m", "kedro", "run", "--env", ENV,
         "--pipelines", pipelines, "--params", params],
        cwd=project, env=environ, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip


def _slurm_params(project: Path) -> str:
    return f"{TINY},{SLURM.format(project=project)}"


@pytest.fixture(scope="module")
def crashed(server: Server, project: Path) -> subprocess.CompletedProcess[str]:
    """2 nodes × 1 process through Slurm where rank 1 (node 1) crashes at step 3."""
    return kedro_run(
        project,
        server.uri(),
        _slurm_params(project),
        TITAN_KEDRO_TEST_HOOKS="1",
        TITAN_KEDRO_CRASH_AT_STEP="3",
        TITAN_KEDRO_CRASH_RANK="1",
    )


def requeue(job_id: str) -> None:
    """``scontrol requeue`` (how a preemption looks), then start it at once: Slurm holds a
    requeued job for about two minutes (reason ``BeginTime``). Moving its start time works
    only once it is pending again: while its processes are still being killed the update
    succeeds and the requeue then sets the hold anyway."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    released = False
    for _ in range(120):
        held = subprocess.run(
            ["squeue", "--noheader", "--jobs", job_id, "--format=%T %r"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.split()  # fmt: skip
        if "BeginTime" in held:
            update = ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]
            done = subprocess.run(update, capture_output=True, timeout=30, check=False)
            released = done.returncode == 0
        elif released and "PENDING" not in held:
            return  # started again (or already ended)
        time.sleep(0.5)
    raise AssertionError(f"requeued job {job_id} could not be released")


@pytest.fixture(scope="module")
def continued(
    crashed: subprocess.CompletedProcess[str], server: Server, project: Path
) -> subprocess.CompletedProcess[str]:
    """The crashed run continued through Slurm with ``resume=latest``; at step 4 its rank 1
    waits and the test requeues the job, which continues by itself from its latest
    checkpoint (step 2) in the same MLflow run."""
    environ = {**os.environ, "MLFLOW_TRACKING_URI": server.uri(), "KEDRO_DISABLE_TELEMETRY": "true",
               "TITAN_KEDRO_TEST_HOOKS": "1", "TITAN_KEDRO_CRASH_AT_STEP": "4",
               "TITAN_KEDRO_CRASH_RANK": "1", "TITAN_KEDRO_CRASH_HANG": "1"}  # fmt: skip
    environ.pop("MLFLOW_RUN_ID", None)
    params = f"{_slurm_params(project)},checkpoint.resume=latest"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kedro", "run", "--env", ENV,
         "--pipelines", TRAIN, "--params", params],
        cwd=project, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "waits to be killed at step 4" in line:
                requeue(_job_ids("".join(lines))[0])
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), "")


@pytest.fixture(scope="module")
def reference(
    continued: subprocess.CompletedProcess[str],
    project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, float]:
    """The Slurm job's own resolved config, trained here by torchrun on 1 node × 2 processes."""
    losses = rerun_here(
        node_job_config(project / "data" / "07_model_output" / "job"),
        tmp_path_factory.mktemp("local_reference"),
        nproc=2,
    )
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@dataclass
class SlurmRuns:
    crashed: subprocess.CompletedProcess[str]
    continued: subprocess.CompletedProcess[str]
    job_ids: list[str]
    slurm_run_id: str
    run_ids: list[str]


@pytest.fixture(scope="module")
def slurm_runs(
    crashed: subprocess.CompletedProcess[str],
    continued: subprocess.CompletedProcess[str],
    server: Server,
) -> SlurmRuns:
    """Both Slurm runs, their job ids and MLflow runs (each fixture above is one step, so no
    single test carries the cost of all of them)."""
    experiment = server.client.get_experiment_by_name("titan_kedro")
    runs = server.client.search_runs(
        [experiment.experiment_id], order_by=["attributes.start_time ASC"]
    )
    return SlurmRuns(
        crashed,
        continued,
        _job_ids(crashed.stdout + crashed.stderr) + _job_ids(continued.stdout + continued.stderr),
        runs[0].info.run_id,
        [r.info.run_id for r in runs],
    )


def test_a_failed_replica_ends_the_run_naming_it_with_its_log_tail(
    crashed: subprocess.CompletedProcess[str],
) -> None:
    out = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0, out[-4000:]
    assert "TrainingFailedError" in out and "ended FAILED" in out, out[-4000:]
    # The rendezvous, not the Slurm replica index, places rank 1: the message must name the
    # replica whose output holds the crash.
    section = r"--- node (\d) output \(last \d+ lines\) ---\n(.*?)(?:\n(?:\[rank0\]: )*--- |\Z)"
    named = re.search(section, out, re.S)
    assert named, out[-4000:]
    assert "[fault injection] rank 1 exits at step 3" in named.group(2), out[-4000:]
    (job_id,) = _job_ids(out)
    assert not _queued(job_id)


def test_two_slurm_nodes_train_like_one_and_continue_the_same_run(
    slurm_runs: SlurmRuns, reference: dict[int, float], server: Server
) -> None:
    out = slurm_runs.continued.stdout + slurm_runs.continued.stderr
    assert slurm_runs.continued.returncode == 0, out[-6000:]
    assert len(slurm_runs.run_ids) == 1, "continuing must reopen the crashed run, not add one"
    history = server.client.get_metric_history(slurm_runs.slurm_run_id, "loss")
    assert {m.step for m in history} == set(range(1, STEPS + 1))
    for m in history:  # steps 1-2 before the crash, 3-4 after continuing from step 2
        assert abs(m.value - reference[m.step]) <= 1e-4, (m.step, m.value)
    assert len(slurm_runs.job_ids) == 2 and not any(_queued(j) for j in slurm_runs.job_ids)
    # The requeued job (same id) continued from step 2 by itself, in the same MLflow run.
    assert requeue_count(slurm_runs.job_ids[1]) == 1, out[-6000:]
    assert [m.step for m in sorted(history, key=lambda m: m.timestamp)][-2:] == [3, 4]
    assert [m.step for m in history].count(3) == 2  # step 3 before and after the requeue


def _files_with(root: Path, secret: str) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if secret.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                continue
    return found


def _state_environment(job_id: str) -> dict[str, str]:
    """The environment slurmctld keeps for the job (what ``sbatch`` exported)."""
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=False
    )
    state = next(
        line.split("=", 1)[1].strip()
        for line in config.stdout.splitlines() if line.startswith("StateSaveLocation")
    )  # fmt: skip
    files = list(Path(state).glob(f"hash.*/job.{job_id}/environment"))
    assert files, f"no stored environment for job {job_id} under {state}"
    text = files[0].read_bytes().decode(errors="replace")
    return dict(v.split("=", 1) for v in text.split("\0") if "=" in v)


def test_the_password_is_found_nowhere(
    slurm_runs: SlurmRuns, server: Server, project: Path
) -> None:
    outputs = [slurm_runs.crashed, slurm_runs.continued]
    for proc in outputs:
        assert PASSWORD not in proc.stdout + proc.stderr
    assert _files_with(project, PASSWORD) == []
    for job_id in slurm_runs.job_ids:
        script = subprocess.run(
            ["scontrol", "write", "batch_script", job_id, "-"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert script.returncode == 0 and "#SBATCH" in script.stdout, script.stderr
        assert PASSWORD not in script.stdout and "alice" not in script.stdout
        # The credentials travelled by name in the submitter's environment, the URI clean.
        env = _state_environment(job_id)
        assert env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD
        assert env["MLFLOW_TRACKING_USERNAME"] == "alice"
        assert env["MLFLOW_TRACKING_URI"] == server.uri(auth="")
    for run_id in slurm_runs.run_ids:
        data = server.client.get_run(run_id).data
        fields = {**data.params, **data.tags, **{k: k for k in data.metrics}}
        # The user name is no secret: MLflow attributes the run to the user it logs in as
        # (MLFLOW_TRACKING_USERNAME) in mlflow.user, and nowhere else may it appear.
        assert fields.pop("mlflow.user", None) in ("alice", None)
        leaked = {k: v for k, v in fields.items() if PASSWORD in f"{k}{v}" or "alice" in f"{k}{v}"}
        assert not leaked, leaked


def test_sigint_cancels_the_slurm_job_and_leaves_no_worker(server: Server, project: Path) -> None:
    params = f"training.steps=100000,{SLURM.format(project=project)}"
    environ = {**os.environ, "MLFLOW_TRACKING_URI": server.uri(), "KEDRO_DISABLE_TELEMETRY": "true"}
    environ.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kedro", "run", "--env", ENV,
         "--pipelines", TRAIN, "--params", params],
        cwd=project, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def job() -> tuple[list[psutil.Process], list[psutil.Process]]:
        workers = _workers(project)
        return _agents(project) + workers, workers

    output, family = interrupt_once_training(proc, job, start_timeout_s=600, exit_timeout_s=180)
    assert proc.returncode != 0 and "cancelling" in output, output[-4000:]
    (job_id,) = _job_ids(output)
    assert _queued(job_id) == [], "the job is still in the queue"
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def _processes(project: Path, *, agent: bool) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "titan_kedro.train" in cmd and any(str(project) in a for a in cmd):
            if ("torch.distributed.run" in cmd) == agent:
                found.append(p)
    return found


def _workers(project: Path) -> list[psutil.Process]:
    return _processes(project, agent=False)


def _agents(project: Path) -> list[psutil.Process]:
    return _processes(project, agent=True)


def _tiny_slurm_job(root: Path, **launch: object) -> dict[str, object]:
    job = shared_job(root, scheduler="slurm", nnodes=2, nproc_per_node=1, **launch)
    job["launch"]["resources"] = {"cpus": 1}
    job["metrics"] = {**job["metrics"], "system_metrics_interval_s": 0}
    job["checkpoint"] = {**job["checkpoint"], "enable": False}
    return job


def test_an_error_after_submission_cancels_a_token_uri_job_that_shows_no_token(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``?token=`` URI: the nodes log to MLflow without it; then an error of ours while
    following the job (describing it fails once) cancels the job."""
    from torchx.runner import Runner

    monkeypatch.chdir(tmp_path)  # Slurm writes the replicas' logs into the submit folder
    write_token_dir(tmp_path / "tokens", n_train=4000)
    run = server.client.create_run(server.client.create_experiment("token-uri"))
    env = {
        "MLFLOW_RUN_ID": run.info.run_id,
        "MLFLOW_TRACKING_URI": f"{server.uri(auth='')}/?token={TOKEN}",
    }
    job = _tiny_slurm_job(tmp_path)
    job["training"] = {**job["training"], "steps": 100_000}
    cfg = prepare_job(build_job_config(job), env)
    handles: list[str] = []
    status = Runner.status

    def failing_status(self: Runner, handle: str) -> object:
        handles.append(handle)
        logged = server.client.get_metric_history(run.info.run_id, "loss")
        if len(logged) >= 2 and not any(h == "raised" for h in handles):
            handles.append("raised")  # once: cancelling asks for the state again
            raise RuntimeError("injected: describing the job failed")
        return status(self, handle)

    monkeypatch.setattr(Runner, "status", failing_status)
    console = io.StringIO()
    with pytest.raises(RuntimeError, match="injected"):
        launch_job(
            cfg, dump_job_config(cfg, tmp_path / "job" / "job_config.yaml"), env, console=console
        )
    monkeypatch.undo()
    job_id = handles[0].rsplit("/", 1)[1]
    assert _queued(job_id) == [], "the job is still in the queue"
    assert TOKEN not in console.getvalue() and "[node 1]" in console.getvalue()
    assert _files_with(tmp_path, TOKEN) == []
    script = subprocess.run(
        ["scontrol", "write", "batch_script", job_id, "-"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "#SBATCH" in script.stdout and TOKEN not in script.stdout
    assert _state_environment(job_id)["MLFLOW_TRACKING_TOKEN"] == TOKEN  # by name
    data = server.client.get_run(run.info.run_id).data
    assert TOKEN not in json.dumps([data.params, data.tags])
