"""A local launch's torchrun stores listen on loopback only, and rendezvous ids are random."""

from __future__ import annotations

import io
import time
from pathlib import Path

import psutil

from titan_kedro.config import build_job_config
from titan_kedro.launch.torchrun import follow_torchrun, start_torchrun, torchrun_command

LOOPBACK = {"127.0.0.1", "::1"}


def test_a_local_agents_stores_listen_on_loopback_only(tmp_path: Path) -> None:
    """torch's rendezvous unpickles from these stores: nothing off this machine may reach
    them (before, the c10d store opened for localhost listened on ``[::]``)."""
    cfg = build_job_config({"launch": {"log_dir": str(tmp_path / "logs")}})
    script = tmp_path / "idle.py"
    script.write_text("import time; time.sleep(2)\n")
    # The local launcher's own command, with a worker that only waits.
    command = torchrun_command(cfg.launch, tmp_path / "job.yaml", loopback=True)[:-4]
    group = start_torchrun(cfg.launch, tmp_path / "job.yaml", command=[*command, str(script)])
    agent = psutil.Process(group.process.pid)  # the wrapper exec'd torchrun: same pid
    listening: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 30
    while group.process.poll() is None and time.monotonic() < deadline:
        try:
            sockets = agent.net_connections(kind="inet")
        except psutil.Error:
            break
        listening |= {(c.laddr.ip, c.laddr.port) for c in sockets if c.status == "LISTEN"}
        time.sleep(0.05)
    follow_torchrun(group, timeout_s=60, console=io.StringIO())
    assert len(listening) >= 2, listening  # the rendezvous store and the workers' store
    assert {ip for ip, _ in listening} <= LOOPBACK, listening


def test_the_default_rendezvous_id_is_random_per_launch() -> None:
    launch = build_job_config({"launch": {"rdzv_endpoint": "127.0.0.1:29400"}}).launch
    ids = set()
    for _ in range(2):
        cmd = torchrun_command(launch, "job.yaml")
        ids.add(cmd[cmd.index("--rdzv-id") + 1])
    assert len(ids) == 2 and all(len(i) == 32 for i in ids), ids
