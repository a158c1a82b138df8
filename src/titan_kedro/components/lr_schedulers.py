"""Warmup → stable → decay learning-rate schedule (the "WSD" shape), one per optimizer.

For optimizer step ``n`` (1-based, ``n = 1 … steps``), with peak ``lr`` and ``W`` warmup
steps, ``D`` decay steps and ``S = steps − W − D`` stable steps:

- warmup, ``n ≤ W``: ``lr · n / W`` (so the first step already moves);
- stable, ``W < n ≤ W + S``: ``lr``;
- decay, ``n > W + S``: ``min_lr + (lr − min_lr) · f(p)`` with ``p = (n − W − S) / D``
  clamped to ``[0, 1]`` and ``f`` = ``1 − p`` (linear), ``(1 + cos πp) / 2`` (cosine) or
  ``1 − √p`` (sqrt), so the last step runs at exactly ``min_lr``.

``D = round(steps · decay_ratio)`` (at most ``steps − W``); ``decay_ratio: null`` decays
over every step after warmup.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from titan_kedro.components.optimizers import OptimizersContainer


def schedule_phases(
    steps: int, warmup_steps: int, decay_ratio: float | None
) -> tuple[int, int, int]:
    """Return ``(warmup, stable, decay)`` step counts that add up to ``steps``."""
    warmup = min(warmup_steps, steps)
    remaining = steps - warmup
    decay = remaining if decay_ratio is None else min(round(steps * decay_ratio), remaining)
    return warmup, remaining - decay, decay


def lr_factor(
    step: int,
    *,
    warmup: int,
    stable: int,
    decay: int,
    decay_type: str,
    min_lr_ratio: float,
) -> float:
    """Multiplier of the peak learning rate at 1-based optimizer step ``step``."""
    if warmup and step <= warmup:
        return max(step, 1) / warmup
    if step <= warmup + stable or decay == 0:
        return 1.0
    progress = min(max((step - warmup - stable) / decay, 0.0), 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(
            f"lr_scheduler.decay_type={decay_type!r} is unknown; use linear, cosine or sqrt"
        )
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def _lambda_factor(last_epoch: int, **kwargs: Any) -> float:
    # LambdaLR evaluates the lambda at 0 for the first step, 1 for the second, …
    return lr_factor(last_epoch + 1, **kwargs)


class LRSchedulersContainer(Stateful):
    """Steps one ``LambdaLR`` per optimizer of an ``OptimizersContainer`` in lockstep."""

    def __init__(self, optimizers: OptimizersContainer, factor: functools.partial[float]):
        self.factor = factor
        self.schedulers = [LambdaLR(opt, factor) for opt in optimizers.optimizers]

    def step(self) -> None:
        """Advance every schedule by one optimizer step."""
        for scheduler in self.schedulers:
            scheduler.step()

    @property
    def last_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.schedulers[0].last_epoch

    def get_last_lr(self) -> list[float]:
        """Current learning rates of the first optimizer's groups."""
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The step count; the factors are a pure function of it and the config."""
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Jump every schedule to the saved step and set the matching learning rates."""
        last = int(state_dict["last_step"])
        for scheduler in self.schedulers:
            scheduler.last_epoch = last
            scheduler._step_count = last + 1
            lrs = [base * self.factor(last) for base in scheduler.base_lrs]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs


def build_lr_schedulers(optimizers: OptimizersContainer, cfg: Any) -> LRSchedulersContainer:
    """Build the warmup/stable/decay schedule from ``cfg.lr_scheduler`` and ``cfg.training.steps``.

    Args:
        optimizers: The container returned by ``build_optimizers``.
        cfg: The job config.

    Returns:
        A ``LRSchedulersContainer``; call ``step()`` after every optimizer step.

    Raises:
        ValueError: ``min_lr`` is above the peak ``optimizer.lr``.
    """
    section = cfg.lr_scheduler
    peak = cfg.optimizer.lr
    if section.min_lr > peak:
        raise ValueError(
            f"lr_scheduler.min_lr={section.min_lr} is above optimizer.lr={peak}; lower min_lr"
        )
    warmup, stable, decay = schedule_phases(
        cfg.training.steps, section.warmup_steps, section.decay_ratio
    )
    factor = functools.partial(
        _lambda_factor,
        warmup=warmup,
        stable=stable,
        decay=decay,
        decay_type=section.decay_type,
        min_lr_ratio=section.min_lr / peak,
    )
    return LRSchedulersContainer(optimizers, factor)
