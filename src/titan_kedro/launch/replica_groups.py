"""Run G fault-tolerant replica groups on this machine: one torchrun each, restarted alone.

``fault_tolerance.enable`` with ``launch.scheduler: local``: the lighthouses start in this
process on 127.0.0.1 (``ft.lighthouse``), then every group's torchrun
(``torchrun_command``, standalone, its own log folder ``{launch.log_dir}/replica-<g>``)
with ``TITAN_KEDRO_REPLICA_ID``, ``TITAN_KEDRO_GROUP_ATTEMPT`` and the lighthouses'
addresses (``replica_group_services``). Output is streamed with a ``[group g]`` prefix.
A group that dies is restarted (attempt +1, up to ``fault_tolerance.max_group_restarts``)
while another group still trains, and heals from it; when every group has finished (exit
code 0), the job is done. A non-zero exit is never a finish: once another group has
finished, it fails the job (nothing is left to restart it for). On any way out (success,
failure, Ctrl-C, ``launch.timeout_s``) every group's process tree and the lighthouses
are stopped. This process holds the run folder's lock (``runs.lock``) for the whole
job, since the groups share it (a lost lock stops every group); each group's torchrun
ends with this process.

With ``launch.scheduler: local_cwd`` the same services run here around a TorchX job of G
replicas (``appdef.build_appdef``), each group's torchrun restarting its own workers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from titan_kedro.ft.identity import (
    GROUP_ATTEMPT_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_ID_ENV,
    STARTUP_ENV,
)
from titan_kedro.ft.lighthouse import Lighthouses
from titan_kedro.launch.secrets import redact
from titan_kedro.launch.torchrun import (
    TorchrunGroup,
    TrainingFailedError,
    new_failing_rank_log,
    start_torchrun,
    stop_torchrun,
)
from titan_kedro.runs.lock import hold_run_folder, verify_writer

POLL_S = 0.2
STREAM_DRAIN_S = 5.0
"""How long a failure report waits for the exited group's remaining output."""


@contextlib.contextmanager
def replica_group_services(cfg: Any, echo: Callable[[str], None]) -> Iterator[dict[str, str]]:
    """The run folder's lock and the lighthouses of one fault-tolerant job, held until it ends.

    Yields:
        The variables every group's torchrun needs: ``TORCHFT_LIGHTHOUSE`` and the startup
        barrier (which only a group's first attempt joins).
    """
    ckpt = cfg.checkpoint
    with (
        hold_run_folder(
            ckpt.folder,
            timeout_s=ckpt.lock_timeout_s,
            break_lock=ckpt.break_lock,
            run_id=cfg.job.run_id,
        )
        if ckpt.enable
        else contextlib.nullcontext()
    ):
        lighthouses = Lighthouses.start(cfg.fault_tolerance)
        try:
            echo(
                f"[ft] lighthouse {lighthouses.quorum_address}, startup barrier "
                f"{lighthouses.startup_address}\n"
            )
            yield {
                LIGHTHOUSE_ENV: lighthouses.quorum_address,
                STARTUP_ENV: lighthouses.startup_address,
            }
        finally:
            lighthouses.stop()


@dataclass
class GroupProcess:
    """One replica group's torchrun and what it printed."""

    replica_id: int
    log_dir: Path
    attempt: int = 0
    torchrun: TorchrunGroup | None = None
    """The current attempt's torchrun (it ends with this process: ``start_torchrun``)."""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    streamer: threading.Thread | None = None
    """The thread echoing the current attempt's output into ``tail``."""
    finished: bool = False
    """Exited with code 0 (a non-zero exit never counts as finished)."""

    @property
    def proc(self) -> subprocess.Popen[str] | None:
        return None if self.torchrun is None else self.torchrun.process


