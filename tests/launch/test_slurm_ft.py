"""Fault-tolerant replica groups as Slurm jobs on the one-host test cluster (2 groups × 1 × 1).

One run answers most checks. Each group's job takes a whole node (2 CPUs), so a node holds
one group. Steps 1–8 run without a fault (compared with HSDP). Before step 9 group 1's rank
waits (a test hook) and the test loses the node its job runs on: it SIGKILLs that node's
``slurmd`` and every process of the job (``slurm_nodes.lose_node``), as when a machine
dies. It also sends group 0 the signal Slurm sends before a time limit (group 0 saves a
checkpoint at its next step and trains on). Group 0 trains on alone; slurmctld finds the
node silent after ``SlurmdTimeout`` and ends the job ``NODE_FAIL`` (a group's job is
submitted with ``--no-requeue``); the launcher submits the group again, the test starts the
node's slurmd again, the new job starts there, heals from group 0, and both finish in one
MLflow run. A second run of the same job has group 1's job ``scancel``-ed instead (it ends
CANCELLED at once) and must be submitted again and heal the same way. The runs are launched in this
process (``prepare_job`` and ``launch_job``, what the training node calls), not by
``kedro run``, whose start (about 45 s) ``test_slurm.py`` already pays. A second, short
launch is interrupted (Ctrl-C, in this process, right after submitting) and must leave
nothing in ``squeue`` and no lighthouse port open.
"""

from __future__ import annotations

import io
import json
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from launch.slurm_nodes import (
    UP,
    job_node,
    lose_node,
    node_failure_problem,
    node_state,
    restore_node,
    slurm_config,
    wait_until_not_running,
)
from test_slurm import (
    PASSWORD,
    Server,
    _files_with,
    _queued,
    _state_environment,
    serve_mlflow,
)
from test_torchx_launch import shared_job
from train.helpers import TINY_DEEPSEEK, rerun_here, write_token_dir

from titan_kedro.config import build_job_config, dump_job_config
from titan_kedro.launch import launch_job, prepare_job
from titan_kedro.launch.slurm_jobs import requeue_count

pytestmark = [pytest.mark.slow, pytest.mark.slurm_cluster]

STEPS = 24
FAULT_STEP = 9
"""Group 1's node is lost before this step: steps 1–8 run without a fault."""
DEGRADED_DELAY_S = 8.0
"""Each step group 0 takes alone sleeps this long (a test hook), so that it is still
training when group 1 comes back: noticing the lost node takes Slurm about 30 s, the new
job's start about 15 s more, longer while other tests hold the nodes. The 16 steps after
the fault cost that long only while group 1 is away."""
QUORUM_TIMEOUT_S = 20.0
HOOKS = {
    "TITAN_KEDRO_TEST_HOOKS": "1", "TITAN_KEDRO_CRASH_AT_STEP": str(FAULT_STEP),
    "TITAN_KEDRO_CRASH_GROUP": "1", "TITAN_KEDRO_CRASH_HANG": "1",
    "TITAN_KEDRO_DEGRADED_STEP_DELAY_S": str(DEGRADED_DELAY_S), "OMP_NUM_THREADS": "1",
}  # fmt: skip
SUBMITTED = re.compile(r"\[group (\d)\] submitted slurm://torchx/(\d+) \(attempt (\d)\)")
HANGS = f"waits to be killed at step {FAULT_STEP}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's MLflow server (``test_slurm.serve_mlflow``)."""
    yield from serve_mlflow(tmp_path_factory)


def _job(root: Path) -> dict[str, Any]:
    job = shared_job(root, scheduler="slurm", nnodes=1, nproc_per_node=1, timeout_s=480)
    job["launch"]["resources"] = {"cpus": 2}  # a whole node: losing it loses one group
    job["model"]["overrides"] = TINY_DEEPSEEK  # the token files' 512-token vocabulary
    job["parallelism"] = {"expert_parallel_degree": 1}
    job["training"]["steps"] = STEPS
    job["metrics"]["system_metrics_interval_s"] = 0
    job["fault_tolerance"] = {
        "enable": True, "replica_groups": 2, "heartbeat_timeout_s": 2.0,
        "step_timeout_s": 20.0, "quorum_timeout_s": QUORUM_TIMEOUT_S,
        "join_timeout_s": 300.0,  # the startup barrier waits while other tests hold the nodes
    }  # fmt: skip
    return job


