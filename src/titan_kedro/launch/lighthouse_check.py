"""Before replica groups go to Slurm: can their nodes reach the lighthouse the launcher starts?

The lighthouses run beside the launcher on ``fault_tolerance.lighthouse_bind``. That must be
an address of one of this machine's interfaces (else the bind fails, or worse, the nodes
are told an address nobody listens on), and a loopback address only serves nodes that are
this machine (the one-host test cluster). A wildcard address works but listens on every
interface: it is logged as such.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

import psutil

logger = logging.getLogger(__name__)


def local_addresses() -> set[str]:
    """Every IP address of this machine's interfaces."""
    return {
        addr.address.split("%", 1)[0]
        for addrs in psutil.net_if_addrs().values()
        for addr in addrs
        if addr.family in (socket.AF_INET, socket.AF_INET6)
    }


def resolve(host: str) -> set[str]:
    """The IP addresses ``host`` stands for (empty: it does not resolve)."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def slurm_node_addresses(partition: str | None) -> list[str]:
    """``NodeAddr`` of the partition's nodes (``sinfo``; empty if it cannot tell)."""
    cmd = ["sinfo", "--noheader", "--Node", "--format=%o"]
    if partition:
        cmd.append(f"--partition={partition}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def _is(
    address: str, check: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool]
) -> bool:
    try:
        return check(ipaddress.ip_address(address))
    except ValueError:
        return False


def lighthouse_problems(
    cfg: Any,
    *,
    local: Iterable[str] | None = None,
    node_addresses: Iterable[str] | None = None,
) -> list[str]:
    """Why the groups' nodes could not reach the launcher's lighthouse (empty: none found).

    Args:
        cfg: The job config (``fault_tolerance``, ``launch.scheduler_args.partition``).
        local: This machine's addresses (default :func:`local_addresses`).
        node_addresses: The Slurm nodes' addresses (default :func:`slurm_node_addresses`).
    """
    ft = cfg.fault_tolerance
    if not ft.enable or ft.lighthouse_address is not None or cfg.launch.scheduler != "slurm":
        return []  # Kubernetes: the lighthouses run behind a Service (``k8s_groups``)
    bind = ft.lighthouse_bind
    if _is(bind, lambda ip: ip.is_unspecified):
        logger.warning(
            "fault_tolerance.lighthouse_bind=%s: the lighthouses listen on every interface; "
            "anyone who reaches this host can join or disturb the run's quorum",
            bind,
        )
        return []
    ours = set(local_addresses() if local is None else local)
    addresses = resolve(bind)
    if not addresses & ours:
        found = ", ".join(sorted(addresses)) or "does not resolve"
        return [
            f"fault_tolerance.lighthouse_bind={bind} ({found}) is no address of this machine, "
            f"so the lighthouses cannot listen on it: set it to one of {', '.join(sorted(ours))} "
            "(the one the nodes reach)"
        ]
    if not all(_is(a, lambda ip: ip.is_loopback) for a in addresses):
        return []
    nodes = list(
        slurm_node_addresses(cfg.launch.scheduler_args.get("partition"))
        if node_addresses is None
        else node_addresses
    )
    elsewhere = [n for n in nodes if not resolve(n) & ours]
    if not elsewhere:
        return []
    return [
        f"fault_tolerance.lighthouse_bind={bind} is loopback, but the Slurm nodes "
        f"{', '.join(elsewhere)} are other machines and cannot reach it: set "
        "fault_tolerance.lighthouse_bind to this host's address on the cluster network"
    ]
