"""A continued run keeps its logged param values without patching kedro-mlflow."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import mlflow
import pytest
from kedro.framework.hooks import _create_hook_manager, hook_impl
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from titan_kedro.hooks.logged_params import KeepLoggedParamsHook


class _ParamLogger:
    """Stands in for kedro-mlflow's ``before_node_run``: logs every ``params:`` input,
    flattened to ``section.key``, into the active run with ``mlflow.log_param``."""

    @hook_impl
    def before_node_run(self, inputs: dict[str, Any]) -> None:
        def leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
            if isinstance(value, Mapping):
                for key, inner in value.items():
                    yield from leaves(f"{prefix}.{key}", inner)
            else:
                yield prefix, value

        for name, value in inputs.items():
            if name.startswith("params:"):
                for key, leaf in leaves(name.removeprefix("params:"), value):
                    mlflow.log_param(key, leaf)


class _Fails:
    @hook_impl
    def before_node_run(self, inputs: dict[str, Any]) -> None:
        raise RuntimeError("a hook failed")


class _Peek:
    """Records what each ``before_node_run`` call sees of the node's inputs."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    @hook_impl
    def before_node_run(self, inputs: dict[str, Any]) -> None:
        self.seen.append(copy.deepcopy(inputs))


@pytest.fixture
def continued_run(tracking_store: str) -> Iterator[str]:
    """An active run that already logged the first run's values."""
    with mlflow.start_run() as run:
        mlflow.log_params({"training.steps": 4, "checkpoint.resume": "never"})
        yield run.info.run_id


def _inputs() -> dict[str, Any]:
    return {
        "params:training": {"steps": 6, "seq_len": 32},
        "params:checkpoint": {"resume": "latest", "interval": 3},
        "params:checkpoint.resume": "latest",
        "token_metadata": {"vocab_size": 512},
    }


def _manager(*plugins: object) -> Any:
    manager = _create_hook_manager()
    for plugin in plugins:
        manager.register(plugin)
    return manager


def _call(manager: Any, inputs: dict[str, Any]) -> list[Any]:
    return manager.hook.before_node_run(
        node=None, catalog=None, inputs=inputs, is_async=False, run_id=None
    )


def test_the_logger_fails_on_a_changed_value_without_the_hook(continued_run: str) -> None:
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        _call(_manager(_ParamLogger()), _inputs())


def test_changed_values_are_kept_new_keys_logged_and_the_node_inputs_intact(
    continued_run: str,
) -> None:
    hook = KeepLoggedParamsHook()
    hook.before_pipeline_run({}, None, None)
    inputs = _inputs()
    given = copy.deepcopy(inputs)
    sections = {key: inputs[key] for key in ("params:training", "params:checkpoint")}
    _call(_manager(hook, _ParamLogger()), inputs)
    logged = MlflowClient().get_run(continued_run).data.params
    assert logged == {
        "training.steps": "4",
        "checkpoint.resume": "never",
        "training.seq_len": "32",
        "checkpoint.interval": "3",
    }
    assert inputs == given  # the node gets every value as given, the same objects
    assert all(inputs[key] is section for key, section in sections.items())


def test_the_inputs_are_restored_when_another_hook_fails(continued_run: str) -> None:
    hook = KeepLoggedParamsHook()
    hook.before_pipeline_run({}, None, None)
    inputs = _inputs()
    given = copy.deepcopy(inputs)
    peek = _Peek()
    with pytest.raises(RuntimeError, match="a hook failed"):
        _call(_manager(hook, _Fails(), peek), inputs)  # the last registered runs first
    (seen,) = peek.seen
    assert seen["params:training"] == {"seq_len": 32}  # hidden while the hooks ran
    assert "params:checkpoint.resume" not in seen
    assert inputs == given


def test_without_an_active_run_nothing_is_hidden(tracking_store: str) -> None:
    hook = KeepLoggedParamsHook()
    hook.before_pipeline_run({}, None, None)
    inputs = _inputs()
    peek = _Peek()
    _call(_manager(hook, peek), inputs)
    assert peek.seen == [_inputs()]


def test_params_the_run_holds_with_the_same_values_are_not_logged_again(
    continued_run: str,
) -> None:
    """The run already holds them (``MlflowRunTagsHook`` logs every param in batches at the
    start): kedro-mlflow would write each again, one call per key."""
    hook = KeepLoggedParamsHook()
    hook.before_pipeline_run({}, None, None)
    inputs = {
        "params:training": {"steps": 4, "seq_len": 32},
        "params:checkpoint.resume": "never",
    }
    given = copy.deepcopy(inputs)
    peek = _Peek()
    _call(_manager(hook, peek), inputs)
    assert peek.seen == [{"params:training": {"seq_len": 32}}]
    assert inputs == given
