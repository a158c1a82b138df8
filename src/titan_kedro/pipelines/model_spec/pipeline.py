"""``model_spec``: job-config sections + token metadata → ``model_spec`` (the model card, ``data/06_models/model_spec.json``)."""

from __future__ import annotations

from typing import Any

from kedro.pipeline import Node, Pipeline

from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.pipelines.model_spec.nodes import build_model_spec


def create_pipeline(**kwargs: Any) -> Pipeline:
    """One node: resolve the model config and write its card (counts, FLOPs, memory)."""
    return Pipeline(
        [
            Node(
                build_model_spec,
                inputs={"token_metadata": "token_metadata", **JOB_PARAMS},
                outputs="model_spec",
                name="build_model_spec",
                tags=["model_spec"],
            )
        ]
    )
