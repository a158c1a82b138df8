"""Evaluation pipeline: final checkpoint → eval_loss / eval_perplexity and sample generations."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node, pipeline

from titan_kedro.pipelines.evaluation import nodes
from titan_kedro.pipelines.job_params import JOB_PARAMS


def load_final_model_node() -> node:
    """The node that loads the final checkpoint (export_hf reuses it; Kedro runs it once)."""
    return node(
        nodes.load_final_model,
        inputs={"training_summary": "training_summary", **JOB_PARAMS},
        outputs="final_model",
        name="load_final_model",
        tags=["evaluation", "export_hf"],
    )


def create_pipeline(**kwargs: object) -> Pipeline:
    """Consumes ``training_summary`` (so it runs after training) and the token files."""
    return pipeline(
        [
            load_final_model_node(),
            node(
                nodes.compute_validation_loss,
                inputs=["final_model", "token_files", "params:evaluation"],
                outputs=["evaluation_results", "evaluation_metrics"],
                name="compute_validation_loss",
                tags=["evaluation"],
            ),
            node(
                nodes.generate_samples,
                inputs=["final_model", "token_files", "params:tokenizer", "params:evaluation"],
                outputs="generations",
                name="generate_samples",
                tags=["evaluation"],
            ),
        ]
    )
