"""Kedro hook that lets kedro-mlflow log only the node parameters its run lacks.

kedro-mlflow logs every ``params:`` input of a node into the active run in its
``before_node_run``, one ``log_param`` call per flattened key: about 500 calls in a default
run, each a database write (or an HTTP request to a tracking server), although
``MlflowRunTagsHook`` has already logged all of them in a few batches. MLflow also refuses a
param logged again with another value, and a continued run may change ``training.steps``,
the learning rate and ``checkpoint.resume`` itself. This hook wraps the other
``before_node_run`` hooks (a pluggy wrapper, so nothing of kedro-mlflow is patched): while
they run, the node's inputs lack every param the run already holds, so a continued run
keeps its first values (``ContinueRunHook`` records the changes in a tag) and nothing is
written twice. The inputs are put back before the node runs, on every path, so the node
itself sees every value as given.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl
from mlflow.tracking import MlflowClient

from titan_kedro.runs.identity import differences
from titan_kedro.tracking.mlflow_params import loggable_params, param_name, without_params

logger = logging.getLogger(__name__)

PARAMS_PREFIX = "params:"


class KeepLoggedParamsHook:
    """Hides the params the active run already holds from the param loggers."""

    def __init__(self) -> None:
        self._run_id: str | None = None

    @hook_impl(trylast=True)  # after kedro-mlflow has started the run (every pipeline run)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        run = mlflow.active_run()
        self._run_id = run.info.run_id if run is not None else None

    @hook_impl(wrapper=True)
    def before_node_run(self, inputs: dict[str, Any]) -> Generator[None, Any, Any]:
        hidden = self._hide_logged_params(inputs)
        try:
            return (yield)
        finally:
            inputs.update(hidden)

    def _hide_logged_params(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Remove the params the run holds from ``inputs`` in place; returns the originals."""
        params = {
            key.removeprefix(PARAMS_PREFIX): value
            for key, value in inputs.items()
            if key.startswith(PARAMS_PREFIX)
        }
        if self._run_id is None or not params:
            return {}
        logged = MlflowClient().get_run(self._run_id).data.params
        given = loggable_params(params)
        held = logged.keys() & given.keys()
        originals: dict[str, Any] = {}
        for name, value in params.items():
            key = PARAMS_PREFIX + name
            if isinstance(value, Mapping) and value:
                kept = without_params(value, held, name + ".")
                if kept != value:
                    originals[key], inputs[key] = value, kept
            elif param_name(name) in held:
                originals[key] = inputs.pop(key)
        if logger.isEnabledFor(logging.DEBUG):  # the comparison serves only this message
            changed = list(differences(logged, given))
            if changed:
                logger.debug("kept the logged values of %s in run %s", changed, self._run_id)
        return originals
