"""Mean held-out loss: one function for the trainer's validation and the evaluation stage."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


def capped_batches(requested: int, available: int, setting: str) -> int:
    """``requested`` batches, at most the ``available`` held-out ones (no window twice).

    Args:
        requested: Batches asked for (``validation.steps``, ``evaluation.batches``).
        available: Whole batches in the held-out split (``TokenLoader.batches_per_epoch``).
        setting: The config key, named in the warning.
    """
    if requested > available:
        logger.warning(
            "%s=%d but the validation split holds %d batch(es): scoring %d, so no window "
            "counts twice (add data or raise data.validation_fraction for more)",
            setting,
            requested,
            available,
            available,
        )
        return available
    return requested


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped so a diverged model gives a huge number rather than inf."""
    return math.exp(min(loss, 80.0))


@torch.no_grad()
def mean_loss(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    n_batches: int,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, int]:
    """Mean of ``loss_fn(model(inputs), labels)`` over the first ``n_batches`` batches.

    The model runs in eval mode and is put back in its previous mode afterwards. Losses
    are summed on the device and read back once.

    Args:
        model: Returns what ``loss_fn`` takes: logits, or hidden states when ``loss_fn``
            applies the output projection itself (the trainer's fused loss).
        batches: ``(inputs, labels)`` pairs, ``[batch, seq_len]`` token ids.
        loss_fn: ``(outputs, labels) -> scalar`` mean loss of one batch.
        n_batches: How many batches to score.
        device: Where the batches go; default: the device of the model's first parameter.
        group: The data-parallel process group of a distributed (FSDP / expert-parallel)
            model. Its forward is collective, so every rank must get as many batches
            (``TokenLoader`` gives each rank the same count and never runs out); the
            result is then the mean over all ranks' batches and the tokens are counted
            over the group (one all-reduce).

    Returns:
        ``(mean loss, tokens scored)``; fewer batches are used when ``batches`` runs out.

    Raises:
        ValueError: ``batches`` yields nothing.
    """
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    count, tokens = 0, 0
    try:
        for inputs, labels in itertools.islice(batches, n_batches):
            outputs = model(inputs.to(device))
            total += loss_fn(outputs, labels.to(device)).detach().float()
            tokens += labels.numel()
            count += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError(
            "no evaluation batch: the validation split is shorter than one batch; raise "
            "data.validation_fraction or lower training.seq_len / training.local_batch_size"
        )
    if group is None:
        return float(total) / count, tokens
    sums = torch.tensor([float(total), count, tokens], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=group)
    loss_sum, batches_scored, tokens_scored = sums.tolist()
    return loss_sum / batches_scored, int(tokens_scored)
