"""torchrun on this machine: its command line, the local worker group, its failures.

It builds the ``python -m torch.distributed.run … -m titan_kedro.train``
command from the ``launch`` section, passes the active MLflow run to the workers through
``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI``, streams rank 0's output to the console, and
on failure raises with the tail of the failing rank's log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from titan_kedro.tracking.mlflow_logger import RUN_ID_ENV, TRACKING_URI_ENV


class TrainingFailedError(RuntimeError):
    """The torchrun worker group exited with an error; the message holds the worker's log."""


def torchrun_command(
    launch: Any,
    config_path: str | Path,
    *,
    python: str = sys.executable,
    rendezvous: tuple[str, str] | None = None,
) -> list[str]:
    """The torchrun command line for the ``launch`` section and a job-config file.

    A c10d rendezvous at ``rendezvous`` (endpoint, id) if given, else at
    ``launch.rdzv_endpoint`` with ``launch.rdzv_id``; a single node without either uses
    ``--standalone``. Rank 0's output is teed to the console; every rank's output goes to
    ``log_dir``. Ranks come from the rendezvous, so every node runs the same command.
    """
    cmd = [
        python, "-m", "torch.distributed.run",
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
        f"--log-dir={launch.log_dir}",
        "--tee=3",
        "--local-ranks-filter=0",
    ]  # fmt: skip
    endpoint, rdzv_id = rendezvous or (launch.rdzv_endpoint, launch.rdzv_id)
    if endpoint:
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
        message = ""
        if error.is_file():
            try:
                message = json.loads(error.read_text())["message"]["message"]
            except (ValueError, KeyError, TypeError):
                message = ""
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


def launch_training(
    cfg: Any,
    config_path: str | Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    console: IO[str] | None = None,
    cwd: str | Path | None = None,
) -> None:
    """Run the torchrun worker group to completion, streaming rank 0's output.

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
    log_dir = Path(launch.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    before = run_dirs(log_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **mlflow_env(), **dict(extra_env or {})}
    # torchrun forces OMP_NUM_THREADS=1 otherwise; the worker sets its own thread count.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launch.nproc_per_node)))
    cmd = torchrun_command(launch, config_path)
    console.write("launching: " + " ".join(cmd) + "\n")
    console.flush()
    tail: deque[str] = deque(maxlen=400)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", bufsize=1, start_new_session=True,
    )  # fmt: skip
    expired = threading.Event()

    def _on_timeout() -> None:
        expired.set()
        _kill_group(proc)

    # A timer, not a check between lines: a hung group prints nothing.
    watchdog = threading.Timer(launch.timeout_s, _on_timeout) if launch.timeout_s else None
    assert proc.stdout is not None
    try:
        if watchdog is not None:
            watchdog.daemon = True
            watchdog.start()
        for line in proc.stdout:
            console.write(line)
            console.flush()
            tail.append(line)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
    timed_out = expired.is_set()
    if rc == 0 and not timed_out:
        return
    output = "".join(tail)
    worker_log = new_failing_rank_log(log_dir, before, output)
    reason = (
        f"ran past launch.timeout_s={launch.timeout_s}s and was stopped"
        if timed_out
        else f"exited with code {rc}"
    )
    raise TrainingFailedError(
        f"training {reason}. Command: {' '.join(cmd)}\nWorker logs: {log_dir}\n"
        + (worker_log or "--- torchrun output ---\n" + "\n".join(output.splitlines()[-60:]))
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
