"""Per-rank bytes of a sharded model, read from its DTensors, and the old activation formulas.

The plan's figures come from the fake step (``fake_step``); of this module the planner
uses ``measure_sharded`` (exact parameter, gradient and AdamW bytes of the full model,
also what an extrapolated step is extended with) and keeps ``activation_bytes`` only as
the printed ``formula_cross_check``.

Measured (from the model ``parallelize_fn`` returns, on the meta device under a fake
process group): every parameter's local shard (``DTensor.to_local()``; rank 0 holds the
largest shard of an uneven split), so FSDP, HSDP and EP placements are what the trainer
gets. Derived from those shards:

- gradients: one tensor of each local shard's shape and dtype (FSDP2 keeps sharded grads);
- AdamW: ``exp_avg`` and ``exp_avg_sq`` of each local shard's shape and dtype;
- gathered parameters: FSDP2 all-gathers a unit (a block, a block's routed experts, the
  root) in the compute dtype before it runs. A parameter's gathered size is its local
  size times the sizes of the mesh dimensions it is sharded on, except ``ep`` (an EP
  rank gathers only its own experts). The root (embeddings, final norm, output) stays
  gathered for the whole step (``reshard_after_forward=False``); two block units are
  counted on top (the one running and the one prefetched), and the largest block's
  unsharded gradient in the reduce dtype before its reduce-scatter. A world of one rank
  computing in float32 uses the parameters in place: zero.

Estimated per micro-batch of ``local_batch_size × seq_len`` tokens, in the compute dtype
(fused SDPA attention keeps no ``seq × seq`` scores): each block saves
``6·dim + 2·kv_dim + 4·ffn_active`` elements per token (the two norm inputs and outputs,
q/k/v, the attention output, and SwiGLU's gate, up, activated gate and product;
``ffn_active`` counts only the experts a token is routed to). Activation checkpointing
keeps a checkpointed block's input (``dim``) plus one block's activations while it is
recomputed; ``selective`` checkpoints every other block. The loss: with
``training.fused_loss`` one chunk of ``default_chunk_size(vocab)`` logits (compute dtype,
plus a float32 copy under mixed precision), the hidden-state gradient and a float32
output-weight gradient; without it the full ``tokens × vocab`` logits in the compute
dtype, their float32 copy and the float32 softmax gradient.

Not counted: the CUDA context, allocator fragmentation and communication buffers; the
plan keeps ``plan.reserved_gib`` free for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from titan_kedro.train.fused_loss import default_chunk_size

ADAMW_STATES = 2
"""``exp_avg`` and ``exp_avg_sq``, each of the parameter's shape and dtype."""


@dataclass(frozen=True)
class ShardedBytes:
    """Per-rank bytes measured on the sharded model."""

    params: int
    """Local parameter shards."""
    grads: int
    """Sharded gradients (the parameters' local shapes and dtypes)."""
    optimizer: int
    """AdamW moments of the local shards."""
    gathered_params: int
    """Unsharded parameters held at the peak: the root plus the two largest block units."""
    unsharded_grads: int
    """One block unit's unsharded gradient before its reduce-scatter."""


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _gather_factor(param: torch.Tensor) -> int:
    if not isinstance(param, DTensor):
        return 1
    names = param.device_mesh.mesh_dim_names or ()
    factor = 1
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and (dim >= len(names) or names[dim] != "ep"):
            factor *= param.device_mesh.size(dim)
    return factor


def _unit_numels(model: nn.Module) -> tuple[int, list[int]]:
    """Gathered elements of the root unit and of each block unit (its sub-units included)."""
    owner: dict[int, str] = {}
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    for name in sorted(units, key=lambda n: n.count(".") if n else -1):
        module = model.get_submodule(name) if name else model
        for param in module.parameters():
            owner[id(param)] = name
    blocks = {f"layers.{key}" for key in model.layers}
    root, per_block = 0, dict.fromkeys(blocks, 0)
    for param in model.parameters():
        gathered = _local(param).numel() * _gather_factor(param)
        unit = owner.get(id(param), "")
        block = next((b for b in blocks if unit == b or unit.startswith(b + ".")), None)
        if block is None:
            root += gathered
        else:
            per_block[block] += gathered
    return root, sorted(per_block.values(), reverse=True)


def measure_sharded(
    model: nn.Module, *, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, world_size: int
) -> ShardedBytes:
    """Bytes one rank holds for ``model`` as ``parallelize_fn`` returned it (see module doc)."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    trainable = sum(
        _local(p).numel() * _local(p).element_size() for p in model.parameters() if p.requires_grad
    )
    root, blocks = _unit_numels(model)
    compute = torch.empty((), dtype=compute_dtype, device="meta").element_size()
    reduce = torch.empty((), dtype=reduce_dtype, device="meta").element_size()
    in_place = world_size == 1 and compute_dtype == torch.float32
    gathered = 0 if in_place else (root + sum(blocks[:2])) * compute
    unsharded_grads = 0 if world_size == 1 else (blocks[0] if blocks else 0) * reduce
    return ShardedBytes(
        params=params,
        grads=trainable,
        optimizer=ADAMW_STATES * trainable,
        gathered_params=gathered,
        unsharded_grads=unsharded_grads,
    )


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def block_elements_per_token(model: nn.Module, model_args: Any, active_params: int) -> float:
    """Elements one block saves for backward per token (see the module docstring)."""
    dim = model_args.dim
    n_heads = getattr(model_args, "n_heads", 1)
    head_dim = getattr(model_args, "head_dim", None) or dim // n_heads
    n_kv_heads = getattr(model_args, "n_kv_heads", None) or n_heads
    blocks = list(model.layers.values())
    non_block = _numel(model) - sum(_numel(b) for b in blocks)
    active_per_block = (active_params - non_block) / len(blocks)
    attention = sum(_numel(getattr(b, "attention", None)) for b in blocks) / len(blocks)
    ffn_active = max(active_per_block - attention, 0.0) / (3 * dim)
    return 6 * dim + 2 * n_kv_heads * head_dim + 4 * ffn_active


def activation_bytes(
    model: nn.Module,
    model_args: Any,
    *,
    active_params: int,
    tokens: int,
    compute_dtype: torch.dtype,
    activation_checkpoint: str,
    fused_loss: bool,
) -> dict[str, int]:
    """``{"activations": …, "loss": …}`` bytes of one micro-batch of ``tokens`` tokens."""
    compute = torch.empty((), dtype=compute_dtype, device="meta").element_size()
    n_blocks = len(model.layers)
    per_block = block_elements_per_token(model, model_args, active_params)
    if activation_checkpoint == "none":
        stored = n_blocks * per_block
    else:
        checkpointed = n_blocks if activation_checkpoint == "full" else math.ceil(n_blocks / 2)
        stored = checkpointed * model_args.dim + (n_blocks - checkpointed) * per_block + per_block
    vocab, dim = model_args.vocab_size, model_args.dim
    upcast = 4 if compute != 4 else 0
    if fused_loss:
        rows = min(tokens, default_chunk_size(vocab))
        loss = rows * vocab * (compute + upcast) + tokens * dim * compute + vocab * dim * 4
    else:
        loss = tokens * vocab * (compute + upcast + 4)
    return {"activations": int(tokens * stored * compute), "loss": int(loss)}
