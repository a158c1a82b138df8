"""Tensor parallelism with sequence parallelism, shared by every model family (DTensor).

A family's ``parallelize_fn`` calls :func:`apply_tensor_parallel_ends` and its own block
plan (``parallelize_module`` over the ``tp`` mesh) before AC, compile and FSDP; the model
code is unchanged except that attention reshapes to ``-1`` heads (the local ones).

Layout of activations (Megatron-LM's sequence parallelism, as in torchtitan):

- the residual stream between blocks, and the norms on it, are split along the sequence
  (``Shard(1)``): ``tok_embeddings`` is vocabulary-parallel (``RowwiseParallel``, each
  rank looks up its rows, a reduce-scatter sums them into sequence shards);
- before attention / the MLP the normed sequence shards are all-gathered; the input
  projections are column-parallel (each rank computes its heads or hidden columns), the
  output projection row-parallel, reduce-scattered back into sequence shards;
- the final norm is sequence-parallel and ``output`` column-parallel over the vocabulary:
  the logits stay a ``Shard(-1)`` ``DTensor`` and :func:`loss_parallel_cross_entropy`
  computes the cross-entropy without gathering them (``loss_parallel``).

Parameters of the split projections are ``DTensor`` on the ``tp`` mesh (``Shard`` over
rows or columns); FSDP2 then shards them over the data-parallel mesh as well (2-D). The
sequence-parallel norms are ``Replicate`` ``DTensor``: their gradients come out
``Partial`` (one sequence shard each) and are summed by FSDP's reduction, or without FSDP
by :func:`reduce_partial_gradients` (the step's, before clipping). Plain parameters used
on the gathered activations (the MLA down-projections and their norms) get the same, whole
gradient on every ``tp`` rank, because a column-parallel layer all-reduces its input's
gradient (a partial sum over this rank's columns) over ``tp``.

The fused output loss (``train/fused_loss``) multiplies a whole output weight chunk by
chunk; under TP that weight is split over the vocabulary, so the trainer uses this
module's loss-parallel cross-entropy instead (see ``uses_fused_loss``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

logger = logging.getLogger(__name__)


def check_tensor_parallel(cfg: Any, spec: Any, args: Any) -> None:
    """Refuse a tensor-parallel degree the model cannot split (before any worker starts).

    Args:
        cfg: The job config (reads ``layout.tp`` and ``training.seq_len``).
        spec: The model's ``TrainSpec`` (its ``tensor_parallel_widths``).
        args: The resolved model args.

    Raises:
        ValueError: Naming ``parallelism.tensor_parallel_degree``, the width it does not
            divide and the degrees that would; or ``training.compile``, not supported
            with TP yet.
    """
    tp = cfg.layout.tp
    if tp == 1:
        return
    if spec.tensor_parallel_widths is None:
        raise ValueError(
            f"parallelism.tensor_parallel_degree={tp}: model '{spec.name}' has no "
            "tensor-parallel plan (its TrainSpec's tensor_parallel_widths is None); set "
            "tensor_parallel_degree: 1 and shard with FSDP (data_parallel_shard_degree)"
        )
    if cfg.training.compile:
        raise ValueError(
            f"training.compile with parallelism.tensor_parallel_degree={tp}: compiled blocks "
            "between the tensor-parallel embedding and output fail in backward (a block's "
            "input gradient reaches DTensor's redistribution as a plain tensor, torch 2.13); "
            "set training.compile: false, or tensor_parallel_degree: 1"
        )
    widths = {**spec.tensor_parallel_widths(args), "training.seq_len": cfg.training.seq_len}
    for name, width in widths.items():
        if width % tp:
            divisors = [d for d in range(1, width + 1) if width % d == 0 and d <= 64]
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} must divide {name}={width} "
                f"(tensor parallelism splits it over the ranks); pick one of {divisors}"
            )


def apply_tensor_parallel_ends(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Vocabulary-parallel embedding and output projection, sequence-parallel final norm.

    ``model(tokens)`` then returns ``Shard(-1)`` logits (a ``DTensor`` over the vocabulary)
    for :func:`loss_parallel_cross_entropy`.
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )


def attention_and_mlp_plan(attention: Mapping[str, Any], mlp: str | None) -> dict[str, Any]:
    """One block's plan: sequence-parallel norms, the attention's own projections (the
    ``attention`` mapping, names relative to the block), and a SwiGLU MLP at ``mlp``."""
    plan: dict[str, Any] = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        **attention,
        "ffn_norm": SequenceParallel(),
    }
    if mlp is not None:
        plan.update(swiglu_plan(mlp, Shard(1)))
    return plan


def swiglu_plan(prefix: str, sequence: Shard) -> dict[str, Any]:
    """A ``FeedForward`` at ``prefix``: gather the ``sequence`` shards, w1/w3 column- and
    w2 row-parallel, reduce-scatter back into ``sequence`` shards (plain tensors)."""
    return {
        prefix: PrepareModuleInput(
            input_layouts=(sequence,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w3": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=sequence),
    }


def apply_block_plans(
    model: nn.Module, tp_mesh: DeviceMesh, plan_of: Callable[[nn.Module], dict[str, Any]]
) -> None:
    """``parallelize_module`` every block of ``model.layers`` with ``plan_of(block)``."""
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan_of(block))


def reduce_partial_gradients(params: Iterable[torch.Tensor]) -> int:
    """Sum the ``Partial`` gradients of replicated ``DTensor`` parameters, once per step.

    A sequence-parallel norm's weight sees only this rank's sequence shard, so its
    gradient comes out ``Partial`` over ``tp``; clipping and the optimizer need it whole.
    FSDP's reduction sums them when FSDP wraps the model; without FSDP (one data rank)
    the step calls this after its last backward, before clipping. The gradients of a mesh
    go in one flat all-reduce per ``Partial`` mesh dimension (a bucket), not one each.

    Returns:
        How many gradients were reduced.
    """
    buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
            continue
        partial = tuple(i for i, p in enumerate(grad.placements) if p.is_partial())
        for i in partial:
            if grad.placements[i].reduce_op != "sum":
                raise ValueError(
                    f"a Partial({grad.placements[i].reduce_op}) gradient cannot be summed; "
                    "only sum-partial gradients come out of the tensor-parallel plans"
                )
        key = (id(grad.device_mesh), partial, grad.to_local().dtype)
        buckets.setdefault(key, []).append(param)
    for (_, partial, _), members in buckets.items():
        mesh = members[0].grad.device_mesh
        locals_ = [param.grad.to_local() for param in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim in partial:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for param, local in zip(members, locals_, strict=True):
            summed = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            placements = [Replicate() if p.is_partial() else p for p in param.grad.placements]
            param.grad = DTensor.from_local(
                summed,
                mesh,
                placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
    return sum(len(members) for members in buckets.values())


def loss_parallel_cross_entropy(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cfg: Any = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn`` on vocabulary-sharded logits, returned as a plain (replicated) scalar.

    It must run, forward and backward, inside :func:`loss_context` (``loss_parallel``):
    the training step enters it once around its micro-batches (entering it twice would
    switch the loss-parallel kernels off at the inner exit, before backward). With
    ``cfg``'s ``training.fused_loss`` on, says why that loss is not used.
    """
    if cfg is not None and cfg.training.fused_loss:
        logger.info(
            "training.fused_loss is not used under tensor parallelism (the output weight is "
            "split over the vocabulary); the loss-parallel cross-entropy keeps each rank to "
            "its share of the logits instead"
        )

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = loss_fn(logits, labels)
        return value.to_local() if isinstance(value, DTensor) else value

    return loss


def loss_context(tp: int) -> Callable[[], AbstractContextManager[Any]]:
    """What the step's forward and backward run in: ``loss_parallel`` under TP, else nothing."""
    return loss_parallel if tp > 1 else contextlib.nullcontext
