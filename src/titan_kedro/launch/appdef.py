"""The TorchX AppDef of a training job: one role, one torchrun agent per node.

It is the AppDef of TorchX's ``dist.ddp`` component (role named after the module,
``bash -c`` entrypoint, c10d rendezvous at the rank-0 node's ``c10d`` port with the app id
as rendezvous id, ``nnodes`` replicas, per-replica resources) with this project's torchrun
flags (``launch.torchrun.torchrun_command``: restarts, log folder, rank-0 tee) and
``-m titan_kedro.train --config <job_config.yaml>``.

With ``fault_tolerance.enable`` the replicas are the G replica groups instead of nodes:
each runs a standalone torchrun of its own (``{launch.log_dir}/replica-<g>``) with
``TITAN_KEDRO_REPLICA_ID`` set to its replica id, and restarts its own workers up to
``fault_tolerance.max_group_restarts`` times (``--max-restarts``), since TorchX's
schedulers restart whole jobs, not one replica. The lighthouses' addresses come in ``env``
(``replica_groups.replica_group_services``). On Slurm each group is a job of its own
instead (``group=g``: ``launch.nnodes`` replicas, ``TITAN_KEDRO_REPLICA_ID=g``, its log
folder, job name ``<job.name>-group<g>``, submitted with ``--no-requeue``;
``slurm_groups.SlurmGroupLauncher``).
"""

from __future__ import annotations

import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchx import specs
from torchx.specs import macros

from titan_kedro.config.schema import LOCAL_CWD_SCHEDULER
from titan_kedro.ft.identity import REPLICA_ID_ENV
from titan_kedro.launch.runner import SLURM_NO_REQUEUE_KEY, SLURM_SIGNAL_KEY
from titan_kedro.launch.torchrun import GLOO_IFNAME_ENV, loopback_interface, torchrun_command
from titan_kedro.runs.parent_death import guarded_command
from titan_kedro.train.save_signal import SAVE_SIGNAL_ENV

ROLE = "train"
"""The role's name (``dist.ddp`` names it after the module: ``titan_kedro.train``)."""
RDZV_PORT = 29500
"""Rendezvous port on the rank-0 node (``dist.ddp``'s default; exposed as port ``c10d``)."""
HOST_SCHEDULERS = frozenset({LOCAL_CWD_SCHEDULER, "slurm"})
"""Schedulers that run this machine's environment (this interpreter, on shared storage for
slurm); the others run ``python`` in ``scheduler_args.image`` (a container image; for
``ray`` its working directory)."""
SAVE_SIGNAL = "USR1"
"""The signal Slurm sends before a job's time limit (``launch.save_before_limit_s``)."""
ROLE_ARGS = frozenset({"image", "mounts", "mlflow_secret"})
"""``launch.scheduler_args`` keys that set the role, not TorchX run options (``mlflow_secret``:
the Kubernetes Secret holding MLflow's credential variables, ``launch.secrets``)."""


