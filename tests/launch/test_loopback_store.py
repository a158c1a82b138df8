"""A local launch's torchrun stores listen on loopback only, and rendezvous ids are random."""

from __future__ import annotations

import contextlib
import io
import socket
import time
from pathlib import Path

import psutil
import pytest

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


GLOO_WORKER = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

dist.init_process_group("gloo")  # a group's own ranks
cross = ProcessGroupGloo(timeout=timedelta(seconds=30))  # TorchFT's, between replica groups
store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/cross"
cross.configure(store, "probe", dist.get_rank(), dist.get_world_size(), quorum_id=1)
cross.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
dist.barrier()
time.sleep(3)  # listening while the test looks
"""


def test_gloo_and_torchft_groups_of_a_local_launch_listen_on_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a group and between replica groups (TorchFT's process group), gloo listens
    where ``GLOO_SOCKET_IFNAME`` or the host name points; every worker is on this machine."""
    real = [
        a.address
        for name, addresses in psutil.net_if_addrs().items()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    outward = next(
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.address in real for a in addresses)
    )
    # This host's name resolves to 127.0.0.1; on most it names the real interface, as here.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", outward)
    cfg = build_job_config({"launch": {"log_dir": str(tmp_path / "logs"), "nproc_per_node": 2}})
    script = tmp_path / "gloo_worker.py"
    script.write_text(GLOO_WORKER)
    command = torchrun_command(cfg.launch, tmp_path / "job.yaml", loopback=True)[:-4]
    group = start_torchrun(cfg.launch, tmp_path / "job.yaml", command=[*command, str(script)])
    agent = psutil.Process(group.process.pid)
    listening: dict[int, set[str]] = {}
    deadline = time.monotonic() + 60
    while group.process.poll() is None and time.monotonic() < deadline:
        for proc in [agent, *agent.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                sockets = proc.net_connections(kind="inet")
                listening.setdefault(proc.pid, set()).update(
                    c.laddr.ip for c in sockets if c.status == "LISTEN"
                )
        time.sleep(0.1)
    follow_torchrun(group, timeout_s=60, console=io.StringIO())
    workers = [ips for pid, ips in listening.items() if pid != agent.pid and ips]
    assert len(workers) >= 2, listening  # both ranks' gloo pairs were seen listening
    assert set().union(*listening.values()) <= LOOPBACK, listening
