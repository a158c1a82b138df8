"""A SIGKILL of the ``kedro run`` process alone ends torchrun and every worker.

torchrun runs in a session of its own and so does each worker, so no signal to the
launcher's process group reaches them; the parent-death signal (``runs.parent_death``)
does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from launch.job_processes import descendants, is_worker, start_training_node, wait_for_workers
from train.helpers import REPO, tiny_job, write_token_dir

from titan_kedro.runs.parent_death import (
    AGENT_PID_ENV,
    AGENT_START_ENV,
    ORPHANED_EXIT_CODE,
    guarded_command,
)

ENDED_WITHIN_S = 10
"""The issue's bound: torchrun and every worker end this soon after the launcher's death."""

LAUNCHER = """
import subprocess, sys
from titan_kedro.runs.parent_death import guarded_command
child = subprocess.Popen(guarded_command([sys.executable, "-c", "import time; time.sleep(600)"]))
print(child.pid, flush=True)
child.wait()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src")}


def test_a_guarded_command_ends_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER)],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        child = psutil.Process(int(launcher.stdout.readline()))
        deadline = time.monotonic() + 60
        while "titan_kedro.runs.parent_death" in child.cmdline():
            assert time.monotonic() < deadline, "the wrapper never exec'd its command"
            time.sleep(0.1)
        # The wrapper became the command: a sleep of 600 s, the launcher's child.
        assert child.ppid() == launcher.pid
        launcher.kill()
        launcher.wait()
        gone, alive = psutil.wait_procs([child], timeout=ENDED_WITHIN_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    for proc in alive:
        proc.kill()
    assert not alive and gone == [child]


def test_the_wrapper_refuses_to_start_when_its_launcher_is_already_gone() -> None:
    cmd = guarded_command([sys.executable, "-c", "print('started')"])
    cmd[cmd.index("--parent-pid") + 1] = "1"  # not this process's parent
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == ORPHANED_EXIT_CODE
    assert "started" not in done.stdout and "(pid 1) is gone" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launch", "workers"),
    [({"nproc_per_node": 2}, 2), ({"scheduler": "local_cwd", "nnodes": 2}, 2)],
    ids=["local", "local_cwd"],
)
def test_killing_the_launcher_alone_ends_torchrun_and_every_worker(
    launch: dict[str, object], workers: int, tmp_path: Path
) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4000)
    job = tiny_job(tmp_path, tokens, training={"steps": 100_000}, launch=launch)
    log = tmp_path / "node.log"
    node = start_training_node(job, log)
    try:
        family = wait_for_workers(
            node, descendants(node), workers, output=lambda: log.read_text(errors="replace")
        )
        trainers = [p for p in family if is_worker(p)]
        # No signal to the launcher's process group would reach the workers.
        assert all(os.getpgid(p.pid) != os.getpgid(node.pid) for p in trainers)
        time.sleep(2)  # the workers are inside training now
        node.send_signal(signal.SIGKILL)  # the process alone, not its group
        node.wait()
        start = time.monotonic()
        gone, alive = psutil.wait_procs(family, timeout=ENDED_WITHIN_S)
        ended_in = time.monotonic() - start
    finally:
        if node.poll() is None:
            node.kill()
    leftovers = [p.cmdline() for p in alive]
    for proc in alive:
        proc.kill()
    assert not leftovers, f"still running {ENDED_WITHIN_S}s after the launcher died: {leftovers}"
    assert len(trainers) == workers and set(trainers) <= set(gone)
    assert ended_in < ENDED_WITHIN_S


AGENT_THAT_DIES = """
import os, subprocess, sys
import psutil
os.environ["TITAN_KEDRO_AGENT_PID"] = str(os.getpid())
os.environ["TITAN_KEDRO_AGENT_START"] = repr(psutil.Process().create_time())
with open(sys.argv[2], "w") as log:
    worker = subprocess.Popen(
        [sys.executable, "-m", "titan_kedro.train", "--config", sys.argv[1]],
        stdout=log, stderr=subprocess.STDOUT,
    )
print(worker.pid, flush=True)
os._exit(0)  # the agent dies before the worker sets its signal
"""


def test_a_worker_whose_agent_is_already_gone_ends_at_once(tmp_path: Path) -> None:
    # Its agent died before the worker could set its signal, and it was re-parented.
    log = tmp_path / "worker.log"
    env = {**_env(), "TORCHELASTIC_RUN_ID": "job-1"}
    agent = subprocess.run(
        [sys.executable, "-c", AGENT_THAT_DIES, str(tmp_path / "no.yaml"), str(log)],
        check=True, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    worker = int(agent.stdout.strip())
    deadline = time.monotonic() + 60
    while psutil.pid_exists(worker) and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                break
        time.sleep(0.05)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
    assert "no.yaml" not in log.read_text(), log.read_text()  # ended before reading it


_END_WITH_AGENT = (
    "from titan_kedro.runs.parent_death import end_with_agent; print(end_with_agent())"
)


def test_a_stale_agent_pid_of_a_live_process_is_ignored_with_a_warning() -> None:
    # A variable inherited from another run names a live process that is not the parent.
    other = subprocess.Popen(["sleep", "60"])
    try:
        env = {
            **_env(), "TORCHELASTIC_RUN_ID": "by-hand", AGENT_PID_ENV: str(other.pid),
            AGENT_START_ENV: repr(psutil.Process(other.pid).create_time()),
        }  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", _END_WITH_AGENT], check=False, capture_output=True,
            text=True, env=env, timeout=60,
        )  # fmt: skip
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "True"  # its signal is set, for its real parent
    assert f"ignoring {AGENT_PID_ENV}={other.pid}" in done.stderr


def test_a_stale_agent_pid_of_a_dead_agent_is_ignored_by_a_worker_started_later() -> None:
    # The named agent is gone, but the worker's parent started after it: not re-parented,
    # just started by hand (here by a shell) with the variable still set.
    gone = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(gone.pid).create_time()
    gone.kill()
    gone.wait()
    time.sleep(1.1)  # the parent below starts measurably later
    env = {
        **_env(), "TORCHELASTIC_RUN_ID": "by-hand", AGENT_PID_ENV: str(gone.pid),
        AGENT_START_ENV: repr(started),
    }  # fmt: skip
    line = f"{shlex.quote(sys.executable)} -c {shlex.quote(_END_WITH_AGENT)}; exit $?"
    done = subprocess.run(
        ["sh", "-c", line], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert f"ignoring {AGENT_PID_ENV}={gone.pid}" in done.stderr
