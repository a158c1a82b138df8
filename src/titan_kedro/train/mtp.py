"""Multi-token-prediction loss (DeepSeek-V3 §2.2) from a model's extra outputs.

A model with MTP modules provides ``mtp_outputs()`` (``docs/ARCHITECTURE.md``, Models):
after a training-mode forward, depth ``k``'s output ``[b, s - k, …]`` predicts
``labels[:, k:]`` (the token ``k + 1`` ahead of each input position). Each depth is
scored with the trainer's own loss function (so the fused output-projection loss applies
to hidden states as for the main output), and ``L_MTP = mean_k L_k``; the trainer adds
``training.mtp_loss_weight · L_MTP`` to the loss and logs ``mtp_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def mtp_loss(
    model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], labels: Any
) -> torch.Tensor | None:
    """Mean loss over the MTP depths of the model's last forward, or None without MTP.

    Args:
        model: The (possibly wrapped) model just run in training mode.
        loss_fn: ``loss(output, labels)``, the same function as for the main output.
        labels: ``[b, s]`` next-token labels of that forward.
    """
    outputs = model.mtp_outputs() if hasattr(model, "mtp_outputs") else []
    if not outputs:
        return None
    losses = [loss_fn(out, labels[:, k:]) for k, out in enumerate(outputs, start=1)]
    return torch.stack(losses).mean()


def mtp_loss_weight(config: Any) -> float:
    """``training.mtp_loss_weight`` (a DeepSeek-V3 extension field; 0 for other models)."""
    return float(getattr(config.training, "mtp_loss_weight", 0.0))
