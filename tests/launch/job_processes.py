"""Run the training node in a process of its own, find the processes it starts, interrupt it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from train.helpers import REPO

NODE_SCRIPT = """
import json
from titan_kedro.pipelines.training.nodes import train_model
job = json.loads({job!r})
train_model({{"vocab_size": 512}}, {{}}, **job)
"""


def start_training_node(job: dict[str, Any], output: Path) -> subprocess.Popen[bytes]:
    """The training node on ``job`` in a new Python process (the ``kedro run`` process).

    Its output (stdout and stderr) goes to the file ``output``.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    with output.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(NODE_SCRIPT.format(job=json.dumps(job)))],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip


def is_worker(proc: psutil.Process) -> bool:
    """A training worker (``python -m titan_kedro.train``), not an agent or a wrapper."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    agent = "torch.distributed.run" in cmd or "titan_kedro.runs.loopback_agent" in cmd
    return "titan_kedro.train" in cmd and not agent


Family = Callable[[], tuple[list[psutil.Process], list[psutil.Process]]]
"""``(every process of the job, its workers)`` as found now."""


def descendants(node: subprocess.Popen[Any]) -> Family:
    """The processes below ``node`` (agents, wrappers, workers) and the workers among them."""
    parent = psutil.Process(node.pid)

    def family() -> tuple[list[psutil.Process], list[psutil.Process]]:
        found = [p for p in parent.children(recursive=True) if p.is_running()]
        return found, [p for p in found if is_worker(p)]

    return family


def wait_for_workers(
    proc: subprocess.Popen[Any],
    family: Family,
    count: int,
    *,
    timeout_s: float = 120,
    output: Callable[[], str] = lambda: "",
) -> list[psutil.Process]:
    """Every process of the job once ``count`` workers run (``proc`` is the launching process).

    Raises:
        AssertionError: They did not start within ``timeout_s``; ``output()`` is shown.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        processes, workers = family()
        if len(workers) >= count:
            return processes
        time.sleep(0.5)
    raise AssertionError(f"{count} workers never started; output:\n{output()[-3000:]}")


def interrupt_once_training(
    proc: subprocess.Popen[Any],
    family: Family,
    *,
    workers: int = 2,
    start_timeout_s: float = 120,
    exit_timeout_s: float = 90,
) -> tuple[str, list[psutil.Process]]:
    """SIGINT ``proc`` once ``family()`` shows ``workers`` workers; its piped output (or "")
    and every process of the job as found before the signal."""
    try:
        processes = wait_for_workers(proc, family, workers, timeout_s=start_timeout_s)
        time.sleep(2)  # the workers are inside training now
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=exit_timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return output or "", processes
