"""The trainer's view of the other replica groups: quorum, gradient averaging, commit, healing.

Each step of a fault-tolerant run (``fault_tolerance.enable``):

1. :meth:`ReplicaGroupFT.begin_step` asks the lighthouse for the step's quorum (through
   TorchFT's :class:`~torchft.Manager`, synchronously, before any batch is drawn). A
   group that is behind (restarted) receives the current state from a live peer right
   there (:mod:`titan_kedro.ft.transport`) and trains the step in lock-step.
2. After backward, :meth:`average_gradients` averages every gradient (the local shard,
   under FSDP inside the group) over the participating groups.
3. :meth:`should_commit` is the step's vote: the optimizer steps only if every rank of
   this group got through the step without a communication error and enough groups
   took part (``fault_tolerance.min_replicas``). A step that is not committed is tried
   again with the same batch.

The group with replica rank 0 in the quorum (the lowest-named live group that is up to
date) is the leader: its rank 0 logs metrics, writes the summary and saves checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_kedro.ft.identity import ReplicaIdentity, node_address, replica_name
from titan_kedro.ft.transport import JsonPGTransport, encode_header

logger = logging.getLogger(__name__)

MAX_UNCOMMITTED_STEPS = 10
"""Consecutive steps that fail to commit before the group gives up (raises)."""
HEARTBEAT_SETTLE_S = 1.0
"""How long a group's manager heartbeats before it joins the startup barrier: the quorum
lighthouse waits for a heartbeating group only, and under load a manager's first heartbeat
lagged the barrier, so the other group's step 1 formed a quorum without it."""


def _recording(base: type) -> type:
    """``base`` (a TorchFT process group) that remembers the quorum id it was configured for."""

    class QuorumRecordingPG(base):  # type: ignore[misc, valid-type]
        quorum_id: int = -1

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, *args: Any, **kwargs: Any) -> None:  # fmt: skip
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
            self.quorum_id = -1 if quorum_id is None else int(quorum_id)

    return QuorumRecordingPG


