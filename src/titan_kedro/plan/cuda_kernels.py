"""CUDA plans: run the fake step with the attention kernel CUDA runs, not the CPU's.

On the CPU, ``scaled_dot_product_attention`` with a dense document mask, or with value
heads narrower than query heads (MLA), falls back to the math path, which keeps the
``batch × heads × seq × seq`` attention weights for backward. On CUDA the same call is
FlexAttention (document masking) or a fused SDPA kernel, which keeps only the output
and one log-sum-exp per row. While ``cuda_attention`` is active (the fake step of a
CUDA plan), SDPA runs as ``aten._scaled_dot_product_efficient_attention`` — a fused
kernel whose fake implementation has exactly that footprint — causal, without the
dense mask (FlexAttention's block mask is a few KiB). Each substituted call is recorded
with the bytes the CPU path would have kept instead, so the plan can show the correction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class AttentionCorrection:
    """What the CUDA attention substitution changed in one fake step."""

    calls: int = 0
    cpu_weights_bytes: int = 0
    """Attention weights the CPU math path would keep for backward, summed over calls."""
    shapes: list[list[int]] = field(default_factory=list)
    """``[batch, heads, seq, kv_seq]`` of each distinct call."""


@contextmanager
def cuda_attention() -> Iterator[AttentionCorrection]:
    """Replace ``F.scaled_dot_product_attention`` by the fused kernel CUDA would run."""
    record = AttentionCorrection()
    original = F.scaled_dot_product_attention

    def fused(  # noqa: PLR0917 (F.scaled_dot_product_attention's signature)
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if enable_gqa and key.shape[1] != query.shape[1]:
            repeat = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        batch, heads, seq, _ = query.shape
        shape = [batch, heads, seq, key.shape[2]]
        record.calls += 1
        record.cpu_weights_bytes += batch * heads * seq * key.shape[2] * query.element_size()
        if shape not in record.shapes:
            record.shapes.append(shape)
        out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, dropout_p, True, scale=scale
        )
        return out

    F.scaled_dot_product_attention = fused
    try:
        yield record
    finally:
        F.scaled_dot_product_attention = original
