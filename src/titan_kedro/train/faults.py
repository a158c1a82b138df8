"""Test-only hooks, behind one switch that is read once, when the trainer is built.

Nothing here acts unless ``TITAN_KEDRO_TEST_HOOKS=1``; without it the variables below are
ignored, even when set. With it:

- ``TITAN_KEDRO_CRASH_AT_STEP=<step>`` (and optionally ``TITAN_KEDRO_CRASH_RANK=<rank>``,
  default 0): that rank calls ``os._exit`` before that step's forward pass, but only while
  ``TORCHELASTIC_RESTART_COUNT`` is 0, so the group torchrun restarts trains on normally.
- With fault-tolerant replica groups, ``TITAN_KEDRO_CRASH_GROUP=<replica id>`` picks the
  group: that group's rank SIGKILLs itself (a machine lost, no handler runs), only on the
  group's first start (``ft.identity.group_attempt`` 0), so the restarted group heals and
  trains on.
- ``TITAN_KEDRO_CRASH_HANG=1``: the crashing rank prints that it waits and sleeps instead
  of dying, so the test kills it from outside (``scancel``, ``scontrol requeue``: how a
  lost node or a preemption looks to Slurm). No crash hook fires in a job Slurm requeued
  (``SLURM_RESTART_COUNT`` above 0).
- ``TITAN_KEDRO_DEGRADED_STEP_DELAY_S=<seconds>`` slows the steps the live groups take
  without all groups (``ft.replica.ReplicaGroupFT.begin_step``), so they are still
  training when a killed group returns (a real step takes minutes, a test's milliseconds).
- Each rank of a fault-tolerant run writes the SHA-256 of its final training state to
  ``{job.dump_folder}/ft/replica-<g>-rank-<r>.json`` (groups in lock-step agree).

The environment is read once (``TestHooks.from_env``) into a frozen object whose crash
step is already resolved for this rank, so a training step only compares two integers.
This is how restart, resume and healing are tested; never set them in real runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from titan_kedro.ft.identity import (
    GROUP_ATTEMPT_ENV,
    REPLICA_ID_ENV,
    SLURM_RESTART_ENV,
    TORCHRUN_RESTART_ENV,
)

TEST_HOOKS_ENV = "TITAN_KEDRO_TEST_HOOKS"
"""The one switch: ``1`` turns the test hooks on; anything else leaves them all off."""
CRASH_STEP_ENV = "TITAN_KEDRO_CRASH_AT_STEP"
CRASH_RANK_ENV = "TITAN_KEDRO_CRASH_RANK"
CRASH_GROUP_ENV = "TITAN_KEDRO_CRASH_GROUP"
CRASH_HANG_ENV = "TITAN_KEDRO_CRASH_HANG"
DEGRADED_DELAY_ENV = "TITAN_KEDRO_DEGRADED_STEP_DELAY_S"
CRASH_EXIT_CODE = 17

Number = TypeVar("Number", int, float)


@dataclass(frozen=True)
class TestHooks:
    """What the test hooks ask of this rank (all off by default)."""

    __test__ = False  # not a pytest test class

    crash_at_step: int | None = None
    """The step before whose forward pass this rank dies (None: it never does)."""
    crash_group: str | None = None
    """The replica group that dies (SIGKILL) instead of exiting; None without one."""
    crash_hang: bool = False
    """The crashing rank waits to be killed from outside instead of dying."""
    degraded_step_delay_s: float = 0.0
    """Seconds each fault-tolerant step sleeps while fewer than all groups take part."""
    state_digest: bool = False
    """Whether a fault-tolerant run writes its final state's SHA-256."""

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None) -> TestHooks:
        """Read the switch and the hooks' variables once, for rank ``rank``.

        Args:
            rank: This process's rank (the crash hooks name one).
            environ: The environment (default ``os.environ``).

        Raises:
            ValueError: The switch is on and a variable is not a number.
        """
        env = os.environ if environ is None else environ
        if env.get(TEST_HOOKS_ENV) != "1":
            return cls()
        return cls(
            crash_at_step=_crash_step(env, rank),
            crash_group=env.get(CRASH_GROUP_ENV),
            crash_hang=env.get(CRASH_HANG_ENV) == "1",
            degraded_step_delay_s=_number(env, DEGRADED_DELAY_ENV, float, "0"),
            state_digest=True,
        )

    def crash(self, step: int, rank: int) -> None:
        """Die now (the trainer calls this when ``step == crash_at_step``), or wait to be
        killed (``crash_hang``)."""
        if self.crash_hang:
            print(f"[fault injection] rank {rank} waits to be killed at step {step}",
                  file=sys.stderr, flush=True)  # fmt: skip
            while True:
                time.sleep(3600)
        if self.crash_group is not None:
            print(f"[fault injection] group {self.crash_group} rank {rank} SIGKILLs itself at "
                  f"step {step}", file=sys.stderr, flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"[fault injection] rank {rank} exits at step {step}", file=sys.stderr, flush=True)
        os._exit(CRASH_EXIT_CODE)


def _crash_step(env: Mapping[str, str], rank: int) -> int | None:
    """The step this rank crashes at on this attempt, or None."""
    if not env.get(CRASH_STEP_ENV):
        return None
    step = _number(env, CRASH_STEP_ENV, int, "0")
    if _number(env, CRASH_RANK_ENV, int, "0") != rank:
        return None
    if any(_number(env, name, int, "0") for name in (TORCHRUN_RESTART_ENV, SLURM_RESTART_ENV)):
        return None
    group = env.get(CRASH_GROUP_ENV)
    if group is not None and (
        env.get(REPLICA_ID_ENV) != group or _number(env, GROUP_ATTEMPT_ENV, int, "0") != 0
    ):
        return None
    return step


def _number(
    env: Mapping[str, str], name: str, parse: Callable[[str], Number], default: str
) -> Number:
    value = env.get(name) or default
    try:
        return parse(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not {'an integer' if parse is int else 'a number'} (a test "
            f"hook, read because {TEST_HOOKS_ENV}=1): set a number or unset it"
        ) from None
