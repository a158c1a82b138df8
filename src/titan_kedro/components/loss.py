"""Token-level cross-entropy, the loss every train spec uses by default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value that contributes nothing to the loss (padding)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, computed in float32.

    Args:
        logits: ``[batch, seq, vocab]`` scores (any float dtype).
        labels: ``[batch, seq]`` token ids; ``IGNORE_INDEX`` positions are skipped.

    Returns:
        A scalar float32 tensor.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: "
            "expected logits [batch, seq, vocab] and labels [batch, seq]"
        )
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss(cfg: Any) -> LossFn:
    """The token-level cross-entropy ``loss_fn(logits, labels)`` (the config has no options yet)."""
    del cfg
    return cross_entropy_loss
