"""export_hf pipeline: the final checkpoint → data/06_models/hf/ (transformers-loadable)."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node, pipeline

from titan_kedro.pipelines.evaluation.pipeline import load_final_model_node
from titan_kedro.pipelines.export_hf import nodes


def create_pipeline(**kwargs: object) -> Pipeline:
    """Loads the final checkpoint (the same node as evaluation's) and exports it.

    Consumes ``reporting_summary`` so it runs after the reporting stage.
    """
    return pipeline(
        [
            load_final_model_node(),
            node(
                nodes.export_final_model,
                inputs={
                    "final_model": "final_model",
                    "token_files": "token_files",
                    "tokenizer": "params:tokenizer",
                    "export": "params:export",
                    "training_summary": "training_summary",
                    "evaluation_results": "evaluation_results",
                    "reporting_summary": "reporting_summary",
                },
                outputs="hf_export_manifest",
                name="export_final_model",
                tags=["export_hf"],
            ),
        ]
    )
