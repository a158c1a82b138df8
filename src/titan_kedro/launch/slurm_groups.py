"""Fault-tolerant replica groups on Slurm: one job per group, a dead group's job submitted again.

``fault_tolerance.enable`` with ``launch.scheduler: slurm``: the training node holds the
run folder's lock and runs the lighthouses (``replica_group_services``, bound to
``fault_tolerance.lighthouse_bind``), then submits one TorchX job per group
(``build_appdef(..., group=g)``: ``launch.nnodes × launch.nproc_per_node`` workers,
``TITAN_KEDRO_REPLICA_ID=g``, ``TITAN_KEDRO_GROUP_ATTEMPT``) and follows them all in one
``supervise`` loop. A group whose job ends badly (a lost node, ``scancel``, a crash) is
submitted again as attempt + 1, up to ``fault_tolerance.max_group_restarts``, while the
others train on; it heals from a live peer. Slurm's own requeue of a group's job keeps the
job id (``SLURM_RESTART_COUNT``: the group heals the same way) and counts against
``launch.auto_continue`` (``slurm_jobs.RequeueBound``). Ctrl-C, SIGTERM, the timeout or
any error cancels every group's job before it propagates. Each group's Slurm job ids and
restarts are tagged on the MLflow run.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchx.runner import Runner
from torchx.specs import AppState, AppStatus

from titan_kedro.ft.identity import GROUP_ATTEMPT_ENV
from titan_kedro.launch.appdef import build_appdef
from titan_kedro.launch.replica_groups import replica_group_services
from titan_kedro.launch.runner import get_runner
from titan_kedro.launch.scheduler import (
    TAIL_LINES,
    _cancel,
    _ended,
    _install_interrupt_handlers,
    follow_output,
    signals_restored,
    submit,
)
from titan_kedro.launch.secrets import exported, redact, secret_values
from titan_kedro.launch.slurm_jobs import RequeueBound, slurm_job_id
from titan_kedro.launch.supervise import OutputFollower, supervise
from titan_kedro.launch.torchrun import TrainingFailedError
from titan_kedro.tracking.mlflow_logger import RUN_ID_ENV, TRACKING_URI_ENV

logger = logging.getLogger(__name__)

JOB_IDS_TAG = "slurm.job_ids.group_{group}"
"""MLflow tag: the group's Slurm job ids, one per attempt, comma separated."""
RESTARTS_TAG = "ft.restarts.group_{group}"
"""MLflow tag: how often the launcher submitted the group's job again."""
RESTARTS_METRIC = "ft/restarts/group_{group}"
"""MLflow metric: the same count, one value per submission (step = attempt)."""


@dataclass
class GroupJob:
    """One replica group's current Slurm job."""

    replica_id: int
    attempt: int = 0
    handle: str | None = None
    status: AppStatus | None = None
    follower: OutputFollower | None = None
    requeues: RequeueBound | None = None
    handles: list[str] = field(default_factory=list)
    finished: bool = False

    @property
    def running(self) -> bool:
        return self.handle is not None and not self.finished and not _ended(self.status)


