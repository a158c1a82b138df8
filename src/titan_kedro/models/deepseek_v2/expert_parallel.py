"""Expert parallelism: routed experts split across ranks, tokens moved with all-to-all.

Each rank of the expert-parallel (EP) group holds ``n_routed_experts / ep`` experts
(contiguous blocks: rank ``r`` owns experts ``r·E_local … (r+1)·E_local - 1``). The MoE
layer routes its own tokens as usual and hands the grouped experts its routed tokens,
sorted by global expert index, with the count per expert. Around the experts' forward:

1. **dispatch**: the per-expert counts are exchanged (all-to-all), then every token
   travels to the rank that owns its expert (``all_to_all_single`` with uneven splits)
   and the received rows, ordered by (source rank, local expert), are regrouped by local
   expert so the experts see one contiguous block each;
2. **combine**: the experts' outputs take the reverse path back to the rank the tokens
   came from, in the order the MoE layer sent them.

Both transfers are autograd-aware (``all_to_all_single_autograd``): the backward of a
dispatch is the reverse all-to-all of the gradients. Expert weights become ``DTensor``
``Shard(0)`` on the EP mesh, so state dicts keep the full expert dimension and
checkpoints load under any EP degree. The ``GroupedExperts`` forward works on the local
shard (``to_local``). A forward that activation checkpointing replays in backward
repeats the same all-to-alls on every rank, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@dataclass
class DispatchPlan:
    """What ``combine_tokens`` needs to send a dispatch's outputs back."""

    input_splits: list[int]
    """Rows this rank sent to each EP rank (and receives back in combine)."""
    output_splits: list[int]
    """Rows this rank received from each EP rank (and returns in combine)."""
    permutation: torch.Tensor
    """Received row ``permutation[i]`` is row ``i`` of the expert-grouped input."""
    inverse: torch.Tensor
    """Row ``inverse[j]`` of the expert-grouped rows is received row ``j``."""


def dispatch_tokens(
    routed_input: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    ep_mesh: DeviceMesh,
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send each routed token to the EP rank that owns its expert.

    Args:
        routed_input: ``[n_routed, dim]`` this rank's token copies, sorted by global
            expert index (the layout the MoE layer gives its experts).
        num_tokens_per_expert: ``[n_experts]`` rows of ``routed_input`` per global expert.
        ep_mesh: 1-D expert-parallel mesh; its size must divide ``n_experts``.

    Returns:
        ``(local_input, tokens_per_local_expert, plan)``: the rows for this rank's
        experts, grouped by local expert; ``[n_experts / ep]`` counts for them; and the
        plan that ``combine_tokens`` reverses.
    """
    ep = ep_mesh.size()
    n_experts = num_tokens_per_expert.numel()
    if n_experts % ep:
        raise ValueError(
            f"expert parallelism: {n_experts} routed experts cannot be split over {ep} ranks; "
            "parallelism.expert_parallel_degree must divide model n_routed_experts"
        )
    n_local = n_experts // ep
    counts = num_tokens_per_expert.detach().to(torch.int64)
    # received[s, e]: tokens rank s routed to my local expert e.
    received = all_to_all_single(counts, None, None, ep_mesh).view(ep, n_local)
    input_splits = counts.view(ep, n_local).sum(1).tolist()
    output_splits = received.sum(1).tolist()
    gathered = all_to_all_single_autograd(routed_input, output_splits, input_splits, ep_mesh)

    # Regroup the received rows from (source rank, local expert) order into
    # (local expert, source rank) order with a stable sort on the local expert.
    flat_counts = received.flatten()
    block = torch.repeat_interleave(
        torch.arange(flat_counts.numel(), device=flat_counts.device), flat_counts
    )
    permutation = torch.argsort(block % n_local, stable=True).to(routed_input.device)
    local_input = gathered[permutation]
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    plan = DispatchPlan(input_splits, output_splits, permutation, inverse)
    return local_input, received.sum(0), plan


def combine_tokens(
    local_output: torch.Tensor, plan: DispatchPlan, ep_mesh: DeviceMesh
) -> torch.Tensor:
    """Return the experts' outputs to the ranks their tokens came from.

    Args:
        local_output: ``[n_received, dim]`` expert outputs in the grouped order that
            ``dispatch_tokens`` produced.
        plan: The plan of that dispatch.
        ep_mesh: The same EP mesh.

    Returns:
        ``[n_routed, dim]`` outputs in the order of the dispatch's ``routed_input``.
    """
    ungrouped = local_output[plan.inverse]
    return all_to_all_single_autograd(ungrouped, plan.input_splits, plan.output_splits, ep_mesh)


class _ExpertParallelHooks:
    """Forward hooks on a grouped-experts module: dispatch before, combine after."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.ep_mesh = ep_mesh
        self.plan: DispatchPlan | None = None

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        routed_input, num_tokens_per_expert = _split_call(args, kwargs)
        local_input, local_counts, plan = dispatch_tokens(
            routed_input, num_tokens_per_expert, self.ep_mesh
        )
        # One slot, not a stack: a checkpoint recomputation that stops early (after the
        # experts) must not leave a stale plan behind for the next call.
        self.plan = plan
        return (local_input, local_counts.to(num_tokens_per_expert.dtype)), {}

    def after(
        self, module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor
    ) -> torch.Tensor:
        plan, self.plan = self.plan, None
        if plan is None:
            raise RuntimeError("expert-parallel combine without a matching dispatch")
        return combine_tokens(output, plan, self.ep_mesh)


def _split_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    values = list(args) + list(kwargs.values())
    if len(values) != 2:
        raise TypeError(
            "expert parallelism expects experts(routed_input, num_tokens_per_expert); got "
            f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
        )
    return values[0], values[1]


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split a grouped-experts module's stacked weights over ``ep_mesh`` and hook its forward.

    Every parameter of ``experts`` must be stacked along dim 0 by expert. Parameters
    become ``DTensor`` ``Shard(0)`` on ``ep_mesh`` (each rank keeps its block of
    experts); the module's forward then receives only this rank's tokens for them.

    Args:
        experts: The grouped experts of one MoE layer, with plain (not yet sharded)
            parameters identical on every rank.
        ep_mesh: 1-D expert-parallel mesh.
    """
    ep = ep_mesh.size()
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(
                f"experts.{name} is already a DTensor; apply expert parallelism before FSDP"
            )
        if param.shape[0] % ep:
            raise ValueError(
                f"experts.{name} has {param.shape[0]} experts, not divisible by "
                f"parallelism.expert_parallel_degree={ep}"
            )
        # Every rank keeps its own rows (no scatter): the model is on meta, or the same everywhere.
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    hooks = _ExpertParallelHooks(ep_mesh)
    experts.register_forward_pre_hook(hooks.before, with_kwargs=True)
    experts.register_forward_hook(hooks.after, with_kwargs=True)
