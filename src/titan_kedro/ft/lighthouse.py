"""The lighthouses a fault-tolerant run needs, started in this process.

They listen on one address, ``fault_tolerance.lighthouse_bind`` (127.0.0.1 by default;
on Slurm an address of the submit host that the nodes reach); a wildcard address
(``0.0.0.0``, ``::``) is advertised under this host's name.

- The quorum lighthouse forms each step's quorum (``fault_tolerance.min_replicas``),
  drops a group silent for ``heartbeat_timeout_s`` and waits ``join_timeout_s`` for
  heartbeating stragglers. A ``fault_tolerance.lighthouse_address`` replaces it.
- The startup lighthouse needs all G groups: the first attempt of every group joins it
  once before step 1 (``replica.wait_for_all_groups``), so no group trains alone while
  another is still starting.

Both are TorchFT's Rust ``LighthouseServer``; they stop with :meth:`Lighthouses.stop`
and die with this process.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def _url_host(host: str) -> str:
    """``host`` as it stands in a URL or a ``host:port`` bind (IPv6 in brackets)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _start(
    bind: str, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float
) -> tuple[Any, str]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{_url_host(bind)}:0",
        min_replicas=min_replicas,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    # The server reports the machine's host name; it listens on ``bind`` only.
    port = urlsplit(server.address()).port
    host = socket.gethostname() if is_wildcard(bind) else bind
    return server, f"http://{_url_host(host)}:{port}"


@dataclass
class Lighthouses:
    """Addresses (and, when started here, the servers) of a run's two lighthouses."""

    quorum_address: str
    """Where every group's manager asks for the step's quorum (``TORCHFT_LIGHTHOUSE``)."""
    startup_address: str
    """The startup barrier (all groups)."""
    _servers: tuple[Any, ...] = ()

    @classmethod
    def start(cls, ft: Any) -> Lighthouses:
        """Start the startup lighthouse, and the quorum one unless ``ft.lighthouse_address``,
        both on ``ft.lighthouse_bind``."""
        servers: list[Any] = []
        try:
            # Its participants only ask once, so they must stay "healthy" for the whole wait.
            startup, startup_address = _start(
                ft.lighthouse_bind,
                ft.replica_groups,
                ft.join_timeout_s,
                heartbeat_timeout_s=ft.join_timeout_s,
            )
            servers.append(startup)
            quorum_address = ft.lighthouse_address
            if quorum_address is None:
                quorum, quorum_address = _start(
                    ft.lighthouse_bind, ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s
                )
                servers.append(quorum)
        except BaseException:
            for server in servers:
                server.shutdown()
            raise
        logger.info("TorchFT lighthouse %s (startup barrier %s)", quorum_address, startup_address)
        return cls(quorum_address, startup_address, tuple(servers))

    def stop(self) -> None:
        """Shut the servers started here down (idempotent)."""
        servers, self._servers = self._servers, ()
        for server in servers:
            server.shutdown()
