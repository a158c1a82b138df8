"""Parallelism shared by every model family: activation checkpointing, compile, FSDP2.

A model's ``parallelize_fn`` calls these in the order AC → compile → FSDP (each wraps
or shards the blocks in ``model.layers``). Families with extra dimensions (expert
parallelism) shard their extra parameters through ``apply_fsdp``'s ``before_block``
hook and reuse the rest.

On one rank (``parallel_dims.fsdp_enabled`` false) there is nothing to shard, and FSDP
would still copy every parameter into and out of its all-gather buffers and every
gradient through its reduce-scatter buffers each step (about 20 % of a CPU step of the
debug model). The model then stays unwrapped, in float32, and the trainer gets mixed
precision from ``torch.autocast`` instead (``autocast_dtype``), as torchtitan does
without FSDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

AcMode = Literal["none", "selective", "full", "auto"]


def _blocks(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"{type(model).__name__} has no 'layers' nn.ModuleDict of blocks; the shared "
            "parallelize helpers need one (see docs/ARCHITECTURE.md, Models)"
        )
    return layers


def apply_ac(model: nn.Module, mode: AcMode, blocks: list[str] | None = None) -> nn.Module:
    """Recompute block activations in backward instead of storing them.

    Args:
        model: A model with ``model.layers`` (``nn.ModuleDict`` of blocks).
        mode: ``none``; ``selective`` wraps every other block (0, 2, 4, …); ``full``
            wraps every block; ``auto`` wraps the blocks named in ``blocks`` (the plan's
            choice, ``training.activation_checkpoint_blocks``).
        blocks: ``model.layers`` keys to wrap with ``auto``.

    Returns:
        The same model, blocks replaced in place by checkpoint wrappers (parameter names
        seen by ``state_dict`` are unchanged).
    """
    if mode not in ("none", "selective", "full", "auto"):
        raise ValueError(
            f"training.activation_checkpoint={mode!r} is unknown; use none, selective, full or auto"
        )
    if mode == "none":
        return model
    layers = _blocks(model)
    if mode == "auto":
        if blocks is None:
            raise ValueError(
                "training.activation_checkpoint: auto needs the plan's choice in "
                "training.activation_checkpoint_blocks; run through the training pipeline "
                "(it plans first) or name the blocks to recompute"
            )
        unknown = sorted(set(blocks) - set(layers))
        if unknown:
            raise ValueError(
                f"training.activation_checkpoint_blocks names {unknown}, which are not "
                f"blocks of {type(model).__name__} (its blocks: {list(layers)})"
            )
    chosen = set(blocks or ())
    for index, (name, block) in enumerate(list(layers.items())):
        if mode == "full" or (mode == "selective" and index % 2 == 0) or name in chosen:
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each block in place with ``torch.compile`` (names and state dicts unchanged)."""
    for block in _blocks(model).values():
        block.compile()
    return model


def mixed_precision(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2 policy: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    before_block: Callable[[nn.Module, dict[str, Any]], None] | None = None,
) -> nn.Module:
    """Shard every block, then the rest of the model, with FSDP2 ``fully_shard``.

    Args:
        model: A model with ``model.layers``.
        dp_mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP).
        param_dtype: Dtype parameters are gathered and computed in.
        reduce_dtype: Dtype of the gradient reduce-scatter / all-reduce.
        reshard_after_forward: Free gathered block parameters after forward (ZeRO-3);
            ``False`` keeps them until backward (ZeRO-2, more memory, less communication).
        before_block: Called as ``before_block(block, fsdp_kwargs)`` before each block is
            sharded, e.g. to shard expert weights on their own mesh first.

    Returns:
        The same model, now holding ``DTensor`` parameters.
    """
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": mixed_precision(param_dtype, reduce_dtype),
        "reshard_after_forward": reshard_after_forward,
    }
    for block in _blocks(model).values():
        if before_block is not None:
            before_block(block, kwargs)
        fully_shard(block, **kwargs)
    embeddings = getattr(model, "tok_embeddings", None)
    if isinstance(embeddings, nn.Embedding) and param_dtype != torch.float32:
        # A lookup reads a few rows: casting the whole table to param_dtype every step
        # (and its gradient back) costs more than the lookup. Keep it in float32 (as
        # autocast does) and hand its output on in param_dtype.
        policy = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=param_dtype
        )
        fully_shard(
            embeddings,
            mesh=dp_mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    # The root (embeddings, final norm, output) is needed again at once by backward.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return model


def training_dtypes(job_config: Any, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """``(param_dtype, reduce_dtype)``: the config's mixed precision on GPU (and on CPU with
    ``training.mixed_precision_cpu``), else float32."""
    if device.type != "cuda" and not getattr(job_config.training, "mixed_precision_cpu", False):
        return torch.float32, torch.float32
    return (
        getattr(torch, job_config.training.mixed_precision_param),
        getattr(torch, job_config.training.mixed_precision_reduce),
    )


def autocast_dtype(model: nn.Module, job_config: Any, device: torch.device) -> torch.dtype | None:
    """The dtype to run forward passes in under ``torch.autocast``, or None for no autocast.

    Mixed precision is applied once: by FSDP's policy when ``parallelize_fn`` sharded the
    model, else by autocast (``model`` holds no ``FSDPModule``, e.g. on one rank).
    """
    param_dtype, _ = training_dtypes(job_config, device)
    if param_dtype == torch.float32 or any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    return param_dtype


def reshard_after_forward(job_config: Any, *, pipelined: bool) -> bool:
    """``parallelism.fsdp_reshard_after_forward`` resolved: ``default`` frees the gathered
    parameters after forward except in a pipeline stage."""
    choice = job_config.parallelism.fsdp_reshard_after_forward
    if choice == "default":
        return not pipelined
    return choice == "always"


def parallelize_dense(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    """Activation checkpointing, optional compile, and FSDP2 over ``parallel_dims.fsdp_mesh``.

    Args:
        model: The model, parameters already on the training device.
        parallel_dims: A built ``titan_kedro.train.parallel_dims.ParallelDims``.
        job_config: The job config (reads the ``training`` section).

    Returns:
        The parallelized model (unwrapped on one rank; see the module docstring).
    """
    training = job_config.training
    apply_ac(model, training.activation_checkpoint, training.activation_checkpoint_blocks)
    if job_config.training.compile:
        apply_compile(model)
    if not parallel_dims.fsdp_enabled:
        return model
    param_dtype, reduce_dtype = training_dtypes(job_config, parallel_dims.device)
    return apply_fsdp(
        model,
        parallel_dims.fsdp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward(job_config, pipelined=parallel_dims.pp_enabled),
    )
