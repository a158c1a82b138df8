"""torchrun for agents on this machine only: its TCP stores listen on 127.0.0.1, not on ``::``.

torchrun's agent hosts two ``TCPStore`` servers: the c10d rendezvous store
(``torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py``, ``_create_tcp_store``)
and the store it shares with its workers (``dynamic_rendezvous.py``,
``_create_tcp_store_server``). Both are made with ``is_master=True`` and a host name that
only clients use: the server listens on every interface (``[::]`` dual-stack), and torch's
rendezvous unpickles what it reads from that store. Neither torchrun's options nor the
rendezvous parameters can name the address to bind; ``TCPStore``'s ``master_listen_fd``
(an already listening socket) can. So local launches run this module instead of
``torch.distributed.run``::

    python -m titan_kedro.runs.loopback_agent <torchrun arguments…>

which makes every store server whose host is a loopback name listen on a socket bound to
127.0.0.1, then runs torchrun's ``main``. The launcher adds ``--local-addr 127.0.0.1`` so
the workers reach the shared store there (``launch.torchrun.torchrun_command``).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import sys
from typing import Any

from titan_kedro.runs.frozen_imports import freeze_at_exit, frozen_imports

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_socket(port: int) -> int:
    """The fd of a TCP socket listening on 127.0.0.1:``port`` (0: any free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(socket.SOMAXCONN)
    return sock.detach()  # the store owns the fd from now on


def loopback_tcp_store(store_cls: Any) -> Any:
    """``store_cls`` (``TCPStore``) whose servers for a loopback host listen on 127.0.0.1."""

    @functools.wraps(store_cls)
    def make(host_name: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if (
            kwargs.get("is_master")
            and kwargs.get("master_listen_fd") is None
            and is_loopback(host_name)
        ):
            try:
                kwargs["master_listen_fd"] = listening_socket(port)
            except OSError as err:  # another agent here hosts it: torchrun then connects
                raise RuntimeError(f"cannot listen on {LOOPBACK}:{port}: {err}") from err
            host_name = LOOPBACK
        return store_cls(host_name, port, *args, **kwargs)

    return make


def patch_stores() -> None:
    """Bind the agent's store servers to loopback (the two places torchrun makes them)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    c10d_rendezvous_backend.TCPStore = loopback_tcp_store(c10d_rendezvous_backend.TCPStore)
    store_cls = dist.TCPStore

    def _create_tcp_store_server(self: Any, master_addr: str, master_port: int) -> Any:
        return loopback_tcp_store(store_cls)(
            master_addr, master_port, is_master=True, multi_tenant=True
        )

    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = _create_tcp_store_server


def main() -> None:
    """Run torchrun (``sys.argv[1:]`` are its arguments) with loopback-only stores."""
    freeze_at_exit()
    with frozen_imports():
        patch_stores()
        from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"
    torchrun_main()


if __name__ == "__main__":
    main()
