"""Test-only fault injection: make one rank die at a chosen step on the first attempt.

Set ``TITAN_KEDRO_CRASH_AT_STEP=<step>`` (and optionally ``TITAN_KEDRO_CRASH_RANK=<rank>``,
default 0). The rank calls ``os._exit`` before that step's forward pass, but only while
``TORCHELASTIC_RESTART_COUNT`` is 0, so the group torchrun restarts trains on normally.
This is how the restart-and-resume behaviour is tested; never set it in real runs.
"""

from __future__ import annotations

import os
import sys

CRASH_STEP_ENV = "TITAN_KEDRO_CRASH_AT_STEP"
CRASH_RANK_ENV = "TITAN_KEDRO_CRASH_RANK"
CRASH_EXIT_CODE = 17


def maybe_crash(step: int, rank: int) -> None:
    """Exit hard if the environment asks this rank to crash at this step."""
    target = os.environ.get(CRASH_STEP_ENV)
    if not target or int(target) != step:
        return
    if int(os.environ.get(CRASH_RANK_ENV, "0")) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    print(f"[fault injection] rank {rank} exits at step {step}", file=sys.stderr, flush=True)
    os._exit(CRASH_EXIT_CODE)
