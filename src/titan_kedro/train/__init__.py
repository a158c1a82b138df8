"""Training engine: the torchrun worker, its loop, optimizers, schedules, checkpoints, metrics.

Nothing here imports Kedro; ``python -m titan_kedro.train`` is the worker entry point.
"""