def _cross_group_pg(device: torch.device, timeout: timedelta) -> Any:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo
    return _recording(base)(timeout=timeout)


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """While a ``Manager`` is built, its ``ManagerServer`` binds ``host``, not ``[::]``.

    torchft 0.2.0 hard-codes the bind address; ``host`` is the node's own address
    (``identity.node_address``: 127.0.0.1 when the groups all run here). Restored on every
    path.
    """
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound_server(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[-1]
        return original(**{**kwargs, "bind": f"{bind_host}:{port}"})

    bind_host = f"[{host}]" if ":" in host else host
    manager_module.ManagerServer = bound_server
    try:
        yield
    finally:
        manager_module.ManagerServer = original


def _store_address(node: str) -> str | None:
    """Where the other groups reach this group's store: torchrun's ``MASTER_ADDR``, except
    that a loopback one (a one-node group's store runs here) is this node's address."""
    master = os.environ.get("MASTER_ADDR")
    return node if master in ("localhost", "127.0.0.1", "::1") else None


def wait_for_all_groups(identity: ReplicaIdentity, timeout: timedelta) -> None:
    """Block until every replica group has reached this point (the startup barrier).

    Raises:
        RuntimeError: Not every group arrived within ``timeout``.
    """
    from torchft.coordination import LighthouseClient

    assert identity.startup_lighthouse is not None
    client = LighthouseClient(identity.startup_lighthouse, connect_timeout=timeout)
    try:
        client.quorum(replica_id=f"startup-{identity.replica_id}", timeout=timeout)
    except Exception as err:  # the Rust client raises plain exceptions
        raise RuntimeError(
            f"replica group {identity.replica_id}: not every replica group started within "
            f"fault_tolerance.join_timeout_s={timeout.total_seconds():.0f}s ({err}); see the "
            "other groups' logs under launch.log_dir"
        ) from err


class ReplicaGroupFT:
    """One group's membership in the fault-tolerant job (every rank of every group builds one).

    Args:
        cfg: The job config (reads ``fault_tolerance``, ``launch``, ``training``).
        device: This rank's device (CPU: gloo between groups; CUDA: NCCL).
        group_rank: Rank within this group's torchrun.
        state_dict: This group's full training state (what a healing peer receives).
        load_state_dict: Loads such a state into this group.
        start_step: Optimizer steps already done (a resumed run).
        identity: The launcher's variables (read from the environment if None).
        degraded_step_delay_s: Test-only (``train.faults.TestHooks``): seconds each step
            sleeps while fewer than all groups take part.
    """

    def __init__(
        self,
        cfg: Any,
        device: torch.device,
        *,
        group_rank: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        start_step: int = 0,
        identity: ReplicaIdentity | None = None,
        degraded_step_delay_s: float = 0.0,
    ) -> None:
        ft = cfg.fault_tolerance
        self.groups = ft.replica_groups
        self.identity = identity or ReplicaIdentity.from_env(self.groups)
        self.samples_per_group_step = cfg.layout.group_batch_size
        self.device = device
        """Where every tensor of a cross-group collective lives (NCCL refuses CPU tensors)."""
        self._user_state = state_dict
        self._user_load = load_state_dict
        self._heal_started: float | None = None
        self.heal_s = 0.0
        self._heal_report = torch.zeros(2, device=device)
        # A restarted group's first quorum must include a live peer (it has nothing to train from).
        self._needs_peer = self.identity.attempt > 0
        self.skipped_samples = 0
        self._degraded_delay_s = degraded_step_delay_s
        timeout = timedelta(seconds=ft.step_timeout_s)
        self.pg = _cross_group_pg(device, timeout)
        self.host = node_address(self.identity.lighthouse)
        with _manager_server_on(self.host):
            self.manager = self._build_manager(cfg, device, timeout)
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})
        if self.identity.attempt == 0 and self.identity.startup_lighthouse:
            if group_rank == 0:
                time.sleep(HEARTBEAT_SETTLE_S)
                wait_for_all_groups(self.identity, timedelta(seconds=ft.join_timeout_s))
            if dist.is_initialized():
                dist.barrier()

    def _build_manager(self, cfg: Any, device: torch.device, timeout: timedelta) -> Any:
        from torchft import Manager

        ft = cfg.fault_tolerance
        return Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.join_timeout_s),
            replica_id=replica_name(self.identity.replica_id),
            lighthouse_addr=self.identity.lighthouse,
            checkpoint_transport=JsonPGTransport(self.pg, device, state_dict=self._state),
            init_sync=False,  # every group initialises the same weights from job.seed
            max_retries=MAX_UNCOMMITTED_STEPS,
            hostname=self.host,
            store_addr=_store_address(self.host),
        )

    # -- healing ------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"trainer": self._user_state(), "ft": {"skipped_samples": self.skipped_samples}}

    def _load(self, state: dict[str, Any]) -> None:
        self._user_load(state["trainer"])
        self.skipped_samples = int(state["ft"]["skipped_samples"])
        started = self._heal_started or time.perf_counter()
        self.heal_s = time.perf_counter() - started
        logger.warning(
            "replica group %d healed from a live peer at step %d in %.2fs",
            self.identity.replica_id,
            self.manager.current_step(),
            self.heal_s,
        )

    # -- one step -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum; a group that is behind receives the live state here."""
        self.heal_s = 0.0
        self._heal_started = time.perf_counter()
        self.manager.start_quorum()
        self._heal_started = None
        if self._needs_peer and self.participants < 2:
            raise RuntimeError(
                f"replica group {self.identity.replica_id} was restarted (attempt "
                f"{self.identity.attempt}) but found no live group to heal from; the others have "
                "finished or died, so it stops instead of training alone from its own state"
            )
        self._needs_peer = False
        if self._degraded_delay_s and self.participants < self.groups:
            time.sleep(self._degraded_delay_s)  # tests only (train/faults.py)

    @property
    def participants(self) -> int:
        """Replica groups taking part in this step."""
        return self.manager.num_participants()

    @property
    def quorum_id(self) -> int:
        """The lighthouse's id of this step's quorum (it changes when a group leaves or joins)."""
        return self.pg.quorum_id

    @property
    def is_leader(self) -> bool:
        """Whether this group has replica rank 0 in the quorum (it logs and checkpoints)."""
        return self.manager.participating_rank() == 0

    @property
    def logs_run_constants(self) -> bool:
        """Whether values logged once per run (``peak_tflops``) come from this group: the
        first start of group 0, so a run has one value."""
        return self.identity.replica_id == 0 and self.identity.attempt == 0

    def _allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        """The one entry of every cross-group reduction; ``tensor`` must be on ``device``."""
        self.manager.allreduce(tensor, reduce_op=op).wait()
        return tensor

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average every gradient over the participating groups (one flat buffer per dtype)."""
        grads = [p.grad for p in params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
        with torch.no_grad():
            for locals_ in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in locals_])
                self._allreduce(flat, dist.ReduceOp.AVG)
                offset = 0
                for g in locals_:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def replica_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` (this group's mean) over the participating groups."""
        return self._allreduce(value.detach().clone().float(), dist.ReduceOp.AVG)

    def replica_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the participating groups (in place)."""
        return self._allreduce(value, dist.ReduceOp.SUM)

    def should_commit(self) -> bool:
        """The step's vote; True means step the optimizer (and count the skipped batches)."""
        # Every participating group runs this reduction whatever its vote, so the
        # collectives stay matched; the leader learns of a heal in another group.
        report = torch.tensor([self.heal_s, float(self.heal_s > 0)], device=self.device)
        self._heal_report = self.replica_sum(report)
        committed = self.manager.should_commit()
        if committed:
            self.skipped_samples += (self.groups - self.participants) * self.samples_per_group_step
        else:
            logger.warning(
                "replica group %d: step %d not committed (a peer failed or too few groups); "
                "retrying it",
                self.identity.replica_id,
                self.manager.current_step() + 1,
            )
        return committed

    def step_metrics(self) -> dict[str, float]:
        """``ft/participants``, ``ft/quorum_id``, ``ft/skipped_samples`` and this step's heal.

        ``ft/heal_s`` is the mean healing time of the groups that healed this step (absent
        when none did), ``ft/healed_groups`` their number.
        """
        heal_s, healed = self._heal_report.tolist()  # one read (a sync on CUDA)
        metrics = {
            "ft/participants": float(self.participants),
            "ft/quorum_id": float(self.quorum_id),
            "ft/skipped_samples": float(self.skipped_samples),
        }
        if healed > 0:
            metrics["ft/heal_s"] = heal_s / healed
            metrics["ft/healed_groups"] = healed
        return metrics

    def write_state_digest(self, folder: str | Path, group_rank: int, step: int) -> Path:
        """Write the SHA-256 of this rank's full training state to ``folder``.

        Replica groups in lock-step hold bitwise-equal states, so the files
        ``replica-<g>-rank-<r>.json`` of one rank ``r`` must agree across groups ``g``.
        """
        header, tensors = encode_header(self._user_state(), step)
        digest = hashlib.sha256(header)
        for tensor in tensors:
            digest.update(tensor.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        path = Path(folder) / f"replica-{self.identity.replica_id}-rank-{group_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": step, "sha256": digest.hexdigest()}) + "\n")
        return path

    def shutdown(self) -> None:
        """Stop the manager server and its threads."""
        self.manager.shutdown(wait=False)
