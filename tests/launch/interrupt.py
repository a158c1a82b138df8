"""Interrupt a launching process once its workers train, and report what it started."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import psutil


def interrupt_once_training(
    proc: subprocess.Popen[str],
    family: Callable[[], tuple[list[psutil.Process], list[psutil.Process]]],
    *,
    workers: int = 2,
    start_timeout_s: float = 120,
    exit_timeout_s: float = 90,
) -> tuple[str, list[psutil.Process]]:
    """SIGINT ``proc`` once ``family()`` shows ``workers`` workers; its output and the family.

    Args:
        proc: The ``kedro run`` (or node) process, its output piped as text.
        family: ``(every process of the job, its workers)`` as found now.
        workers: How many workers must run first.
        start_timeout_s: How long the workers may take to start.
        exit_timeout_s: How long ``proc`` may take to exit after the signal.
    """
    found: list[psutil.Process] = []
    deadline = time.monotonic() + start_timeout_s
    try:
        while len(found) < workers and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            _, found = family()
        assert len(found) == workers, f"the {workers} workers never started"
        processes, _ = family()
        time.sleep(2)  # the workers are inside training now
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=exit_timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return output, processes
