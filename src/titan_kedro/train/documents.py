"""Document masking for training and evaluation: which BOS id delimits documents, and the
extra model inputs (per-document RoPE positions and document ids) of a batch.

Packed windows hold several documents (``BOS doc EOS BOS doc EOS …``). With
``training.document_masking`` a token attends only within its own document and RoPE
positions restart at each document; the model does the masking
(``forward(tokens, positions=..., document_ids=...)``, see ``models/common.py``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from titan_kedro.models.common import document_positions

logger = logging.getLogger(__name__)


def takes_document_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` accepts ``positions`` and ``document_ids``."""
    params = inspect.signature(type(model).forward).parameters
    return "positions" in params and "document_ids" in params


def masking_bos_id(config: Any, model: nn.Module, metadata: Mapping[str, Any]) -> int | None:
    """The BOS id to split documents at, or None when document masking is off.

    Off when ``training.document_masking`` is false, when the model's forward takes no
    document ids (a custom model; logged), or when the token metadata names no ``bos_id``
    (a synthetic stream without documents; logged).
    """
    if not getattr(config.training, "document_masking", False):
        return None
    if not takes_document_ids(model):
        logger.warning(
            "training.document_masking: %s.forward takes no positions/document_ids, so "
            "attention crosses document boundaries",
            type(model).__name__,
        )
        return None
    bos = metadata.get("bos_id", metadata.get("tokenizer", {}).get("bos_id"))
    if bos is None:
        logger.warning(
            "training.document_masking: the token metadata has no bos_id, so documents "
            "cannot be found; attention crosses the whole window"
        )
        return None
    return int(bos)


def document_inputs(tokens: torch.Tensor, bos_id: int | None) -> dict[str, torch.Tensor]:
    """``{"positions", "document_ids"}`` for ``model(tokens, **…)``; empty when masking is off."""
    if bos_id is None:
        return {}
    positions, document_ids = document_positions(tokens, bos_id)
    return {"positions": positions, "document_ids": document_ids}