@dataclass
class HealedRun:
    output: str
    error: BaseException | None
    jobs: dict[int, list[str]]
    """Group → its Slurm job ids, one per submission by the launcher."""
    run_id: str
    root: Path
    fault: dict[str, Any] = field(default_factory=dict)
    """What the fault thread did and saw: node, killed (processes), lost_at, ended (the
    job's ``scontrol`` fields once Slurm noticed), noticed_s, hsdp ({step: loss}), error."""


def _hsdp_reference(config: Path, fault: dict[str, Any]) -> None:
    """HSDP with 2 replicas on this machine from the job's own config (the same steps, so
    the same learning-rate schedule), without the test hooks."""
    try:
        fault["hsdp"] = rerun_here(
            config, config.parent.parent / "hsdp", nproc=2, env={"TITAN_KEDRO_TEST_HOOKS": "0"},
            fault_tolerance={"enable": False, "replica_groups": 1},
            parallelism={"data_parallel_replicate_degree": 2},
        )  # fmt: skip
    except BaseException as err:
        fault["hsdp_error"] = err


def _lose_group_1_node(
    console: io.StringIO, done: threading.Event, config: Path, fault: dict[str, Any]
) -> None:
    """The fault thread: once group 1 waits, warn group 0 and lose group 1's node (the HSDP
    reference trains meanwhile: the CPUs are idle while Slurm notices); once Slurm has
    ended the job, bring the node back (the launcher's new job waits for it)."""
    node, jobs, reference = None, {}, threading.Thread(target=_hsdp_reference, args=(config, fault))
    try:
        while HANGS not in console.getvalue():
            if done.wait(0.2):
                return
        jobs = {int(g): job for g, job, _ in SUBMITTED.findall(console.getvalue())}
        subprocess.run(["scancel", "--signal=USR1", jobs[0]], check=True, timeout=30)
        node = fault["node"] = job_node(jobs[1])
        fault["killed"] = lose_node(node, jobs[1])
        fault["lost_at"] = time.monotonic()
        reference.start()
        fault["ended"] = wait_until_not_running(jobs[1], timeout_s=120)
        fault["noticed_s"] = time.monotonic() - fault["lost_at"]
    except BaseException as err:  # reported by the test; the run must still end
        fault["error"] = err
        for job in jobs.values():
            subprocess.run(["scancel", job], check=False, timeout=30)
    finally:
        try:
            if node is not None:
                restore_node(node)
        except BaseException as err:
            fault["restore_error"] = err
        finally:
            if reference.ident is not None:
                reference.join(600)


def _cancel_group_1(
    console: io.StringIO, done: threading.Event, config: Path, fault: dict[str, Any]
) -> None:
    """The fault thread of the second run: once group 1 waits, ``scancel`` its job (what an
    administrator, or a preemption that does not requeue, does to one group)."""
    jobs: dict[int, str] = {}
    try:
        while HANGS not in console.getvalue():
            if done.wait(0.2):
                return
        jobs = {int(g): job for g, job, _ in SUBMITTED.findall(console.getvalue())}
        subprocess.run(["scancel", jobs[1]], check=True, timeout=30)
        fault["ended"] = wait_until_not_running(jobs[1], timeout_s=120)
    except BaseException as err:  # reported by the test; the run must still end
        fault["error"] = err
        for job in jobs.values():
            subprocess.run(["scancel", job], check=False, timeout=30)


