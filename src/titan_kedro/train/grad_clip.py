"""Gradient clipping by the true global norm over sharded (DTensor) gradients.

Under FSDP2 every gradient is a ``DTensor`` whose local shard holds part of the
gradient; expert-parallel gradients may live on a different mesh than dense ones. The
norm is computed per mesh (``get_total_norm`` on DTensors gives a partial result that
``full_tensor()`` reduces over that mesh), then the per-mesh norms are combined.
Plain-tensor gradients are taken as replicated (the same on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _by_mesh(params: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            continue
        key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        groups.setdefault(key, []).append(param)
    return groups


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm`` and return the global norm before clipping.

    Args:
        parameters: Every trainable parameter of the model (all ranks pass their own).
        max_norm: Largest allowed global norm; ``0`` only measures the norm.
        norm_type: The p of the p-norm (``inf`` for the max norm).
        foreach: Use the foreach kernels (None: torch decides).

    Returns:
        A plain scalar tensor with the norm over the full (unsharded) gradients, the same
        on every rank; it may be ``nan``/``inf`` (then the gradients are left unchanged by
        the caller's choice to skip the step).
    """
    groups = _by_mesh(parameters)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)
    if max_norm > 0 and torch.isfinite(total):
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
