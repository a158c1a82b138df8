"""Tensor parallelism for DeepSeek-V2/V3 blocks: MLA, the dense MLP and the MoE layer.

MLA: the up-projections ``wq`` / ``wq_b`` and ``wkv_b`` are column-parallel (each ``tp``
rank computes ``n_heads / tp`` heads), ``wo`` is row-parallel. The low-rank
down-projections ``wq_a`` and ``wkv_a`` and their norms ``q_norm`` / ``kv_norm`` are
replicated: every rank needs the whole latent for its heads. Their gradients are whole on
every rank because the column-parallel ``wq_b`` / ``wkv_b`` sum their input gradient over
``tp``; the one exception is the rotary key slice of ``wkv_a``'s output, shared by all
heads without passing a column-parallel layer, so its gradient is summed over ``tp``
here (:func:`_sum_rope_key_gradient`).

MoE: the layer gets its block's sequence shard (tokens differ per ``tp`` rank, which is
why expert parallelism may borrow the ``tp`` ranks). The router runs on the gathered
tokens of the whole ``tp`` group and hands back this rank's rows: its gate's gradient
then covers every token on every rank (the backward of that slice gathers the gradients).
The balance loss sums its per-expert counts and probabilities over ``tp`` so it is the
loss of the whole micro-batch, the same on every rank. Routed experts run on this rank's
tokens (EP); the shared experts are tensor-parallel SwiGLUs over the gathered tokens.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan_kedro.models.deepseek_v2.moe import MoE
from titan_kedro.models.tensor_parallel import (
    apply_block_plans,
    apply_tensor_parallel_ends,
    attention_and_mlp_plan,
    swiglu_plan,
)


def deepseek_tensor_parallel_widths(args: Any) -> dict[str, int]:
    """The widths TP splits (``TrainSpec.tensor_parallel_widths``)."""
    widths = {"model n_heads": args.n_heads, "model vocab_size": args.vocab_size}
    if any(not args.is_moe_layer(i) for i in range(args.n_layers)):
        widths["model intermediate_size"] = args.intermediate_size
    if args.n_routed_experts and args.n_shared_experts:
        widths["model moe_intermediate_size × n_shared_experts"] = (
            args.moe_intermediate_size * args.n_shared_experts
        )
    return widths


def _block_plan(block: nn.Module) -> dict[str, Any]:
    attention = block.attention
    plan = {
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.q_lora_rank is None:
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan["attention.wq_b"] = ColwiseParallel()
    if not block.moe_enabled:
        return attention_and_mlp_plan(plan, "feed_forward")
    plan = attention_and_mlp_plan(plan, None)
    plan["moe"] = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    if block.moe.shared_experts is not None:
        # The layer flattens its sequence shard to [tokens, dim] before the shared experts.
        plan.update(swiglu_plan("moe.shared_experts", Shard(0)))
    return plan


def apply_deepseek_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor and sequence parallelism for every block, the embedding and the output."""
    apply_block_plans(model, tp_mesh, _block_plan)
    for block in model.layers.values():
        rope_from = block.attention.kv_lora_rank
        block.attention.wkv_a.register_forward_hook(_sum_rope_key_gradient(tp_mesh, rope_from))
        if block.moe_enabled:
            _route_over_the_tp_group(block.moe, tp_mesh)
    apply_tensor_parallel_ends(model, tp_mesh)


def _sum_rope_key_gradient(tp_mesh: DeviceMesh, rope_from: int):
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        latent, rope = output.split([rope_from, output.shape[-1] - rope_from], dim=-1)
        # Forward unchanged; backward: the local heads' gradient is Partial, summed over tp.
        rope = DTensor.from_local(rope, tp_mesh, [Replicate()], run_check=False)
        rope = rope.to_local(grad_placements=[Partial()])
        return torch.cat([latent, rope], dim=-1)

    return hook


def _route_over_the_tp_group(moe: MoE, tp_mesh: DeviceMesh) -> None:
    def gather_tokens(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        tokens, *rest = args
        whole = DTensor.from_local(tokens, tp_mesh, [Shard(0)], run_check=False)
        return (whole.redistribute(tp_mesh, [Replicate()]).to_local(), *rest)

    def keep_own_rows(module: nn.Module, args: Any, outputs: tuple[torch.Tensor, ...]):
        # Replicate → Shard(0) is a local slice whose backward gathers the gradients.
        return tuple(
            DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
            .redistribute(tp_mesh, [Shard(0)])
            .to_local()
            for t in outputs
        )

    moe.router.register_forward_pre_hook(gather_tokens)
    moe.router.register_forward_hook(keep_own_rows)
    moe.balance_loss = types.MethodType(_balance_loss_over(tp_mesh), moe)


def _balance_loss_over(tp_mesh: DeviceMesh):
    group = tp_mesh.get_group()
    tp = tp_mesh.size()

    def balance_loss(
        self: MoE, scores: torch.Tensor, selected: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """``MoE.balance_loss`` of the whole micro-batch from this rank's sequence shard."""
        groups = batch if self.seq_aux else 1
        scores = scores.view(groups, -1, self.num_experts)
        chosen = selected.view(groups, -1)
        tokens = scores.shape[1] * tp
        counts = torch.zeros(groups, self.num_experts, device=scores.device)
        counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=counts.dtype))
        dist.all_reduce(counts, group=group)
        prob_sums = DTensor.from_local(scores.sum(dim=1), tp_mesh, [Partial()], run_check=False)
        prob_sums = prob_sums.redistribute(tp_mesh, [Replicate()]).to_local()
        load_fraction = counts * self.num_experts / (self.top_k * tokens)
        return self.aux_loss_alpha * (load_fraction * prob_sums / tokens).sum(dim=1).mean()

    return balance_loss
