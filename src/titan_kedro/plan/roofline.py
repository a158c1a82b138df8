"""A roofline step time from the fake step's ops: FLOPs (``FlopCounterMode``'s formulas) and
the bytes each op reads and writes.

Each op takes ``max(flops / peak rate, bytes / memory bandwidth)``; the step time is the
sum over the ops (views and collectives move nothing here; communication is not counted).
It is a lower bound: real kernels reach neither roof.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from titan_kedro.plan.local_ops import LocalOpMode

_aten = torch.ops.aten
_SKIPPED_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "profiler")


def _cpu_sdpa_flop(
    query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(
    grad_out: Any,
    query: Any,
    key: Any,
    value: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flop(
    mat_a: Any, mat_b: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    # Every output element is a dot product over the contracted dimension (groups only
    # partition the rows): 2 · |out| · K, with K = mat_a's last dimension except for the
    # weight gradient (2-D × 2-D, out [groups, M, N]), which contracts the rows instead.
    if len(mat_a) == 2 and len(mat_b) == 2:
        contracted = mat_a[1]  # a: [M, tokens] (transposed activations), b: [tokens, N]
        return 2 * mat_a[0] * mat_b[1] * contracted
    out = 1
    for size in out_shape:
        out *= size
    return 2 * out * mat_a[-1]


EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    _aten._grouped_mm: _grouped_mm_flop,
}
"""Ops the CPU step runs that ``FlopCounterMode`` has no formula for (torch 2.13)."""


@dataclass
class RooflineTotals:
    """What one counted region did."""

    flops: float = 0.0
    bytes: float = 0.0
    time_s: float = 0.0
    by_block: dict[str, float] = field(default_factory=dict)
    """Roofline seconds of each block's forward (``model.layers`` key)."""


class RooflineCounter(LocalOpMode):
    """Counts FLOPs, bytes moved and roofline seconds of the ops dispatched under it.

    Args:
        peak_flops: FLOP/s of the planned device in the compute dtype.
        bandwidth: Bytes/s of its memory.
    """

    def __init__(self, peak_flops: float, bandwidth: float) -> None:
        super().__init__()
        self.peak_flops = peak_flops
        self.bandwidth = bandwidth
        self.formulas = FlopCounterMode(
            display=False, custom_mapping=EXTRA_FLOP_FORMULAS
        ).flop_registry
        self.totals = RooflineTotals()
        self.block: str | None = None
        """The block whose forward is running (set by ``fake_step``'s block hooks)."""

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if func.namespace in _SKIPPED_NAMESPACES or func.is_view:
            return out
        formula = self.formulas.get(func.overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
        moved = sum(
            t.numel() * t.element_size()
            for t in tree_flatten((args, kwargs, out))[0]
            if isinstance(t, torch.Tensor)
        )
        seconds = max(flops / self.peak_flops, moved / self.bandwidth)
        self.totals.flops += flops
        self.totals.bytes += moved
        self.totals.time_s += seconds
        if self.block is not None:
            self.totals.by_block[self.block] = self.totals.by_block.get(self.block, 0.0) + seconds
        return out
