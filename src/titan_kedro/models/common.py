"""Layers shared by the model families: RMSNorm, rotary embeddings and the SwiGLU FFN.

Rotary embeddings are kept as complex numbers ``freqs_cis[pos, i] = a · e^{i·pos·θ_i}``
(``a`` = 1 except for YaRN's attention factor). Two ways to rotate a head are offered
because checkpoints disagree on which channels form a pair:

- ``apply_rotary_emb``: interleaved pairs ``(x0, x1), (x2, x3), …`` (Meta / DeepSeek /
  torchtitan layout; DeepSeek-V2 in transformers uses it too);
- ``apply_rotary_emb_half``: pairs ``(x_i, x_{i+d/2})`` (the "rotate half" layout of
  transformers' Llama), so Hugging Face Llama weights load without permuting q/k rows.

Frequency scalings: Llama 3 (long wavelengths slowed down, smooth in between) and YaRN
(NTK-by-parts interpolation plus an attention-temperature factor ``mscale``).

Document masking (packed windows ``BOS doc EOS BOS doc EOS …``): ``document_positions``
gives each token its position inside its document and a document id; a model's
``forward(tokens, positions=..., document_ids=...)`` then restarts RoPE at every document
and lets a token attend only to earlier tokens of its own document: ``rotations_and_mask``
gives every block its rotations and mask (``document_mask``), and ``attention`` runs SDPA
with a block-diagonal causal mask, or FlexAttention with a block mask on CUDA.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_kedro.models import sharded_init as init


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the gain, as transformers does, so bf16 outputs match bit for bit.
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:  # gain back to one
        init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``, no biases.

    Args:
        dim: Model width (input and output).
        hidden_dim: Width of the gated hidden layer.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float = 0.02) -> None:
        """Input projection at std 0.02; the others at ``init_std`` (depth-scaled by callers)."""
        init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling (transformers ``rope_type: llama3``)."""

    factor: float = 8.0
    """Divide the lowest frequencies by this."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained with before scaling."""


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN frequency scaling (transformers ``rope_type: yarn``, DeepSeek-V2's ``rope_scaling``)."""

    factor: float
    """Context extension factor (40 for DeepSeek-V2)."""
    original_max_position_embeddings: int
    """Context length before extension (4096 for DeepSeek-V2)."""
    beta_fast: float = 32.0
    """Rotations above which a frequency is left untouched (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """Numerator coefficient of the attention factor applied to cos/sin."""
    mscale_all_dim: float = 0.0
    """Denominator coefficient of that factor; when non-zero the softmax scale is also
    multiplied by ``yarn_get_mscale(factor, mscale_all_dim) ** 2``."""
    truncate: bool = True
    """Round the correction range outwards to whole dimensions."""

    def attention_factor(self) -> float:
        """Magnitude given to ``freqs_cis`` (scales both q and k of the rotary part)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    def softmax_scale_multiplier(self) -> float:
        """Multiplier of the ``1/sqrt(head_dim)`` softmax scale (DeepSeek's ``mscale²``)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


RopeScaling = Llama3RopeScaling | YarnRopeScaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(scale) + 1`` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``theta^(-2i/dim)``, float32 ``[dim // 2]``."""
    if dim % 2:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Apply Llama 3.1 scaling to plain inverse frequencies."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(dim: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    """YaRN inverse frequencies: interpolate low frequencies, keep high ones, ramp between."""

    def correction_dim(num_rotations: float) -> float:
        # Dimension whose wavelength fits ``num_rotations`` times into the original context.
        return (
            dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = rope_inv_freq(dim, theta)
    interpolation = extrapolation / scaling.factor
    keep = 1 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)
    return interpolation * (1 - keep) + extrapolation * keep


def precompute_freqs_cis(
    dim: int, end: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Rotations for positions ``0 … end-1``: complex64 ``[end, dim // 2]``.

    Args:
        dim: Rotary dimension (head dim, or DeepSeek's ``qk_rope_head_dim``).
        end: Number of positions (the model's ``max_seq_len``).
        theta: RoPE base.
        scaling: Optional Llama 3 or YaRN frequency scaling. YaRN also scales the
            magnitude by its attention factor, as transformers does.
    """
    if isinstance(scaling, YarnRopeScaling):
        inv_freq = yarn_inv_freq(dim, theta, scaling)
        magnitude = scaling.attention_factor()
    else:
        inv_freq = rope_inv_freq(dim, theta)
        if isinstance(scaling, Llama3RopeScaling):
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        magnitude = 1.0
    angles = torch.outer(torch.arange(end, dtype=torch.float32), inv_freq)
    return torch.polar(torch.full_like(angles, magnitude), angles)


def _broadcast_freqs(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # x: [batch, seq, heads, pairs]; freqs_cis: [>= seq, pairs] -> [1, seq, 1, pairs], or
    # per-token rotations [batch, seq, pairs] (rotary_for) -> [batch, seq, 1, pairs]
    if not freqs_cis.is_complex():
        raise TypeError(
            f"freqs_cis must be complex (from precompute_freqs_cis), got {freqs_cis.dtype}; "
            "a cast such as model.to(torch.bfloat16) may have turned it real"
        )
    if freqs_cis.ndim == 3:
        return freqs_cis.unsqueeze(2)
    seq = x.shape[1]
    if freqs_cis.shape[0] < seq:
        raise ValueError(
            f"sequence length {seq} exceeds the {freqs_cis.shape[0]} precomputed rotary "
            "positions; raise the model's max_seq_len"
        )
    return freqs_cis[:seq].view(1, seq, 1, x.shape[-1])


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x`` ``[batch, seq, heads, dim]``; float32 inside."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(x_c * _broadcast_freqs(freqs_cis, x_c)).flatten(-2)
    return out.type_as(x)


def apply_rotary_emb_half(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + dim/2)`` of ``x`` ``[batch, seq, heads, dim]`` (HF Llama layout)."""
    half = x.shape[-1] // 2
    xf = x.float()
    freqs = _broadcast_freqs(freqs_cis, xf[..., :half])
    cos, sin = freqs.real, freqs.imag
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class RotaryTableModule(nn.Module):
    """Base of a model that keeps its complex ``freqs_cis`` buffer through dtype casts.

    ``model.to(torch.bfloat16)`` casts complex buffers to the real dtype, which drops the
    rotations' imaginary part; ``_apply`` rebuilds the table as complex64 instead.
    Subclasses implement ``_rotary_table()``.
    """

    freqs_cis: torch.Tensor

    def _rotary_table(self) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Casting complex values to real")
            result = super()._apply(fn, recurse)
        if not self.freqs_cis.is_complex():
            with torch.device(self.freqs_cis.device):
                self.freqs_cis = self._rotary_table()
        return result


def document_positions(tokens: torch.Tensor, bos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions inside each document and document ids of a packed ``[batch, seq]`` window.

    A document starts at every ``bos_id`` token and at the start of the window (the tail
    of a document cut by the window edge counts as one).

    Returns:
        ``(positions, document_ids)``, both ``torch.long`` ``[batch, seq]``: positions
        restart at 0 at every document start; ids number the documents of a row from 0
        (only equality of ids matters).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = tokens == bos_id
    starts[:, 0] = True
    document_ids = starts.long().cumsum(1) - 1
    start_of_doc = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return index - start_of_doc, document_ids


def rotary_for(freqs_cis: torch.Tensor, positions: torch.Tensor | None, seq: int) -> torch.Tensor:
    """The rotations a model applies: ``freqs_cis[:seq]``, or per token ``freqs_cis[positions]``."""
    if positions is None:
        return freqs_cis
    if positions.shape[1] != seq:
        raise ValueError(f"positions {tuple(positions.shape)} do not match {seq} tokens per row")
    return freqs_cis[positions]


AttentionMask = Any
"""``None`` (plain causal), a bool ``[batch, 1, q, kv]`` tensor (True = may attend), or a
FlexAttention ``BlockMask``."""


def document_mask(document_ids: torch.Tensor, *, flex: bool | None = None) -> AttentionMask:
    """Causal attention within documents, for every layer of one forward.

    Args:
        document_ids: ``[batch, seq]`` from ``document_positions``.
        flex: Build a FlexAttention ``BlockMask`` (default: on CUDA when available; its
            backward needs CUDA). Otherwise a dense block-diagonal causal bool mask for SDPA.
    """
    if flex is None:
        flex = document_ids.device.type == "cuda" and _flex_attention() is not None
    batch, seq = document_ids.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            same = document_ids[b, q_idx] == document_ids[b, kv_idx]
            return (q_idx >= kv_idx) & same

        return create_block_mask(
            mask_mod, batch, None, seq, seq, device=document_ids.device, _compile=True
        )
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def rotations_and_mask(
    freqs_cis: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionMask]:
    """What every block of one forward gets: ``block(h, freqs_cis, mask)``.

    Args:
        freqs_cis: The model's rotary table ``[max_seq_len, rotary_dim / 2]`` (complex).
        tokens: The forward's token ids ``[batch, seq]``.
        positions: RoPE positions ``[batch, seq]`` (from ``document_positions``; None:
            ``0 … seq-1``).
        document_ids: ``[batch, seq]`` (from ``document_positions``); a token then attends
            only to earlier tokens of its own document (None: plain causal attention).

    Returns:
        ``(freqs_cis, mask)``: the table itself, or per token ``freqs_cis[positions]``
        ``[batch, seq, rotary_dim / 2]``; and None or ``document_mask(document_ids)``.

    Raises:
        ValueError: ``positions`` or ``document_ids`` not shaped like ``tokens``.
    """
    for name, value in (("positions", positions), ("document_ids", document_ids)):
        if value is not None and value.shape != tokens.shape:
            raise ValueError(
                f"{name} {tuple(value.shape)} must have the shape of tokens {tuple(tokens.shape)}"
            )
    rotations = rotary_for(freqs_cis, positions, tokens.shape[1])
    return rotations, None if document_ids is None else document_mask(document_ids)


_FLEX: dict[str, Callable[..., torch.Tensor]] = {}


def _flex_attention() -> Callable[..., torch.Tensor] | None:
    # FlexAttention is only fast compiled (its eager path materialises the scores).
    if "fn" not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            return None
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of ``[batch, heads, seq, dim]`` tensors under ``mask``: ``None`` is
    plain causal (SDPA ``is_causal``), a tensor an SDPA bool mask, a ``BlockMask`` Flex."""
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    flex_attention = _flex_attention()
    if flex_attention is None:
        raise RuntimeError("a BlockMask was given but this torch has no FlexAttention")
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
