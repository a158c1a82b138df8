"""The ``model_spec`` pipeline: resolve the configured model and describe it in a model card."""

from titan_kedro.pipelines.model_spec.pipeline import create_pipeline

__all__ = ["create_pipeline"]
