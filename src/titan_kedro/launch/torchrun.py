"""torchrun on this machine: its command line, the local worker group, its failures.

``torchrun_command`` builds ``python -m torch.distributed.run … -m titan_kedro.train``
from the ``launch`` section (TorchX jobs run the same line on every node).
``start_torchrun`` starts one agent here, in a session of its own and with a parent-death
signal, so it ends when this process does, even by SIGKILL (its workers end with it);
``follow_torchrun`` echoes rank 0's output, stops the group on an interrupt or past
``launch.timeout_s``, and on failure raises ``TrainingFailedError`` with the tail of the
failing rank's log. ``launch_training`` is both, for ``launch.scheduler: local``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from titan_kedro.launch.secrets import redact, secret_values, split_tracking_uri, worker_env
from titan_kedro.launch.supervise import OutputFollower, supervise
from titan_kedro.runs.parent_death import guarded_command
from titan_kedro.tracking.mlflow_logger import RUN_ID_ENV, TRACKING_URI_ENV


class TrainingFailedError(RuntimeError):
    """The torchrun worker group exited with an error; the message holds the worker's log."""


def torchrun_command(
    launch: Any,
    config_path: str | Path,
    *,
    python: str = sys.executable,
    rendezvous: tuple[str, str] | None = None,
    loopback: bool = False,
) -> list[str]:
    """The torchrun command line for the ``launch`` section and a job-config file.

    A c10d rendezvous at ``rendezvous`` (endpoint, id) if given, else at
    ``launch.rdzv_endpoint`` with ``launch.rdzv_id`` (None: a random id, unguessable); a
    single node without either uses ``--standalone``. Rank 0's output is teed to the
    console; every rank's output goes to ``log_dir``. Ranks come from the rendezvous, so
    every node runs the same command. ``loopback`` (agents on this machine only): torchrun
    through ``runs.loopback_agent``, whose stores listen on 127.0.0.1 only.
    """
    agent = "titan_kedro.runs.loopback_agent" if loopback else "torch.distributed.run"
    cmd = [
        python, "-m", agent,
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
        f"--log-dir={launch.log_dir}",
        "--tee=3",
        "--local-ranks-filter=0",
    ]  # fmt: skip
    if loopback:
        cmd.append("--local-addr=127.0.0.1")  # where the workers reach the agent's store
    endpoint, rdzv_id = rendezvous or (launch.rdzv_endpoint, launch.rdzv_id)
    if endpoint:
        rdzv_id = rdzv_id or secrets.token_hex(16)
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    elif launch.nnodes == 1:
        cmd.append("--standalone")
    else:
        raise ValueError(
            f"launch.nnodes={launch.nnodes} needs launch.rdzv_endpoint (host:port of the "
            "rendezvous, reachable from every node)"
        )
    return [*cmd, "-m", "titan_kedro.train", "--config", str(config_path)]


def mlflow_env() -> dict[str, str]:
    """``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` of the active MLflow run (empty if none)."""
    try:
        import mlflow
    except ImportError:
        return {}
    run = mlflow.active_run()
    if run is None:
        return {}
    return {RUN_ID_ENV: run.info.run_id, TRACKING_URI_ENV: mlflow.get_tracking_uri()}


def error_file_message(text: str) -> str:
    """The message of a torchelastic error file (``error.json``; TorchX's structured error).

    Text that is not such a file is returned as is; ``<NONE>`` (no error) gives "".
    """
    if not text or text == "<NONE>":
        return ""
    try:
        return str(json.loads(text)["message"]["message"])
    except (ValueError, KeyError, TypeError):
        return text


