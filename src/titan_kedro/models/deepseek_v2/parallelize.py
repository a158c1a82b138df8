"""Parallelize DeepSeek-V2: tensor, expert parallelism, activation checkpointing, compile, FSDP2.

Meshes (``titan_kedro.train.parallel_dims``): dense parameters are sharded over
``dp_shard`` (plus ``dp_replicate`` for HSDP). With expert parallelism the routed experts
are first split ``ep`` ways (``DTensor`` ``Shard(0)`` on the ``ep`` mesh) and then
FSDP-sharded over what is left, ``dp_shard_mod_ep`` (size 1 when ``ep = dp_shard``: the
local experts then stay whole on their rank).

Gradient scale: the loss of every rank is the mean over its own tokens, so the wanted
gradient is the mean over all ``dp`` ranks. A rank's expert gradient already sums the
contributions of every token sent to it by the ``ep`` ranks of its group (the backward
of the all-to-all), so reducing it over the ``dp / ep`` ranks of its FSDP mesh must
divide by the whole ``dp`` degree, not by that mesh's size.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan_kedro.models.deepseek_v2.expert_parallel import shard_experts
from titan_kedro.models.deepseek_v2.moe import GroupedExperts
from titan_kedro.models.deepseek_v2.tensor_parallel import apply_deepseek_tensor_parallel
from titan_kedro.models.parallel import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    reshard_after_forward,
    training_dtypes,
)


def grouped_experts(module: nn.Module) -> list[GroupedExperts]:
    """Every ``GroupedExperts`` under ``module`` (one per MoE layer)."""
    return [m for m in module.modules() if isinstance(m, GroupedExperts)]


def apply_expert_parallel(model: nn.Module, parallel_dims: Any) -> int:
    """Shard the routed experts of every MoE layer over the EP mesh.

    Returns:
        How many MoE layers were converted.
    """
    experts = grouped_experts(model)
    for module in experts:
        shard_experts(module, parallel_dims.ep_mesh)
    return len(experts)


def _shard_experts_fsdp(parallel_dims: Any):
    mesh = parallel_dims.expert_fsdp_mesh
    shard_size = parallel_dims.dp_shard_mod_ep

    def before_block(block: nn.Module, fsdp_kwargs: dict[str, Any]) -> None:
        for experts in grouped_experts(block):
            fully_shard(
                experts,
                mesh=mesh,
                mp_policy=fsdp_kwargs["mp_policy"],
                reshard_after_forward=fsdp_kwargs["reshard_after_forward"],
                shard_placement_fn=placement,
            )
            _scale_expert_gradients(experts, parallel_dims)

    def placement(param: nn.Parameter) -> Shard:
        # Split whole experts over the FSDP ranks when they divide evenly, else the next
        # dimension if it does (FSDP needs even splits there), else pad the experts.
        n_local = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        if n_local % shard_size and param.shape[1] % shard_size == 0:
            return Shard(1)
        return Shard(0)

    return before_block


def _scale_expert_gradients(experts: FSDPModule, parallel_dims: Any) -> None:
    experts.set_gradient_divide_factor(float(parallel_dims.dp_degree))
    if parallel_dims.dp_shard_mod_ep > 1:
        # A factor other than the mesh size needs PREMUL_SUM, which gloo lacks; summing
        # and dividing afterwards works everywhere. (With a single shard rank FSDP divides
        # while copying, and forcing a sum there would divide twice.)
        experts.set_force_sum_reduction_for_comms(True)


def parallelize_deepseek_v2(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    """Tensor and expert parallelism, activation checkpointing, compile and FSDP2 (2-D
    with TP) for DeepSeek-V2.

    Args:
        model: The model with identical, initialised parameters on every rank.
        parallel_dims: A built ``titan_kedro.train.parallel_dims.ParallelDims``.
        job_config: The job config (its ``training`` section; the degrees come from
            ``parallel_dims``).

    Returns:
        The parallelized model (parameter names unchanged; unwrapped on one rank, see
        ``titan_kedro.models.parallel``).
    """
    before_block = None
    if parallel_dims.tp > 1:
        apply_deepseek_tensor_parallel(model, parallel_dims.tp_mesh)
    if parallel_dims.ep > 1:
        # A pipeline stage may hold only dense blocks; the model as a whole must have MoE.
        if apply_expert_parallel(model, parallel_dims) == 0 and not model.args.n_moe_layers:
            raise ValueError(
                "parallelism.expert_parallel_degree > 1 but the model has no MoE layers "
                "(first_k_dense_replace >= n_layers); set expert_parallel_degree: 1"
            )
        before_block = _shard_experts_fsdp(parallel_dims)
    training = job_config.training
    apply_ac(model, training.activation_checkpoint, training.activation_checkpoint_blocks)
    if job_config.training.compile:
        apply_compile(model)
    if not parallel_dims.fsdp_enabled:  # one data rank: mixed precision comes from autocast
        return model
    param_dtype, reduce_dtype = training_dtypes(job_config, parallel_dims.device)
    return apply_fsdp(
        model,
        parallel_dims.fsdp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward(job_config, pipelined=parallel_dims.pp_enabled),
        before_block=before_block,
    )