class _NoQuote(str):
    """An argument kept unquoted in the ``bash -c`` line, so the shell expands its variable."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for agents that all run on this machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rendezvous_endpoint(launch: Any) -> str:
    """Where the agents meet: ``launch.rdzv_endpoint``, else chosen by scheduler and size."""
    if launch.rdzv_endpoint:
        return launch.rdzv_endpoint
    if launch.nnodes == 1:
        return "localhost:0"
    if launch.scheduler == LOCAL_CWD_SCHEDULER:
        return f"localhost:{free_port()}"
    # The scheduler fills in the rank-0 host (dist.ddp's ``$${rank0_env}`` macro).
    return _NoQuote(f"$${{{macros.rank0_env}:=localhost}}:{RDZV_PORT}")


def _shell_join(args: list[str]) -> str:
    return " ".join(a if isinstance(a, _NoQuote) else shlex.quote(a) for a in args)


def build_appdef(
    cfg: Any, config_path: str | Path, env: Mapping[str, str], *, group: int | None = None
) -> specs.AppDef:
    """The TorchX AppDef that runs the job described by ``cfg`` (reads ``job`` and ``launch``).

    Args:
        cfg: The job config.
        config_path: The job config file as the workers see it.
        env: Environment of every node (``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI``, …);
            ``PYTHONUNBUFFERED=1`` and ``LOGLEVEL`` are added.
        group: With ``fault_tolerance.enable``: the job of this replica group alone
            (``launch.nnodes`` nodes); None: one job of all groups, one node each.
    """
    launch, name = cfg.launch, cfg.job.name
    replicas, env = launch.nnodes, {"PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING", **dict(env)}
    if cfg.fault_tolerance.enable and group is not None:
        env[REPLICA_ID_ENV], name = str(group), f"{name}-group{group}"
        launch = launch.model_copy(update={"log_dir": f"{launch.log_dir}/replica-{group}"})
    elif cfg.fault_tolerance.enable:  # one node per group (the config refuses more)
        replicas, env[REPLICA_ID_ENV] = cfg.replica_groups, macros.replica_id
        launch = launch.model_copy(
            update={
                "log_dir": f"{launch.log_dir}/replica-{macros.replica_id}",
                "max_restarts": cfg.fault_tolerance.max_group_restarts,
            }
        )
    python = sys.executable if launch.scheduler in HOST_SCHEDULERS else "python"
    endpoint = rendezvous_endpoint(launch)
    local = launch.scheduler == LOCAL_CWD_SCHEDULER  # every agent on this machine
    if local:  # gloo listens on loopback, as for ``local`` (``torchrun.start_torchrun``)
        env[GLOO_IFNAME_ENV] = loopback_interface()
    cmd = torchrun_command(
        launch, config_path, python=python, rendezvous=(endpoint, macros.app_id), loopback=local
    )
    metadata = {}
    if launch.scheduler == "slurm" and cfg.fault_tolerance.enable and group is not None:
        # Slurm would hold a requeued job for minutes; the launcher submits it again at once.
        metadata[SLURM_NO_REQUEUE_KEY] = "1"
    if launch.scheduler == LOCAL_CWD_SCHEDULER:
        # The agents are this process's children: they end with it (bash execs the wrapper).
        cmd = ["exec", *guarded_command(cmd, python=python)]
    elif launch.scheduler == "slurm" and launch.save_before_limit_s:
        # Slurm signals every process of the job before its time limit: the agent ignores
        # it (inherited by the workers, which handle it: ``train.save_signal``).
        metadata[SLURM_SIGNAL_KEY] = f"{SAVE_SIGNAL}@{launch.save_before_limit_s}"
        env[SAVE_SIGNAL_ENV] = SAVE_SIGNAL
        cmd = [_NoQuote(f"trap '' {SAVE_SIGNAL};"), *cmd]
    role_args = {k: v for k, v in launch.scheduler_args.items() if k in ROLE_ARGS}
    mounts = role_args.get("mounts") or []
    # One TorchX mount string per mount ("type=bind,src=/x,dst=/x"), split as its CLI does.
    mount_args = [
        t for m in ([mounts] if isinstance(mounts, str) else mounts) for t in m.split(",")
    ]
    resources = launch.resources
    return specs.AppDef(
        name=name,
        metadata=metadata,
        roles=[
            specs.Role(
                name=ROLE,
                image=str(role_args.get("image", Path.cwd())),
                entrypoint="bash",
                args=["-c", _shell_join(cmd)],
                env=env,
                num_replicas=replicas,
                resource=specs.Resource(
                    cpu=resources.cpus, gpu=resources.gpus, memMB=resources.memory_mb
                ),
                port_map={"c10d": RDZV_PORT},
                max_retries=0,
                mounts=specs.parse_mounts(mount_args) if mount_args else [],
            )
        ],
    )
