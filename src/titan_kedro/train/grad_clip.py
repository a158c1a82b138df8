"""Gradient clipping by the true global norm over sharded (DTensor) gradients, one reduction.

Under FSDP2 every gradient is a ``DTensor`` whose local shard holds part of the gradient;
expert-parallel gradients live on a different mesh than dense ones, and under HSDP a
shard is held by several replicas. Every rank sums ``|g|^p`` over its local shards, each
shard weighted by ``1 / (copies of that shard in the world)`` (``world / product of the
mesh sizes of its Shard dims``; plain tensors count as replicated on every rank), and a
single all-reduce over the whole world (the flattened mesh) gives ``Σ |g|^p`` over the
full gradients (max for the inf norm). Clipping then scales the local shards in place
by ``min(1, max_norm / (norm + 1e-6))`` (1 for a non-finite norm) without reading the
norm on the host, so no DTensor dispatch (and no DTensor warning about mixing meshes) is
involved, and the same code runs on the plan's fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def _local_and_copies(grad: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    if not isinstance(grad, DTensor):
        return grad, world
    if any(placement.is_partial() for placement in grad.placements):
        raise ValueError(
            "clip_grad_norm_ got a Partial (not yet reduced) DTensor gradient; clip after "
            "the gradient reduction (FSDP's backward), not before"
        )
    # FSDP over expert-parallel shards places experts as _StridedShard, which is not
    # is_shard(); counting it as a copy would halve the experts' share of the norm.
    shards = math.prod(
        grad.device_mesh.size(dim)
        for dim, placement in enumerate(grad.placements)
        if placement.is_shard() or isinstance(placement, _StridedShard)
    )
    return grad.to_local(), world // shards


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    holders: int | None = None,
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm`` and return the global norm before clipping.

    Args:
        parameters: Every trainable parameter of the model (all ranks pass their own).
        max_norm: Largest allowed global norm; ``0`` only measures the norm.
        norm_type: The p of the p-norm (``inf`` for the max norm).
        foreach: Use the foreach kernels (None: torch decides).
        holders: Ranks that hold each parameter (None: the whole world); under pipeline
            parallelism a stage's parameters live on ``world / pp`` ranks, and the one
            all-reduce over the world adds the stages' norms.

    Returns:
        A plain float32 scalar tensor with the norm over the full (unsharded) gradients,
        the same on every rank; it may be ``nan``/``inf`` (then the gradients are left
        unchanged, and the caller skips the step).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        local, copies = _local_and_copies(grad, holders or world)
        if local.numel():
            by_copies.setdefault(copies, []).append(local)
    device = grads[0].device
    norm_type = float(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for copies, locals_ in by_copies.items():
        norm = torch.nn.utils.get_total_norm(locals_, norm_type, foreach=foreach).float()
        if math.isinf(norm_type):
            total = torch.maximum(total, norm)
        else:
            total = total + norm.pow(norm_type) / copies
    if world > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if max_norm > 0:
        # Value-free, like torch's own clip_grad_norm_ (no host read, so it also runs on
        # fake tensors): multiply by min(1, max_norm / norm); by 1 when the norm is not finite.
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        local_grads = [g for group in by_copies.values() for g in group]
        if foreach is not False:
            torch._foreach_mul_(local_grads, coef)
        else:
            for grad in local_grads:
                grad.mul_(coef)
    return total
