"""Evaluation: held-out loss of the final checkpoint and sample generations."""

from titan_kedro.pipelines.evaluation.pipeline import create_pipeline

__all__ = ["create_pipeline"]