def _healed_run(server: Server, root: Path, name: str, lose: Callable[..., None]) -> HealedRun:
    """Launch the 2-group job with ``lose`` as its fault thread; the run once it ended."""
    write_token_dir(root / "tokens")
    run = server.client.create_run(server.client.create_experiment(name))
    env = {"MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_TRACKING_URI": server.uri()}
    console, done, fault, error = io.StringIO(), threading.Event(), {}, None
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # Slurm writes the groups' logs into the submit folder
        for key, value in HOOKS.items():
            patch.setenv(key, value)  # sbatch hands this environment to the jobs
        cfg = prepare_job(build_job_config(_job(root)), env)
        config = dump_job_config(cfg, root / "job" / "job_config.yaml")
        thread = threading.Thread(target=lose, args=(console, done, config, fault))
        thread.start()
        try:
            launch_job(cfg, config, env, console=console)
        except Exception as err:  # the tests report it with the output
            error = err
        finally:
            done.set()
            thread.join(300)
    (root / f"{name}.log").write_text(console.getvalue())  # to read when a check fails
    jobs: dict[int, list[str]] = {}
    for group, job, _ in SUBMITTED.findall(console.getvalue()):
        jobs.setdefault(int(group), []).append(job)
    return HealedRun(console.getvalue(), error, jobs, run.info.run_id, root, fault)


@pytest.fixture(scope="module")
def healed(server: Server, tmp_path_factory: pytest.TempPathFactory) -> HealedRun:
    """The run whose group 1 loses its node before step 9 (see the module docstring)."""
    problem = node_failure_problem(slurm_config())
    assert problem is None, problem
    return _healed_run(server, tmp_path_factory.mktemp("slurmft"), "healed", _lose_group_1_node)


@pytest.fixture(scope="module")
def cancelled(server: Server, tmp_path_factory: pytest.TempPathFactory) -> HealedRun:
    """The same job, whose group 1's job is ``scancel``-ed before step 9."""
    return _healed_run(server, tmp_path_factory.mktemp("scancel"), "cancelled", _cancel_group_1)


def _history(server: Server, run_id: str, key: str) -> dict[int, Any]:
    """``{step: metric}`` (the latest value logged for each step)."""
    history = sorted(server.client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m for m in history}


def _assert_group_1_came_back_and_healed(run: HealedRun, server: Server) -> None:
    """Every step's loss logged; ``ft/participants`` 2 → 1 (from the fault step) → 2, the new
    job healing where it comes back; both groups' final states bitwise equal."""
    losses = {step: m.value for step, m in _history(server, run.run_id, "loss").items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    participants = [int(m.value) for _, m in sorted(
        _history(server, run.run_id, "ft/participants").items())]  # fmt: skip
    alone = [step for step, p in enumerate(participants, 1) if p == 1]
    assert participants[: FAULT_STEP - 1] == [2] * (FAULT_STEP - 1), participants
    assert alone and alone == list(range(FAULT_STEP, alone[-1] + 1)), participants  # 2 → 1 → 2
    assert participants[alone[-1] :] == [2] * (STEPS - alone[-1]), participants
    healed_at = _history(server, run.run_id, "ft/healed_groups")
    assert list(healed_at) == [alone[-1] + 1], healed_at  # group 1's new job healed there
    digests = [
        json.loads(p.read_text()) for p in sorted((run.root / "job").rglob("replica-*.json"))
    ]
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0]["step"] == STEPS


def test_a_scancelled_group_job_is_submitted_again_and_heals(
    cancelled: HealedRun, server: Server
) -> None:
    out, fault = cancelled.output, cancelled.fault
    assert cancelled.error is None and "error" not in fault, (cancelled.error, fault, out[-6000:])
    (job_0,), (job_1, again) = cancelled.jobs[0], cancelled.jobs[1]
    assert f"[group 1] job slurm://torchx/{job_1} ended CANCELLED; submitting it again" in out
    _assert_group_1_came_back_and_healed(cancelled, server)
    _assert_group_0_never_waited(cancelled, server)
    tags = server.client.get_run(cancelled.run_id).data.tags
    assert tags["slurm.job_ids.group_1"] == f"{job_1},{again}"
    assert (tags["ft.restarts.group_0"], tags["ft.restarts.group_1"]) == ("0", "1")
    assert not any(_queued(job) for job in (job_0, job_1, again))