def run_dirs(log_dir: Path) -> set[Path]:
    """The torchrun run folders (one per agent and launch) under ``log_dir``."""
    return {p for p in log_dir.iterdir() if p.is_dir()} if log_dir.is_dir() else set()


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def failing_rank_log(run_dir: Path | None, torchrun_output: str, lines: int = 40) -> str:
    """Tail of the log of the rank torchrun names as the root cause (best effort)."""
    if run_dir is None or not run_dir.is_dir():
        return ""
    attempts = sorted(run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return ""
    root = torchrun_output.split("Root Cause", 1)[-1]
    match = re.search(r"local_rank:\s*(\d+)", root)
    candidates = []
    if match:
        candidates.append(attempts[-1] / match.group(1))
    candidates += sorted(p.parent for p in attempts[-1].glob("*/error.json"))
    for rank_dir in candidates:
        error = rank_dir / "error.json"
        message = error_file_message(error.read_text()) if error.is_file() else ""
        log = _tail(rank_dir / "stderr.log", lines)
        if log or message:
            header = (
                f"--- {rank_dir.relative_to(run_dir.parent)}/stderr.log (last {lines} lines) ---"
            )
            return f"{header}\n{log}" + (
                f"\n--- error ---\n{message}" if message and message not in log else ""
            )
    return ""


def new_failing_rank_log(log_dir: Path, before: set[Path], torchrun_output: str) -> str:
    """:func:`failing_rank_log` of the newest run folder, not in ``before``, that has one."""
    for run_dir in sorted(
        run_dirs(log_dir) - before, key=lambda p: p.stat().st_mtime, reverse=True
    ):
        found = failing_rank_log(run_dir, torchrun_output)
        if found:
            return found
    return ""


@dataclass
class TorchrunGroup:
    """One torchrun agent started here, with what its error report needs."""

    process: subprocess.Popen[str]
    """torchrun itself (its own session; its output merged into ``stdout``)."""
    command: list[str]
    """The command line, for the error message."""
    log_dir: Path
    """torchrun's ``--log-dir``."""
    before: set[Path]
    """The run folders already in ``log_dir`` before this start."""
    secrets: list[str] = field(default_factory=list)
    """Credential values in the workers' environment, masked in echoed output and errors."""


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def start_torchrun(
    launch: Any,
    config_path: str | Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    command: Sequence[str] | None = None,
) -> TorchrunGroup:
    """Start one torchrun agent (one node's workers) as a child that ends with this process.

    torchrun is started through ``runs.parent_death``'s wrapper: it gets SIGKILL when the
    calling thread exits, so call this from the thread that follows the group
    (``follow_torchrun``), not a short-lived one.

    Args:
        launch: The ``launch`` section.
        config_path: The resolved job config the workers load.
        extra_env: More environment variables for the workers.
        cwd: Working directory of the workers (default: the current one).
        command: The torchrun command line (default ``torchrun_command(launch, config_path)``).
    """
    log_dir = Path(launch.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    before = run_dirs(log_dir)
    given = {**os.environ, "PYTHONUNBUFFERED": "1", **mlflow_env(), **dict(extra_env or {})}
    # The workers' URI holds no credentials: they get MLflow's credential variables instead.
    env = worker_env(given)
    # torchrun forces OMP_NUM_THREADS=1 otherwise; the worker sets its own thread count.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launch.nproc_per_node)))
    # Every worker (and every replica group) is on this machine: gloo's sockets, within a
    # group and TorchFT's between groups, listen on loopback, not where the host name points.
    env[GLOO_IFNAME_ENV] = loopback_interface()
    cmd = list(command or torchrun_command(launch, config_path, loopback=True))
    process = subprocess.Popen(
        guarded_command(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True,
    )  # fmt: skip
    secrets = secret_values(split_tracking_uri(given.get(TRACKING_URI_ENV), given).credentials)
    return TorchrunGroup(process, cmd, log_dir, before, secrets)


def stop_torchrun(group: TorchrunGroup, grace_s: float = 20) -> None:
    """SIGTERM to the agent's process group, SIGKILL after ``grace_s``; waits for it."""
    proc = group.process
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def follow_torchrun(
    group: TorchrunGroup,
    *,
    timeout_s: float | None = None,
    console: IO[str] | None = None,
) -> None:
    """Echo the group's output until it ends; stop it past ``timeout_s`` or when interrupted.

    Raises:
        TrainingFailedError: torchrun exited non-zero or ran past ``timeout_s``; the
            message quotes the failing rank's log tail.
        KeyboardInterrupt: The caller was interrupted; the group was stopped first.
    """
    proc = group.process
    assert proc.stdout is not None
    stdout = proc.stdout
    follower = OutputFollower(
        [lambda: (redact(line, group.secrets) for line in stdout)], console or sys.stdout
    )
    rc, timed_out = supervise(
        proc.poll, lambda code: code is not None, lambda: stop_torchrun(group),
        timeout_s=timeout_s, poll_s=0.2,
    )  # fmt: skip
    follower.join(10)
    if rc == 0 and not timed_out:
        return
    output = "".join(follower.tails[0])
    worker_log = new_failing_rank_log(group.log_dir, group.before, output)
    reason = (
        f"ran past launch.timeout_s={timeout_s}s and was stopped"
        if timed_out
        else f"exited with code {rc}"
    )
    raise TrainingFailedError(
        redact(
            f"training {reason}. Command: {' '.join(group.command)}\n"
            f"Worker logs: {group.log_dir}\n"
            + (worker_log or "--- torchrun output ---\n" + "\n".join(output.splitlines()[-60:])),
            group.secrets,
        )
    )


def launch_training(
    cfg: Any,
    config_path: str | Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    console: IO[str] | None = None,
    cwd: str | Path | None = None,
) -> None:
    """Run the torchrun worker group here to completion, streaming rank 0's output.

    Args:
        cfg: The job config (reads ``launch``).
        config_path: The resolved job config the workers load.
        extra_env: More environment variables for the workers.
        console: Where output is echoed (default ``sys.stdout``).
        cwd: Working directory of the workers (default: the current one).

    Raises:
        TrainingFailedError: torchrun exited non-zero or ran past ``launch.timeout_s``;
            the message quotes the failing rank's log tail.
    """
    launch = cfg.launch
    if launch.nnodes > 1:
        raise ValueError(
            f"launch.nnodes={launch.nnodes} with launch.scheduler=local: torchrun here starts "
            "one node only; set launch.scheduler to local_cwd (several agents on this machine), "
            "slurm, kubernetes or another TorchX scheduler"
        )
    console = console or sys.stdout
    group = start_torchrun(launch, config_path, extra_env=extra_env, cwd=cwd)
    console.write("launching: " + " ".join(group.command) + "\n")
    console.flush()
    follow_torchrun(group, timeout_s=launch.timeout_s, console=console)
