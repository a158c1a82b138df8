"""``training``: job-config sections (+ token metadata, model card) → ``training_summary``."""

from __future__ import annotations

from typing import Any

from kedro.pipeline import Node, Pipeline

from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.pipelines.training.nodes import train_model


def create_pipeline(**kwargs: Any) -> Pipeline:
    """One node that trains with torchrun; its inputs order it after data and model spec."""
    return Pipeline(
        [
            Node(
                train_model,
                inputs={
                    "token_metadata": "token_metadata",
                    "model_spec": "model_spec",
                    **JOB_PARAMS,
                },
                outputs="training_summary",
                name="train_model",
                tags=["training"],
            )
        ]
    )
