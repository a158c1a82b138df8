"""Submit the training job to a TorchX scheduler, follow it, and turn its end into a result.

``run_job`` submits the AppDef through TorchX's runner, echoes every node's agent output
(torchrun tees only local rank 0, so the training progress is rank 0's), polls the job
until it ends, and cancels it when ``kedro run`` is interrupted (Ctrl-C, SIGTERM) or
``launch.timeout_s`` passes. A failed job raises ``TrainingFailedError`` with the failing
replica's log tail and, where the torchrun log folder is visible, the failing rank's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from torchx.runner import Runner
from torchx.specs import AppDef, AppDryRunInfo, AppState, AppStatus

from titan_kedro.config.schema import LOCAL_CWD_SCHEDULER
from titan_kedro.launch.appdef import HOST_SCHEDULERS, ROLE, ROLE_ARGS
from titan_kedro.launch.runner import get_runner
from titan_kedro.launch.secrets import (
    exported,
    redact,
    secret_values,
    tracking_secrets,
    with_secret_ref,
)
from titan_kedro.launch.slurm_jobs import (
    RequeueBound,
    continuable_end,
    continuing,
    slurm_job_id,
)
from titan_kedro.launch.supervise import OutputFollower, supervise, wait_until
from titan_kedro.launch.torchrun import (
    TrainingFailedError,
    error_file_message,
    new_failing_rank_log,
    run_dirs,
)
from titan_kedro.tracking.mlflow_logger import TRACKING_URI_ENV

logger = logging.getLogger(__name__)

TAIL_LINES = 60


def run_options(launch: Any) -> dict[str, Any]:
    """TorchX run options: ``launch.scheduler_args`` without the role's ``image`` / ``mounts``.

    ``local_cwd`` writes its replicas' logs under ``launch.log_dir`` unless told otherwise
    (TorchX follows logs only from files there).
    """
    opts = {k: v for k, v in launch.scheduler_args.items() if k not in ROLE_ARGS}
    if launch.scheduler == LOCAL_CWD_SCHEDULER:
        opts.setdefault("log_dir", str(Path(launch.log_dir).resolve() / "torchx"))
    return opts


def _check_options(runner: Runner, scheduler: str, opts: Mapping[str, Any]) -> None:
    known = runner.scheduler_run_opts(scheduler)
    unknown = sorted(set(opts) - {name for name, _ in known})
    if unknown:
        valid = ", ".join(sorted([*(name for name, _ in known), *ROLE_ARGS]))
        raise ValueError(
            f"launch.scheduler_args has {', '.join(unknown)}, which {scheduler} does not take; "
            f"valid keys: {valid}"
        )


@contextlib.contextmanager
def signals_restored() -> Iterator[None]:
    """The process's SIGINT/SIGTERM handlers are back afterwards.

    TorchX's local scheduler installs handlers of its own when it is created; while the job
    runs, Ctrl-C and SIGTERM raise ``KeyboardInterrupt`` instead, so the job is cancelled.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _install_interrupt_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def dryrun_info(runner: Runner, app: AppDef, launch: Any) -> AppDryRunInfo:
    """What TorchX would submit (the sbatch script, the Volcano job, …), after checking options."""
    opts = run_options(launch)
    _check_options(runner, launch.scheduler, opts)
    return runner.dryrun(app, launch.scheduler, cfg=opts)


def render_request(info: AppDryRunInfo, env: Mapping[str, str]) -> str:
    """TorchX's rendering of the request, credentials masked (``secrets.redact``)."""
    return redact(str(info), tracking_secrets(env))


WORKER_FAILED = re.compile(r"^[EWI](\d{4} \d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode: ")
"""torchrun's record of a failed worker, with its time: ``E1206 23:04:34.057000 <pid>
torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 17) …``."""


def _failure_time(tail: Iterable[str]) -> str:
    """When ``tail``'s torchrun saw a worker fail ("MMDD HH:MM:SS.ffffff", comparable as
    text within a year); "~", after every time, when it does not say."""
    return next((m.group(1) for line in tail if (m := WORKER_FAILED.match(line))), "~")


def failing_replica(status: AppStatus, tails: list[deque[str]]) -> int:
    """The replica that failed first: its torchrun reports a failed worker ("Root Cause") and
    was not stopped by a signal (Slurm stops the others once one fails), the earliest by
    torchrun's own time; else the first the scheduler marks failed; else one whose log
    shows an error.

    The crashed rank's peers often fail too before Slurm stops them (their collective loses
    its connection), so more than one replica can report a root cause: the earliest is the
    cause."""

    def says(k: int, text: str) -> bool:
        return any(text in line for line in tails[k])

    reported = [k for k in range(len(tails)) if says(k, "Root Cause")]
    unsignalled = [k for k in reported if not says(k, "got signal")]
    if unsignalled:
        return min(unsignalled, key=lambda k: (_failure_time(tails[k]), k))
    if reported:
        return reported[0]
    for role in status.roles:
        for replica in role.replicas:
            if replica.state == AppState.FAILED:
                return int(replica.id)
    for k, tail in enumerate(tails):
        if any("Traceback" in line or "Error" in line for line in tail):
            return k
    return 0


