"""The ``training`` pipeline: launch the torchrun workers and collect their summary."""

from titan_kedro.pipelines.training.pipeline import create_pipeline

__all__ = ["create_pipeline"]
