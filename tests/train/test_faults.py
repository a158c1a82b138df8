"""The test hooks sit behind one switch, read once into a frozen object."""

from __future__ import annotations

import dataclasses

import pytest

from titan_kedro.train.faults import TestHooks

EVERY_HOOK = {
    "TITAN_KEDRO_CRASH_AT_STEP": "3",
    "TITAN_KEDRO_CRASH_RANK": "1",
    "TITAN_KEDRO_CRASH_GROUP": "0",
    "TITAN_KEDRO_REPLICA_ID": "0",
    "TITAN_KEDRO_DEGRADED_STEP_DELAY_S": "2.5",
}


@pytest.mark.parametrize("switch", [None, "0", "", "true"])
def test_without_the_switch_no_hook_acts_even_when_its_variables_are_set(
    switch: str | None,
) -> None:
    env = dict(EVERY_HOOK) if switch is None else {**EVERY_HOOK, "TITAN_KEDRO_TEST_HOOKS": switch}
    hooks = TestHooks.from_env(1, env)
    assert hooks.crash_at_step is None
    assert hooks.degraded_step_delay_s == 0.0
    assert hooks.state_digest is False
    # Not even a malformed value is read while the switch is off.
    assert TestHooks.from_env(1, {**env, "TITAN_KEDRO_CRASH_AT_STEP": "soon"}).crash_at_step is None


def test_with_the_switch_the_named_rank_crashes_on_its_first_attempt_only() -> None:
    env = {**EVERY_HOOK, "TITAN_KEDRO_TEST_HOOKS": "1"}
    hooks = TestHooks.from_env(1, env)
    assert (hooks.crash_at_step, hooks.crash_group) == (3, "0")
    assert hooks.degraded_step_delay_s == 2.5 and hooks.state_digest is True
    assert TestHooks.from_env(0, env).crash_at_step is None  # another rank
    assert TestHooks.from_env(1, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}).crash_at_step is None
    assert TestHooks.from_env(1, {**env, "TITAN_KEDRO_GROUP_ATTEMPT": "1"}).crash_at_step is None
    assert TestHooks.from_env(1, {**env, "SLURM_RESTART_COUNT": "1"}).crash_at_step is None
    assert (
        not hooks.crash_hang
        and TestHooks.from_env(1, {**env, "TITAN_KEDRO_CRASH_HANG": "1"}).crash_hang
    )
    assert TestHooks.from_env(1, {**env, "TITAN_KEDRO_REPLICA_ID": "1"}).crash_at_step is None
    without_group = {k: v for k, v in env.items() if k != "TITAN_KEDRO_CRASH_GROUP"}
    assert TestHooks.from_env(1, without_group).crash_at_step == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        hooks.crash_at_step = 4  # type: ignore[misc]


def test_with_the_switch_a_malformed_value_is_named() -> None:
    env = {"TITAN_KEDRO_TEST_HOOKS": "1", "TITAN_KEDRO_DEGRADED_STEP_DELAY_S": "slow"}
    with pytest.raises(ValueError, match="TITAN_KEDRO_DEGRADED_STEP_DELAY_S='slow'"):
        TestHooks.from_env(0, env)
