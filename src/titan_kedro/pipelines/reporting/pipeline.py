"""Reporting pipeline: figures into data/08_reporting/, each logged to the MLflow run."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node, pipeline

from titan_kedro.pipelines.reporting import nodes


def create_pipeline(**kwargs: object) -> Pipeline:
    """metrics.jsonl → loss, learning-rate, throughput and expert-load figures + a summary.

    Consumes ``evaluation_results`` so it runs after the evaluation stage.
    """
    return pipeline(
        [
            node(
                nodes.parse_training_metrics,
                inputs=["training_metrics_jsonl", "training_summary"],
                outputs="training_metrics",
                name="parse_training_metrics",
                tags=["reporting"],
            ),
            node(
                nodes.plot_loss_curves,
                inputs=["training_metrics", "training_summary", "evaluation_results"],
                outputs="loss_plot",
                name="plot_loss_curves",
                tags=["reporting"],
            ),
            node(
                nodes.plot_learning_rate,
                inputs="training_metrics",
                outputs="learning_rate_plot",
                name="plot_learning_rate",
                tags=["reporting"],
            ),
            node(
                nodes.plot_throughput,
                inputs="training_metrics",
                outputs="throughput_plot",
                name="plot_throughput",
                tags=["reporting"],
            ),
            node(
                nodes.plot_expert_load,
                inputs=["training_metrics", "params:model"],
                outputs="expert_load_plot",
                name="plot_expert_load",
                tags=["reporting"],
            ),
            node(
                nodes.summarize_report,
                inputs=["training_metrics", "training_summary", "evaluation_results"],
                outputs="reporting_summary",
                name="summarize_report",
                tags=["reporting"],
            ),
        ]
    )
