"""Titan Kedro: pretrain DeepSeek-style mixture-of-experts models on C4 with Kedro, torchrun and MLflow."""

__version__ = "0.1.0"
