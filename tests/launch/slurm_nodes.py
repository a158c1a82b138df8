"""Lose a "node" of the one-host Slurm test cluster (``tests/cluster/slurm_up.sh``) and get it back.

Each node name (n1, n2) is one ``slurmd -N <name>`` on this machine. A lost machine takes
its slurmd and everything it runs with it, so :func:`lose_node` SIGKILLs that slurmd (by
the cluster's pid file, ``SlurmdPidFile``) and every process of the one job on it (its
``slurmstepd``s and the processes whose ``SLURM_JOB_ID`` is that job), and nothing else.
slurmctld then finds the node silent: after ``SlurmdTimeout`` it sets it DOWN and ends or
requeues its job (``NODE_FAIL``; a replica group's job is not requeued). :func:`restore_node` starts the slurmd again (the node
returns by itself with ``ReturnToService=2``; else it is resumed) and waits until it is up.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil

from titan_kedro.launch.slurm_jobs import job_fields

UP = {"idle", "mix", "alloc"}
MAX_SLURMD_TIMEOUT_S = 30
"""A larger ``SlurmdTimeout`` (Slurm's default is 300 s) makes a lost node too slow to test."""


def slurm_config() -> dict[str, str]:
    """``scontrol show config`` as ``{name: value}``."""
    out = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    pairs = (line.split("=", 1) for line in out.splitlines() if " = " in line)
    return {name.strip(): value.strip() for name, value in pairs}


def node_failure_problem(config: dict[str, str]) -> str | None:
    """Why this cluster cannot lose a node in a test (None: it can)."""
    timeout = int(config.get("SlurmdTimeout", "300 sec").split()[0])
    if not 0 < timeout <= MAX_SLURMD_TIMEOUT_S:
        return (
            f"SlurmdTimeout is {timeout} s: a lost node is noticed only that late; "
            f"tests/cluster/slurm_up.sh sets 10 s (run it again)"
        )
    if config.get("ReturnToService") != "2":
        return "ReturnToService is not 2: a restarted slurmd would leave its node DOWN"
    return None


def job_node(job_id: str) -> str:
    """The node a running one-node job runs on."""
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--format=%N"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    node = out.stdout.strip()
    assert node and "," not in node and "[" not in node, (
        f"job {job_id} is not on one node: {node!r}"
    )
    return node


def node_state(node: str) -> str:
    """``sinfo``'s short state of ``node`` (``idle``, ``alloc``, ``down*`` …)."""
    out = subprocess.run(
        ["sinfo", "--noheader", "--nodes", node, "--format=%t"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return out.stdout.strip()


def _slurmd_pidfile(node: str) -> str:
    return slurm_config()["SlurmdPidFile"].replace("%n", node)


def _slurmd_alive(pidfile: str) -> bool:
    try:
        with open(pidfile) as handle:
            return psutil.pid_exists(int(handle.read().strip()))
    except (OSError, ValueError):
        return False


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every process of job ``job_id`` on this machine: its ``slurmstepd``s and the
    processes started with ``SLURM_JOB_ID=<job_id>`` (batch script, srun, torchrun, workers)."""
    stepd = re.compile(rf"^slurmstepd: \[{re.escape(job_id)}\.")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if stepd.match(" ".join(proc.info["cmdline"] or [])) or (
                proc.environ().get("SLURM_JOB_ID") == job_id
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def lose_node(node: str, job_id: str) -> int:
    """SIGKILL ``node``'s slurmd and every process of ``job_id`` (the only job on it).

    Returns:
        How many of the job's processes were killed.
    """
    pidfile = _slurmd_pidfile(node)
    with open(pidfile) as handle:
        os.kill(int(handle.read().strip()), signal.SIGKILL)
    victims = job_processes(job_id)
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return len(victims)


def restore_node(node: str, timeout_s: float = 60.0) -> None:
    """Start ``node``'s slurmd again if it is not running and wait until the node is up.

    Raises:
        AssertionError: The node did not come back within ``timeout_s``.
    """
    if not _slurmd_alive(_slurmd_pidfile(node)):
        slurmd = shutil.which("slurmd") or "/usr/sbin/slurmd"
        conf = slurm_config().get("SLURM_CONF", "/etc/slurm/slurm.conf")
        subprocess.run([slurmd, "-f", conf, "-N", node], check=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while (state := node_state(node)) not in UP and time.monotonic() < deadline:
        if "down" in state or "drain" in state:  # ReturnToService did not bring it back
            time.sleep(2)
            if node_state(node) not in UP:
                subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                               capture_output=True, timeout=30, check=False)  # fmt: skip
        time.sleep(0.5)
    assert state in UP, f"node {node} did not come back: {state!r}"


def wait_until_not_running(job_id: str, timeout_s: float) -> dict[str, str]:
    """Wait until Slurm no longer has job ``job_id`` running; its ``scontrol`` fields then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(job_id)
        if fields.get("JobState") != "RUNNING":
            return fields
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still runs {timeout_s:.0f} s after its node was lost")
