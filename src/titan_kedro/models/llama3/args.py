"""Llama 3 model arguments and flavors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_kedro.models.common import Llama3RopeScaling


@dataclass(frozen=True)
class Llama3Args:
    """Shape of a Llama 3 model (dense, grouped-query attention, RoPE with Llama 3 scaling)."""

    vocab_size: int = 102400
    """Token vocabulary (102400 matches the DeepSeek tokenizer the data pipeline uses)."""
    dim: int = 256
    """Model width."""
    n_layers: int = 6
    """Transformer blocks."""
    n_heads: int = 16
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``n_heads`` (multi-head)."""
    head_dim: int | None = None
    """Width of one head; None means ``dim // n_heads``."""
    ffn_hidden_dim: int = 768
    """Hidden width of the SwiGLU feed-forward (transformers' ``intermediate_size``)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.1 frequency scaling; None for plain RoPE. A mapping is accepted too."""
    max_seq_len: int = 2048
    """Longest sequence (rotary positions precomputed); ``training.seq_len`` must not exceed it."""
    depth_init: bool = True
    """Scale each block's output projections' init std by ``1/sqrt(2·(layer+1))``; else by
    ``1/sqrt(2·n_layers)``."""

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            try:
                scaling = Llama3RopeScaling(**self.rope_scaling)
            except TypeError as err:
                fields = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
                raise ValueError(f"rope_scaling: {err}; fields are {fields}") from None
            object.__setattr__(self, "rope_scaling", scaling)
        positive_ints = (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "ffn_hidden_dim",
            "max_seq_len",
        )
        for name in positive_ints:
            _require_positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"head_dim={self.head_size} must be even for rotary embeddings")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive"
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolved."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Width of one head, resolved."""
        return self.head_dim or self.dim // self.n_heads


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        vocab_size=102400,
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden_dim=768,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(original_max_position_embeddings=1024),
        max_seq_len=2048,
    ),
    "8B": Llama3Args(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=14336,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(),
        max_seq_len=131072,
    ),
}
"""``debugmodel``: 4.7M block parameters besides the 102400-token embeddings, for CPU
tests and demos (its RoPE is scaled as if pretrained at 1024 tokens and extended to 2048).
``8B``: Llama 3.1 8B (8.03B parameters, untied embeddings, 8192-token pretraining context
extended to 131072 by the RoPE scaling)."""
