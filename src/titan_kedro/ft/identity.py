"""Who a worker is among the replica groups: the environment the group launcher sets.

Every group's torchrun gets ``TITAN_KEDRO_REPLICA_ID`` (0 … G-1), ``TORCHFT_LIGHTHOUSE``
(TorchFT's own variable: the lighthouse) and ``TITAN_KEDRO_FT_STARTUP`` (the startup
barrier's lighthouse, so step 1 waits for every group). A group is restarted either by
the local launcher (``launch/replica_groups.py``: a new torchrun with
``TITAN_KEDRO_GROUP_ATTEMPT`` 1, 2, …) or, in a TorchX job, by its own torchrun
(``--max-restarts``: ``TORCHELASTIC_RESTART_COUNT`` 1, 2, …); the group's attempt is
the sum, so a worker knows it was restarted whichever restarted it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

REPLICA_ID_ENV = "TITAN_KEDRO_REPLICA_ID"
GROUP_ATTEMPT_ENV = "TITAN_KEDRO_GROUP_ATTEMPT"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
STARTUP_ENV = "TITAN_KEDRO_FT_STARTUP"
TORCHRUN_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
SLURM_RESTART_ENV = "SLURM_RESTART_COUNT"
"""How often Slurm requeued this job (preemption, ``scontrol requeue``, a lost node)."""
NODE_ADDRESS_ENV = "TITAN_KEDRO_FT_HOST"
"""The address this node's TorchFT manager server listens on and advertises (optional)."""


def replica_name(replica_id: int) -> str:
    """The TorchFT replica id of group ``replica_id`` (zero-padded: the lighthouse sorts names)."""
    return f"titan_kedro_{replica_id:03d}"


@dataclass(frozen=True)
class ReplicaIdentity:
    """This worker's replica group, attempt and lighthouses."""

    replica_id: int
    """Index of the group, 0 … ``fault_tolerance.replica_groups - 1``."""
    attempt: int
    """How often the launcher has restarted this group (0: the first start)."""
    lighthouse: str
    """Address of the lighthouse that forms each step's quorum."""
    startup_lighthouse: str | None
    """Address of the startup barrier's lighthouse (only the first attempt joins it)."""

    @classmethod
    def from_env(cls, replica_groups: int) -> ReplicaIdentity:
        """Read the launcher's variables.

        Raises:
            ValueError: A variable is missing or out of range (a worker not started by the
                replica-group launcher).
        """
        missing = [name for name in (REPLICA_ID_ENV, LIGHTHOUSE_ENV) if not os.environ.get(name)]
        if missing:
            raise ValueError(
                f"fault_tolerance.enable is set but {', '.join(missing)} is not: replica-group "
                "workers are started by the training node (launch/replica_groups.py), or by hand "
                f"with {REPLICA_ID_ENV}=<group> and {LIGHTHOUSE_ENV}=http://host:port"
            )
        replica_id = int(os.environ[REPLICA_ID_ENV])
        if not 0 <= replica_id < replica_groups:
            raise ValueError(
                f"{REPLICA_ID_ENV}={replica_id} is outside 0 … {replica_groups - 1} "
                "(fault_tolerance.replica_groups)"
            )
        return cls(
            replica_id=replica_id,
            attempt=group_attempt(),
            lighthouse=os.environ[LIGHTHOUSE_ENV],
            startup_lighthouse=os.environ.get(STARTUP_ENV) or None,
        )


def replica_data_shard(
    replica_id: int, replica_groups: int, dp_rank: int, dp_degree: int
) -> tuple[int, int]:
    """This rank's ``(data_rank, data_ranks)``: ``(replica_id × dp_degree + dp_rank, G × dp_degree)``.

    Two groups never read the same window in one step, and G groups of ``dp_degree`` ranks
    read exactly what one group of ``G × dp_degree`` ranks would.
    """
    return replica_id * dp_degree + dp_rank, replica_groups * dp_degree


def data_shard(cfg: Any, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """``(data_rank, data_ranks)`` of a rank that is ``dp_rank`` of its group's ``dp_degree``.

    :func:`replica_data_shard` of this worker's group, or ``(dp_rank, dp_degree)`` without FT.
    """
    if not cfg.fault_tolerance.enable:
        return dp_rank, dp_degree
    identity = ReplicaIdentity.from_env(cfg.replica_groups)
    return replica_data_shard(identity.replica_id, cfg.replica_groups, dp_rank, dp_degree)


def group_attempt() -> int:
    """How often this worker's group has been restarted: by the launcher, by its torchrun or
    by Slurm (a requeued group job)."""
    names = (GROUP_ATTEMPT_ENV, TORCHRUN_RESTART_ENV, SLURM_RESTART_ENV)
    return sum(int(os.environ.get(name) or "0") for name in names)


def node_address(lighthouse: str) -> str:
    """The address this node's TorchFT servers listen on and give to the other groups.

    ``TITAN_KEDRO_FT_HOST`` if set, else this node's address on the interface that routes to
    the lighthouse (127.0.0.1 for a lighthouse on loopback): one address, never a wildcard.
    """
    if os.environ.get(NODE_ADDRESS_ENV):
        return os.environ[NODE_ADDRESS_ENV]
    host = urlsplit(lighthouse).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def restarted_group() -> bool:
    """Whether this worker's replica group was restarted (its attempt is above 0)."""
    return bool(os.environ.get(REPLICA_ID_ENV)) and group_attempt() > 0