class ReplicaGroupLauncher:
    """Start, watch and restart the replica groups of one job (``run()`` to completion).

    Args:
        cfg: The job config (``launch``, ``fault_tolerance``).
        config_path: The job config file every worker loads.
        extra_env: More environment variables for the workers (the MLflow run).
        console: Where output is echoed (default ``sys.stdout``).
    """

    def __init__(
        self,
        cfg: Any,
        config_path: str | Path,
        *,
        extra_env: Mapping[str, str] | None = None,
        console: IO[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.extra_env = dict(extra_env or {})
        self.console = console or sys.stdout
        self._lock = threading.Lock()
        root = Path(cfg.launch.log_dir)
        self.groups = [GroupProcess(g, root / f"replica-{g}") for g in range(cfg.replica_groups)]
        self.restarts: dict[int, int] = {}
        self.services_env: dict[str, str] = {}

    def _echo(self, line: str) -> None:
        with self._lock:
            self.console.write(line)
            self.console.flush()

    def _start(self, group: GroupProcess) -> None:
        """Start the group's torchrun; called from the thread that runs ``run()``, since
        the group gets SIGKILL when its starting thread ends (``runs.parent_death``)."""
        launch = self.cfg.launch.model_copy(update={"log_dir": str(group.log_dir)})
        cores = os.cpu_count() or 1
        per_process = cores // (launch.nproc_per_node * len(self.groups))
        env = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, per_process))),
            **self.extra_env,
            REPLICA_ID_ENV: str(group.replica_id),
            GROUP_ATTEMPT_ENV: str(group.attempt),
            **self.services_env,
        }
        group.torchrun = start_torchrun(launch, self.config_path, extra_env=env)
        self._echo(
            f"[group {group.replica_id}] launching (attempt {group.attempt}): "
            f"{' '.join(group.torchrun.command)}\n"
        )
        group.streamer = threading.Thread(
            target=self._stream, args=(group, group.torchrun), daemon=True
        )
        group.streamer.start()

    def _stream(self, group: GroupProcess, torchrun: TorchrunGroup) -> None:
        assert torchrun.process.stdout is not None
        for raw in torchrun.process.stdout:
            line = redact(raw, torchrun.secrets)
            group.tail.append(line)
            self._echo(f"[group {group.replica_id}] {line}")

    def _failure(self, group: GroupProcess, reason: str) -> TrainingFailedError:
        if group.streamer is not None:  # its last lines, printed just before it exited
            group.streamer.join(timeout=STREAM_DRAIN_S)
        output = "".join(group.tail)
        before = group.torchrun.before if group.torchrun is not None else set()
        worker_log = new_failing_rank_log(group.log_dir, before, output)
        return TrainingFailedError(
            redact(
                f"replica group {group.replica_id} {reason}. Worker logs: {group.log_dir}\n"
                + (
                    worker_log or "--- torchrun output ---\n" + "\n".join(output.splitlines()[-60:])
                ),
                group.torchrun.secrets if group.torchrun is not None else (),
            )
        )

    def run(self) -> None:
        """Run every group to completion.

        Raises:
            TrainingFailedError: A group died more than ``max_group_restarts`` times, died
                when no other group was left to heal from, or the launch timed out.
        """
        ft = self.cfg.fault_tolerance
        deadline = (
            time.monotonic() + self.cfg.launch.timeout_s if self.cfg.launch.timeout_s else None
        )
        with replica_group_services(self.cfg, self._echo) as self.services_env:
            self._run_groups(ft, deadline)

    def _run_groups(self, ft: Any, deadline: float | None) -> None:
        try:
            for group in self.groups:
                self._start(group)
            while not all(group.finished for group in self.groups):
                time.sleep(POLL_S)
                if deadline is not None and time.monotonic() > deadline:
                    raise TrainingFailedError(
                        f"training ran past launch.timeout_s={self.cfg.launch.timeout_s}s and "
                        f"was stopped; worker logs under {self.cfg.launch.log_dir}"
                    )
                if self.cfg.checkpoint.enable:  # the lock this process holds for the groups
                    verify_writer(self.cfg.checkpoint.folder, fresh=False)
                for group in self.groups:
                    self._check(group, ft.max_group_restarts)
        finally:
            self.stop()

    def _check(self, group: GroupProcess, max_restarts: int) -> None:
        if group.finished or group.proc is None or (rc := group.proc.poll()) is None:
            return
        if rc == 0:
            group.finished = True
            self._echo(f"[group {group.replica_id}] finished\n")
            return
        done = [g.replica_id for g in self.groups if g.finished]
        if done:
            # The steps are done, so there is nothing to restart it for, but its failure
            # (a crash at the end, a restart that found no peer) is the job's.
            raise self._failure(
                group,
                f"exited with code {rc} after group(s) {', '.join(map(str, done))} finished "
                "the run (not restarted: the run's steps are done)",
            )
        alive = [g for g in self.groups if g is not group and not g.finished and g.proc
                 and g.proc.poll() is None]  # fmt: skip
        if not alive:
            raise self._failure(
                group, f"exited with code {rc} and no live group is left to heal from"
            )
        if self.restarts.get(group.replica_id, 0) >= max_restarts:
            raise self._failure(
                group,
                f"exited with code {rc} after fault_tolerance.max_group_restarts={max_restarts} "
                "restarts",
            )
        self.restarts[group.replica_id] = self.restarts.get(group.replica_id, 0) + 1
        self._echo(f"[group {group.replica_id}] exited with code {rc}; restarting it to heal\n")
        group.attempt += 1
        self._start(group)

    def stop(self) -> None:
        """Stop every group's process tree (idempotent; the lighthouses stop after it)."""
        for group in self.groups:
            if group.torchrun is not None:
                stop_torchrun(group.torchrun)