def submit(runner: Runner, cfg: Any, app: AppDef, credentials: Mapping[str, str]) -> str:
    """Submit ``app`` to ``cfg.launch.scheduler`` (options checked); its TorchX handle.

    ``sbatch`` (and ``local_cwd``) hand this process's environment to the job: the
    credentials travel by name, and the URI as the nodes get it (the user's own may hold
    them); Kubernetes references the Secret instead (``with_secret_ref``).
    """
    launch = cfg.launch
    info = with_secret_ref(dryrun_info(runner, app, launch), launch.scheduler_args)
    _install_interrupt_handlers()  # after TorchX's local scheduler installed its own
    uri = {k: v for k, v in app.roles[0].env.items() if k == TRACKING_URI_ENV}
    host = launch.scheduler in HOST_SCHEDULERS
    with exported({**credentials, **uri} if host else {}):
        handle = runner.schedule(info)
    replicas = app.roles[0].num_replicas
    logger.info("submitted %s (%d × %d workers)", handle, replicas, launch.nproc_per_node)
    return handle


def follow_output(
    runner: Runner,
    handle: str,
    replicas: int,
    console: IO[str],
    *,
    secrets: Iterable[str],
    prefixes: list[str] | None,
) -> OutputFollower:
    """Echo every replica's output of job ``handle`` (masked), keeping the tails."""
    secrets = list(secrets)
    return OutputFollower(
        [
            lambda k=k: (
                redact(line, secrets)
                for line in runner.log_lines(handle, ROLE, k, should_tail=True)
            )
            for k in range(replicas)
        ],
        console,
        prefixes,
    )


def _ended(status: AppStatus | None) -> bool:
    return status is None or status.is_terminal()


def _cancel(runner: Runner, handle: str) -> None:
    logger.warning("cancelling %s", handle)
    runner.cancel(handle)
    wait_until(lambda: runner.status(handle), _ended, 60)


def run_job(
    cfg: Any,
    app: AppDef,
    *,
    console: IO[str] | None = None,
    poll_s: float | None = None,
    credentials: Mapping[str, str] | None = None,
) -> str:
    """Submit ``app`` to ``cfg.launch.scheduler`` and wait until it succeeds.

    Args:
        cfg: The job config (reads ``launch``).
        app: The job (``build_appdef``).
        console: Where the nodes' output is echoed (default ``sys.stdout``).
        poll_s: Seconds between status checks (default 0.5 on this machine, 5 remote).
        credentials: MLflow's credential variables for the nodes (``secrets.node_env``):
            exported by name from this process to ``sbatch`` (and ``local_cwd``), referenced
            as the Secret ``launch.scheduler_args.mlflow_secret`` on Kubernetes.

    Returns:
        The TorchX app handle (``scheduler://session/app_id``).

    Raises:
        TrainingFailedError: The job failed, was cancelled by the scheduler, or ran past
            ``launch.timeout_s`` (then it is cancelled); the message holds the log tails.
        KeyboardInterrupt: ``kedro run`` was interrupted; the job was cancelled first.
    """
    launch = cfg.launch
    console = console or sys.stdout
    poll_s = poll_s or (0.5 if launch.scheduler == LOCAL_CWD_SCHEDULER else 5.0)
    log_dir = Path(launch.log_dir)
    before = run_dirs(log_dir)
    credentials = dict(credentials or {})
    secrets = secret_values(credentials)
    replicas = app.roles[0].num_replicas
    kind = "group" if cfg.fault_tolerance.enable else "node"
    deadline = time.monotonic() + launch.timeout_s if launch.timeout_s else None
    earlier: list[str] = []  # ended Slurm jobs that the next submission continues
    with signals_restored(), get_runner() as runner:
        while True:
            handle = submit(runner, cfg, continuing(app, earlier), credentials)
            follower = follow_output(
                runner, handle, replicas, console, secrets=secrets,
                prefixes=[f"[{kind} {k}] " for k in range(replicas)] if replicas > 1 else None,
            )  # fmt: skip
            requeues = RequeueBound(launch, handle)
            status, timed_out = supervise(
                lambda: requeues.check(runner.status(handle)),  # noqa: B023  (this attempt's)
                _ended,
                lambda: _cancel(runner, handle),  # noqa: B023
                timeout_s=None if deadline is None else max(1.0, deadline - time.monotonic()),
                poll_s=poll_s,
            )
            follower.join(10)
            ended = None if timed_out or status is None else continuable_end(handle)
            if ended is None or len(earlier) >= launch.continues:
                break
            earlier.append(str(slurm_job_id(handle)))
            logger.warning(
                "Slurm job %s ended %s: submitting it again (%d of launch.auto_continue=%d) to "
                "continue from its latest checkpoint in the same MLflow run",
                handle, ended, len(earlier), launch.continues,
            )  # fmt: skip
    if status is not None and status.state == AppState.SUCCEEDED and not timed_out:
        return handle
    state = "gone from the scheduler" if status is None else status.state.name
    k = failing_replica(status, follower.tails) if status is not None else 0
    replica_log = "".join(list(follower.tails[k])[-TAIL_LINES:])
    rank_log = new_failing_rank_log(log_dir, before, replica_log)
    reason = (
        f"ran past launch.timeout_s={launch.timeout_s}s and was cancelled"
        if timed_out
        else f"ended {state}"
    )
    error = error_file_message(status.structured_error_msg if status is not None else "")
    raise TrainingFailedError(
        redact(
            f"training job {handle} {reason}. Worker logs: {log_dir}\n"
            f"--- {kind} {k} output (last {TAIL_LINES} lines) ---\n{replica_log}"
            + (f"\n{rank_log}" if rank_log else "")
            + (f"\n--- scheduler error ---\n{error}" if error else ""),
            secrets,
        )
    )
