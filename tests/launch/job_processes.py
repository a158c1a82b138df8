"""Run the training node in a process of its own and find the processes it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
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
    return "titan_kedro.train" in cmd and "torch.distributed.run" not in cmd


def wait_for_workers(
    node: subprocess.Popen[bytes], count: int, output: Path, timeout_s: float = 120
) -> list[psutil.Process]:
    """Every process below ``node`` once ``count`` workers run (agents, wrappers, workers)."""
    parent = psutil.Process(node.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and node.poll() is None:
        family = [p for p in parent.children(recursive=True) if p.is_running()]
        if sum(is_worker(p) for p in family) >= count:
            return family
        time.sleep(0.5)
    raise AssertionError(
        f"{count} workers never started; node output:\n{output.read_text(errors='replace')[-3000:]}"
    )
