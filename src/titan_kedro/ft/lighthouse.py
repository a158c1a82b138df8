"""The lighthouses a fault-tolerant run needs, started in this process on 127.0.0.1.

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

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

BIND_HOST = "127.0.0.1"


def _start(min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> tuple[Any, str]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{BIND_HOST}:0",
        min_replicas=min_replicas,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    # The server reports the machine's host name; it listens on 127.0.0.1 only.
    port = urlsplit(server.address()).port
    return server, f"http://{BIND_HOST}:{port}"


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
        """Start the startup lighthouse, and the quorum one unless ``ft.lighthouse_address``."""
        servers: list[Any] = []
        try:
            # Its participants only ask once, so they must stay "healthy" for the whole wait.
            startup, startup_address = _start(
                ft.replica_groups, ft.join_timeout_s, heartbeat_timeout_s=ft.join_timeout_s
            )
            servers.append(startup)
            quorum_address = ft.lighthouse_address
            if quorum_address is None:
                quorum, quorum_address = _start(
                    ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s
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
