"""Export: the final checkpoint as a Hugging Face model folder."""

from titan_kedro.pipelines.export_hf.pipeline import create_pipeline

__all__ = ["create_pipeline"]
