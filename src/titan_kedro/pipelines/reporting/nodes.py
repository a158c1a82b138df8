"""Reporting nodes: thin wrappers over ``titan_kedro.tracking.plots``."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from titan_kedro.tracking import plots


def parse_training_metrics(
    metrics_jsonl: str, training_summary: dict[str, Any]
) -> list[dict[str, Any]]:
    """The workers' ``metrics.jsonl`` as records merged by step, up to the final step.

    Takes the training summary so it reads the file only after training wrote it.

    Raises:
        ValueError: The file stops before the summary's final step (it belongs to another
            run: is ``job.dump_folder`` shared between runs?).
    """
    records = plots.parse_metrics_jsonl(metrics_jsonl)
    final_step = training_summary.get("final_step")
    if final_step is not None:
        if records[-1]["step"] < final_step:
            raise ValueError(
                f"metrics.jsonl ends at step {records[-1]['step']} but training finished at step "
                f"{final_step}; the catalog's training_metrics_jsonl must be the file in "
                "job.dump_folder of this run"
            )
        records = [r for r in records if r["step"] <= final_step]
    return records


def plot_loss_curves(
    training_metrics: list[dict[str, Any]],
    training_summary: dict[str, Any],
    evaluation_results: dict[str, Any],
) -> Figure:
    """Training and validation loss against tokens, with the final evaluation's loss."""
    return plots.plot_loss(
        training_metrics,
        final_val_loss=evaluation_results.get("eval_loss"),
        final_tokens=training_summary.get("tokens_seen"),
    )


def plot_learning_rate(training_metrics: list[dict[str, Any]]) -> Figure:
    """The learning-rate schedule as trained."""
    return plots.plot_learning_rate(training_metrics)


def plot_throughput(training_metrics: list[dict[str, Any]]) -> Figure:
    """Tokens per second and MFU per step."""
    return plots.plot_throughput(training_metrics)


def plot_expert_load(training_metrics: list[dict[str, Any]], model: dict[str, Any]) -> Figure:
    """Per-layer MoE expert-load heatmaps (or a 'dense model' figure)."""
    return plots.plot_expert_load(
        training_metrics, model_label=f"{model.get('name')}/{model.get('flavor')}"
    )


def summarize_report(
    training_metrics: list[dict[str, Any]],
    training_summary: dict[str, Any],
    evaluation_results: dict[str, Any],
) -> dict[str, Any]:
    """Headline numbers of the run, for the model card and for comparing runs."""
    return {
        **plots.summarize_metrics(training_metrics),
        "wall_time_s": training_summary.get("wall_time_s"),
        "eval_loss": evaluation_results.get("eval_loss"),
        "eval_perplexity": evaluation_results.get("eval_perplexity"),
        "figures": ["loss.png", "learning_rate.png", "throughput.png", "expert_load.png"],
    }
