"""C4 → packed token files: clean → tokenize → split → pack → save."""

from titan_kedro.pipelines.data_processing.pipeline import create_pipeline

__all__ = ["create_pipeline"]