def test_a_group_whose_node_is_lost_is_submitted_again_and_heals(
    healed: HealedRun, server: Server
) -> None:
    out, fault = healed.output, healed.fault
    assert healed.error is None and "error" not in fault, (healed.error, fault, out[-6000:])
    assert "restore_error" not in fault, fault
    # The node went with the job's processes (slurmstepd, batch script, srun, torchrun,
    # worker); Slurm noticed by itself and ended the job, and the launcher submitted it again.
    assert fault["killed"] >= 4, fault
    assert fault["ended"]["JobState"] == "NODE_FAIL", fault
    (job_0,), (job_1, again) = healed.jobs[0], healed.jobs[1]
    assert f"[group 1] job slurm://torchx/{job_1} ended FAILED; submitting it again" in out
    assert requeue_count(job_1) == 0  # not requeued by Slurm as well
    assert node_state(fault["node"]) in UP
    _assert_group_1_came_back_and_healed(healed, server)
    tags = server.client.get_run(healed.run_id).data.tags
    assert (tags["slurm.job_ids.group_0"], tags["slurm.job_ids.group_1"]) == (
        job_0, f"{job_1},{again}")  # fmt: skip
    assert (tags["ft.restarts.group_0"], tags["ft.restarts.group_1"]) == ("0", "1")
    assert not any(_queued(job) for job in (job_0, job_1, again))
    # Group 0 saved at its step after the warning (the interval is 100) and trained on; the
    # warning came once group 1 had finished step 8, maybe before group 0 decided on step 8.
    saved = sorted(int(p.name.split("-")[1]) for p in (healed.root / "ckpt").rglob("step-*"))
    assert len(saved) == 2 and FAULT_STEP - 1 <= saved[0] < STEPS and saved[1] == STEPS, saved


def test_without_a_fault_two_group_jobs_train_like_hsdp_with_2_replicas(
    healed: HealedRun, server: Server
) -> None:
    """Steps 1–8 ran with both groups (checked above). In such a step group g's rank reads
    share g of the global batch and the groups average their gradients, which is what HSDP
    with ``data_parallel_replicate_degree=2`` does with its 2 replicas from the same seed:
    the losses agree to float rounding (the order of the additions differs)."""
    assert "hsdp_error" not in healed.fault, healed.fault.get("hsdp_error")
    hsdp = healed.fault["hsdp"]
    losses = {step: m.value for step, m in _history(server, healed.run_id, "loss").items()}
    assert sorted(hsdp) == list(range(1, STEPS + 1))
    for step, loss in sorted(hsdp.items())[: FAULT_STEP - 1]:
        assert abs(losses[step] - loss) <= 1e-5, (step, losses[step], loss)


def test_group_0_never_waits_longer_than_the_quorum_timeout_plus_a_step(
    healed: HealedRun, server: Server
) -> None:
    """From the leader's (group 0's) loss timestamps: each step ends at most the quorum
    timeout plus one step after the one before. One step is the slowest fault-free step of
    this run, plus the test's sleep while group 0 trains alone. Group 1 was away far longer
    than that bound, so group 0 did not wait for it."""
    away, one_step = _assert_group_0_never_waited(healed, server)
    assert away > QUORUM_TIMEOUT_S + DEGRADED_DELAY_S + one_step, away


def _assert_group_0_never_waited(run: HealedRun, server: Server) -> tuple[float, float]:
    """Every gap between two of the leader's steps is at most the quorum timeout plus one
    step (the slowest fault-free step, plus the test's sleep while group 0 trains alone);
    returns how long group 1 was away (last fault-free step to the first shared one again)
    and that step."""
    ends = {step: m.timestamp / 1000 for step, m in _history(server, run.run_id, "loss").items()}
    alone = {step for step, m in _history(server, run.run_id, "ft/participants").items()
             if m.value < 2}  # fmt: skip
    gaps = {step: ends[step] - ends[step - 1] for step in range(2, STEPS + 1)}
    one_step = max(gaps[step] for step in range(2, FAULT_STEP))
    for step, gap in gaps.items():
        bound = QUORUM_TIMEOUT_S + one_step + (DEGRADED_DELAY_S if step in alone else 0.0)
        assert gap <= bound, (step, gap, bound, gaps)
    return ends[max(alone) + 1] - ends[FAULT_STEP - 1], one_step


def test_no_group_job_shows_the_password(healed: HealedRun, server: Server) -> None:
    assert PASSWORD not in healed.output
    assert _files_with(healed.root, PASSWORD) == []
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
