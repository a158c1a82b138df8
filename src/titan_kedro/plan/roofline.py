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
    """Roofline seconds of each block's forward (``model.layers`` key): what recomputing it
    costs."""
    block_flops: dict[str, float] = field(default_factory=dict)
    """FLOPs of each block's whole work in the step: forward, backward and any recomputation."""
    block_time_s: dict[str, float] = field(default_factory=dict)
    """Roofline seconds of the same work (the rest of ``time_s`` is outside the blocks:
    embedding, output head and loss, clipping, optimizer)."""
    after_backward_s: float = 0.0
    """Roofline seconds after the step's last backward: clipping and the optimizer step,
    work in proportion to the parameters (and a few scalar reductions)."""


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
        self.backward_block: str | None = None
        """The block whose backward (recomputation included) is running: from its output's
        gradient to its input's (``start_backward`` / ``end_backward``)."""
        self._clear_queued = False
        self._after_backward = False

    def start_backward(self, name: str) -> None:
        """Block ``name``'s backward starts (its output's gradient is ready).

        Blocks run one after another, so this ends the previous one's; the end of the
        backward pass ends the last one, even if its input needs no gradient.
        """
        self.backward_block = name
        if not self._clear_queued:
            self._clear_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_pass)

    def end_backward(self, name: str) -> None:
        """Block ``name``'s backward ended (its input's gradient is computed)."""
        if self.backward_block == name:
            self.backward_block = None

    def _end_backward_pass(self) -> None:
        # What follows the last backward is the step's parameter work; an earlier
        # micro-batch's count is dropped by the next backward's end.
        self.backward_block = None
        self._clear_queued = False
        self._after_backward = True
        self.totals.after_backward_s = 0.0

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
        if self._after_backward:
            self.totals.after_backward_s += seconds
        owner = self.block if self.block is not None else self.backward_block
        if owner is not None:
            totals = self.totals
            totals.block_flops[owner] = totals.block_flops.get(owner, 0.0) + flops
            totals.block_time_s[owner] = totals.block_time_s.get(owner, 0.0) + seconds
        return out
