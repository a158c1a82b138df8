"""Test-only fault injection: make one rank die at a chosen step on the first attempt.

Set ``TITAN_KEDRO_CRASH_AT_STEP=<step>`` (and optionally ``TITAN_KEDRO_CRASH_RANK=<rank>``,
default 0). The rank calls ``os._exit`` before that step's forward pass, but only while
``TORCHELASTIC_RESTART_COUNT`` is 0, so the group torchrun restarts trains on normally.

With fault-tolerant replica groups, ``TITAN_KEDRO_CRASH_GROUP=<replica id>`` picks the
group: that group's rank SIGKILLs itself (a machine lost, no handler runs), only on the
group's first start (``ft.identity.group_attempt`` 0), so the restarted group heals and
trains on; ``TITAN_KEDRO_DEGRADED_STEP_DELAY_S`` (read by ``ft.replica``) slows the
steps the live groups take without it, so they are still training when it returns (a
real step takes minutes, a test's milliseconds). This is how restart, resume and healing
are tested; never set them in real runs.
"""

from __future__ import annotations

import os
import signal
import sys

from titan_kedro.ft.identity import REPLICA_ID_ENV, group_attempt

CRASH_STEP_ENV = "TITAN_KEDRO_CRASH_AT_STEP"
CRASH_RANK_ENV = "TITAN_KEDRO_CRASH_RANK"
CRASH_GROUP_ENV = "TITAN_KEDRO_CRASH_GROUP"
CRASH_EXIT_CODE = 17


def maybe_crash(step: int, rank: int) -> None:
    """Exit hard if the environment asks this rank (of this replica group) to crash at this step."""
    target = os.environ.get(CRASH_STEP_ENV)
    if not target or int(target) != step:
        return
    if int(os.environ.get(CRASH_RANK_ENV, "0")) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    group = os.environ.get(CRASH_GROUP_ENV)
    if group is not None:
        if os.environ.get(REPLICA_ID_ENV) != group or group_attempt() != 0:
            return
        print(f"[fault injection] group {group} rank {rank} SIGKILLs itself at step {step}",
              file=sys.stderr, flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"[fault injection] rank {rank} exits at step {step}", file=sys.stderr, flush=True)
    os._exit(CRASH_EXIT_CODE)