class SlurmGroupLauncher:
    """Submit, follow and resubmit the replica groups' Slurm jobs of one run (``run()``).

    Args:
        cfg: The job config (``launch``, ``fault_tolerance``, ``checkpoint``).
        config_path: The job config file every worker loads.
        nodes_env: The nodes' environment (``secrets.node_env``: the URI without
            credentials).
        credentials: MLflow's credential variables, exported by name to ``sbatch``.
        console: Where the groups' output is echoed (default ``sys.stdout``).
        poll_s: Seconds between status checks.
    """

    def __init__(
        self,
        cfg: Any,
        config_path: str | Path,
        nodes_env: Mapping[str, str],
        credentials: Mapping[str, str],
        *,
        console: IO[str] | None = None,
        poll_s: float = 2.0,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.nodes_env = dict(nodes_env)
        self.credentials = dict(credentials)
        self.secrets = secret_values(self.credentials)
        self.console = console or sys.stdout
        self.poll_s = poll_s
        self.groups = [GroupJob(g) for g in range(cfg.replica_groups)]
        self._services_env: dict[str, str] = {}
        self._runner: Runner | None = None

    def run(self) -> None:
        """Run every group's job to success.

        Raises:
            TrainingFailedError: A group's job ended badly more than ``max_group_restarts``
                times, with no live group to heal from, after another finished, or the
                launch ran past ``launch.timeout_s``; every job is cancelled first.
            KeyboardInterrupt: ``kedro run`` was interrupted; every job was cancelled.
        """
        echo = self.console.write
        with (
            replica_group_services(self.cfg, echo) as self._services_env,
            signals_restored(),
            get_runner() as self._runner,
        ):
            _install_interrupt_handlers()
            try:  # the first poll submits every group: any error after a submission cancels
                _, timed_out = supervise(
                    self._poll, lambda done: done, self.cancel_all,
                    timeout_s=self.cfg.launch.timeout_s, poll_s=self.poll_s,
                )  # fmt: skip
            finally:
                for group in self.groups:
                    if group.follower is not None:
                        group.follower.join(5)
            if timed_out:
                raise TrainingFailedError(
                    f"training ran past launch.timeout_s={self.cfg.launch.timeout_s}s; every "
                    f"group's job was cancelled. Worker logs under {self.cfg.launch.log_dir}"
                )

    def _submit(self, group: GroupJob) -> None:
        assert self._runner is not None
        env = {**self.nodes_env, **self._services_env, GROUP_ATTEMPT_ENV: str(group.attempt)}
        app = build_appdef(self.cfg, self.config_path, env, group=group.replica_id)
        if group.follower is not None:
            group.follower.join(5)  # the earlier attempt's last lines
        group.handle = submit(self._runner, self.cfg, app, self.credentials)
        group.handles.append(group.handle)
        group.status = None
        group.requeues = RequeueBound(self.cfg.launch, group.handle)
        nodes = self.cfg.launch.nnodes
        prefix = f"[group {group.replica_id}] "
        self.console.write(f"{prefix}submitted {group.handle} (attempt {group.attempt})\n")
        group.follower = follow_output(
            self._runner, group.handle, nodes, self.console, secrets=self.secrets,
            prefixes=[prefix if nodes == 1 else f"{prefix[:-2]} node {k}] " for k in range(nodes)],
        )  # fmt: skip
        self._tag(group)

    def _poll(self) -> bool:
        """Submit the groups not yet submitted, read every group's job, resubmit a dead one;
        True once every group succeeded."""
        assert self._runner is not None
        for group in self.groups:
            if group.handle is None:
                self._submit(group)
        for group in self.groups:
            if group.finished:
                continue
            group.status = self._runner.status(group.handle)
            if group.requeues is not None:
                group.requeues.check(group.status)
            if not _ended(group.status):
                continue
            if group.status is not None and group.status.state == AppState.SUCCEEDED:
                group.finished = True
                self.console.write(f"[group {group.replica_id}] finished\n")
            else:
                self._restart(group)
        return all(group.finished for group in self.groups)

    def _restart(self, group: GroupJob) -> None:
        state = "gone from the scheduler" if group.status is None else group.status.state.name
        max_restarts = self.cfg.fault_tolerance.max_group_restarts
        done = [g.replica_id for g in self.groups if g.finished]
        if done:
            raise self._failure(
                group, f"ended {state} after group(s) {', '.join(map(str, done))} finished "
                "the run (not resubmitted: the run's steps are done)",
            )  # fmt: skip
        if not any(g.running for g in self.groups if g is not group):
            raise self._failure(group, f"ended {state} and no live group is left to heal from")
        if group.attempt >= max_restarts:
            raise self._failure(
                group,
                f"ended {state} after fault_tolerance.max_group_restarts={max_restarts} "
                "resubmissions",
            )
        self.console.write(
            f"[group {group.replica_id}] job {group.handle} ended {state}; submitting it again "
            "to heal from a live group\n"
        )
        group.attempt += 1
        self._submit(group)

    def _failure(self, group: GroupJob, reason: str) -> TrainingFailedError:
        tail = ""
        if group.follower is not None:
            group.follower.join(5)
            tail = "".join(line for t in group.follower.tails for line in list(t)[-TAIL_LINES:])
        return TrainingFailedError(
            redact(
                f"replica group {group.replica_id}'s job {group.handle} {reason}. Worker logs: "
                f"{self.cfg.launch.log_dir}/replica-{group.replica_id}\n"
                f"--- group {group.replica_id} output (last {TAIL_LINES} lines) ---\n{tail}",
                self.secrets,
            )
        )

    def cancel_all(self) -> None:
        """Cancel every group's job still queued or running (each is waited for)."""
        assert self._runner is not None
        errors = []
        for group in self.groups:
            if group.handle is None or group.finished:
                continue
            try:
                _cancel(self._runner, group.handle)
            except Exception as err:  # cancel the others all the same
                errors.append(f"{group.handle}: {err!r}")
        if errors:
            raise RuntimeError("cancelling failed for " + "; ".join(errors))

    def _tag(self, group: GroupJob) -> None:
        """The group's Slurm job ids and restarts as tags of the MLflow run (best effort)."""
        run_id, uri = self.nodes_env.get(RUN_ID_ENV), self.nodes_env.get(TRACKING_URI_ENV)
        if not run_id or not uri or not self.cfg.metrics.enable_mlflow:
            return
        from mlflow.tracking import MlflowClient

        ids = ",".join(str(slurm_job_id(h) or h) for h in group.handles)
        tags = {
            JOB_IDS_TAG.format(group=group.replica_id): ids,
            RESTARTS_TAG.format(group=group.replica_id): str(group.attempt),
        }
        try:
            with exported(self.credentials):
                client = MlflowClient(tracking_uri=uri)
                for key, value in tags.items():
                    client.set_tag(run_id, key, value)
                key = RESTARTS_METRIC.format(group=group.replica_id)
                client.log_metric(run_id, key, float(group.attempt),
                                  timestamp=int(time.time() * 1000), step=group.attempt)  # fmt: skip
        except Exception as err:  # tracking must not stop training
            logger.warning("cannot tag the MLflow run with %s: %s", tags, redact(str(err)))
