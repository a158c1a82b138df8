"""Reporting: training-curve, throughput and MoE expert-load figures from metrics.jsonl."""

from titan_kedro.pipelines.reporting.pipeline import create_pipeline

__all__ = ["create_pipeline"]
