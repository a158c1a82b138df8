"""Job parameters as MLflow params: the flattened names and values kedro-mlflow logs.

kedro-mlflow (with ``dict_params.flatten: true`` in ``mlflow.yml``) logs a node's
``params:<section>`` input as ``<section>.<key>`` params, names sanitized, values cut to
MLflow's length limit. The hooks compare and log with the same rendering, so a key both
log gets the identical value (MLflow refuses a param logged again with another value).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from titan_kedro.config.load import flatten

_INVALID_PARAM_CHARS = re.compile(r"[^/\w.\- :]")


def param_name(dotted: str) -> str:
    """The MLflow param name of a dotted key (characters MLflow refuses become ``_``)."""
    return _INVALID_PARAM_CHARS.sub("_", dotted)


def loggable_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Flatten parameters to ``section.key`` strings the way kedro-mlflow logs them."""
    return {
        param_name(key): str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in flatten(params).items()
    }


def without_params(
    params: Mapping[str, Any], names: Collection[str], prefix: str = ""
) -> dict[str, Any]:
    """A nested copy of ``params`` lacking the leaves whose param name is in ``names``.

    Args:
        params: Nested parameters (one section's dict, or several sections).
        names: Flattened param names to leave out (``training.steps``).
        prefix: The dotted path of ``params`` itself (``"training."`` for a section).
    """
    kept: dict[str, Any] = {}
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            kept[key] = without_params(value, names, dotted + ".")
        elif param_name(dotted) not in names:
            kept[key] = value
    return kept
