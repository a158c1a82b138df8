"""``build_plan``: will the configured job fit on its devices, and what will it cost?

The layout (``ParallelDims`` on a fake process group), the sharded state, the figures and
the cost are assembled here from one fake step (``step_planner``); reading a plan (its
suggestions, ``format_plan``, ``check_plan_fits``) is ``report``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from titan_kedro.models.counting import count_parameters
from titan_kedro.models.parallel import training_dtypes
from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan import step_planner
from titan_kedro.plan.devices import GIB, PlannedDevice, planned_device, planned_kind
from titan_kedro.plan.fake_step import StepMeasurement, with_checkpointed
from titan_kedro.plan.fake_world import fake_process_group
from titan_kedro.plan.memory import ShardedBytes, activation_bytes, measure_sharded
from titan_kedro.plan.pipeline_plan import pipelined_plan
from titan_kedro.plan.report import (
    KINDS,
    PlanDoesNotFitError,
    check_plan_fits,
    format_plan,
    suggestions,
)
from titan_kedro.plan.step_planner import StepPlanner
from titan_kedro.train.fused_loss import uses_fused_loss
from titan_kedro.train.parallel_dims import ParallelDims

__all__ = [
    "PlanDoesNotFitError",
    "apply_plan_choices",
    "build_plan",
    "check_plan_fits",
    "format_plan",
]


logger = logging.getLogger(__name__)

_MEASURED: dict[str, dict[str, Any]] = {}
"""Plans measured in this process, by ``_measurement_key``: a ``kedro run`` plans in the
model-spec node and again in the training node, which reuses the first measurement."""


def build_plan(resolved: ResolvedJob) -> dict[str, Any]:
    """Measure the job's per-rank memory with one fake training step, and its cost.

    Parameters, gradients and optimizer state are read off the sharded meta model (exact
    at any size). The peak and its parts come from one training step run on fake tensors
    in a fake process group of ``launch.world_size`` ranks, tracked by ``FSDPMemTracker``
    (``titan_kedro.plan.fake_step``). Models with more than ``FULL_STEP_MAX_BLOCKS``
    blocks are measured with fewer repeated blocks and extrapolated per block. CUDA plans
    run the step with CUDA's attention kernel (``cuda_corrections``). The formulas of
    ``titan_kedro.plan.memory`` are kept as ``formula_cross_check`` only.

    Args:
        resolved: The resolved job (config, train spec, model args).

    Returns:
        A JSON-safe dict: ``world_size, layout, device, compute_dtype, reduce_dtype,
        activation_checkpoint, activation_checkpoint_blocks, fused_loss,
        micro_batch_tokens, bytes_per_rank`` (by kind and ``total``, at the peak),
        ``gib_per_rank, figures`` (each figure's bytes and ``method``), ``peak_at,
        extrapolated, cuda_corrections, formula_cross_check, device_memory_gib,
        reserved_gib, fits, headroom_gib, cost`` (with the roofline time), ``suggestions``
        (empty when it fits) and ``planned_in_s``.
    """
    key = _measurement_key(resolved)
    if key in _MEASURED:
        logger.info("plan: this config was measured earlier in this process; reusing it")
        return copy.deepcopy(_MEASURED[key])
    if resolved.config.layout.pp > 1:  # the fake step does not run pipelined steps
        plan = pipelined_plan(resolved, build_plan)
    else:
        plan = _measure(resolved)
    _MEASURED[key] = copy.deepcopy(plan)
    return plan


def _measurement_key(resolved: ResolvedJob) -> str:
    """Everything a measurement depends on; a model whose args have no stable ``repr``
    (a custom model's plain class) never matches, so it is measured again."""
    return json.dumps(
        [
            resolved.config.model_dump(mode="json"),
            resolved.spec.name,
            repr(resolved.model_args),
            step_planner.FULL_STEP_MAX_BLOCKS,
            step_planner.MEASURED_REPEATS,
        ],
        sort_keys=True,
    )


@dataclass(frozen=True)
class _Measured:
    """What the fake world measured for one plan (``_fake_step``)."""

    dims: ParallelDims
    step: StepPlanner
    measured: StepMeasurement
    choice: dict[str, Any] | None
    sharded: ShardedBytes
    formula: dict[str, int]
    fused: bool
    tokens: int


def _measure(resolved: ResolvedJob) -> dict[str, Any]:
    start = time.perf_counter()
    cfg = resolved.config
    kind = planned_kind(cfg)
    compute_dtype, reduce_dtype = training_dtypes(cfg, torch.device(kind))
    device = planned_device(cfg, compute_dtype)
    m = _fake_step(resolved, kind, device, compute_dtype, reduce_dtype)
    per_rank = _bytes_per_rank(m.measured)
    method = "fake_step_extrapolated" if m.step.extrapolated else "fake_step"
    reserved = cfg.plan.reserved_gib
    headroom = device.memory_gib - reserved - per_rank["total"] / GIB
    plan: dict[str, Any] = {
        "world_size": cfg.launch.world_size,
        "layout": _layout(m.dims, cfg.layout.grad_accum_steps),
        "device": _device_entry(device),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "reduce_dtype": str(reduce_dtype).removeprefix("torch."),
        "activation_checkpoint": cfg.training.activation_checkpoint,
        "activation_checkpoint_blocks": m.measured.checkpointed,
        "fused_loss": bool(m.fused),
        "micro_batch_tokens": m.tokens,
        "bytes_per_rank": per_rank,
        "gib_per_rank": {kind_: value / GIB for kind_, value in per_rank.items()},
        "figures": _figures(per_rank, method),
        "peak_at": m.measured.peak_at,
        "extrapolated": m.step.extrapolation_note(),
        "cuda_corrections": m.step.corrections(),
        "checkpoint_choice": m.choice,
        "formula_cross_check": _formula_cross_check(m.sharded, m.formula),
        "device_memory_gib": device.memory_gib,
        "reserved_gib": reserved,
        "fits": headroom >= 0,
        "headroom_gib": headroom,
        "cost": _cost(resolved, device, m.measured, method),
    }
    plan["suggestions"] = [] if plan["fits"] else suggestions(plan, resolved)
    plan["planned_in_s"] = time.perf_counter() - start
    return plan


def _fake_step(
    resolved: ResolvedJob,
    kind: str,
    device: PlannedDevice,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> _Measured:
    """The layout, the sharded state and the fake step, in a fake world of ``world_size``."""
    cfg, spec, args = resolved.config, resolved.spec, resolved.model_args
    world = cfg.launch.world_size
    budget = int((device.memory_gib - cfg.plan.reserved_gib) * GIB)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    with fake_process_group(world):
        dims = ParallelDims.from_config(cfg, world, torch.device("cpu"))
        dims.build_mesh()
        dims.device = torch.device(kind)  # read only for the compute dtype
        with torch.device("meta"):
            model = spec.build_model(args)
        counts = count_parameters(model)
        fused = uses_fused_loss(cfg, spec, model)
        formula = activation_bytes(
            model,
            args,
            active_params=counts.active,
            tokens=tokens,
            compute_dtype=compute_dtype,
            activation_checkpoint=_formula_mode(cfg.training.activation_checkpoint),
            fused_loss=fused,
        )
        sharded = measure_sharded(  # checkpointing does not change what is sharded
            spec.parallelize_fn(model, dims, with_checkpointed(cfg, [])),
            compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype,
            world_size=world,
        )
        del model
        step = StepPlanner(resolved, dims, device, sharded, kind == "cuda")
        measured, choice = step.plan_checkpointing(budget)
    return _Measured(dims, step, measured, choice, sharded, formula, fused, tokens)


def _bytes_per_rank(measured: StepMeasurement) -> dict[str, int]:
    """Bytes by kind at the peak, ``other`` (the rest) and ``total``."""
    per_rank = {kind: int(measured.parts.get(kind, 0)) for kind in KINDS}
    per_rank["other"] = measured.peak_bytes - sum(per_rank.values())
    per_rank["total"] = measured.peak_bytes
    return per_rank


def _figures(per_rank: dict[str, int], method: str) -> dict[str, dict[str, Any]]:
    """Each figure's bytes and how it was found (the states last)."""
    states = ("params", "grads", "optimizer")
    figures = {
        kind: {"bytes": value, "method": method}
        for kind, value in per_rank.items()
        if kind not in states
    }
    for kind in states:
        figures[kind] = {"bytes": per_rank[kind], "method": method}
    return figures


def _layout(dims: ParallelDims, grad_accum_steps: int) -> dict[str, int]:
    return {
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "tp": dims.tp,
        "ep": dims.ep,
        "dp_shard_mod_ep": dims.dp_shard_mod_ep,
        "grad_accum_steps": grad_accum_steps,
    }


def _device_entry(device: PlannedDevice) -> dict[str, Any]:
    return {
        "kind": device.kind,
        "name": device.name,
        "memory_gib": device.memory_gib,
        "peak_tflops": device.peak_tflops,
        "memory_bandwidth_gbs": device.bandwidth_gbs,
    }


def _formula_cross_check(sharded: ShardedBytes, formula: dict[str, int]) -> dict[str, Any]:
    return {
        "method": "formula",
        "params": sharded.params,
        "grads": sharded.grads,
        "optimizer": sharded.optimizer,
        "gathered_params": sharded.gathered_params,
        "unsharded_grads": sharded.unsharded_grads,
        **formula,
    }


def _cost(
    resolved: ResolvedJob, device: PlannedDevice, measured: StepMeasurement, method: str
) -> dict[str, Any]:
    """FLOPs, the step time at ``plan.assumed_mfu``, the roofline time and the wall time."""
    cfg, world = resolved.config, resolved.config.launch.world_size
    flops_per_token = resolved.spec.training_flops_per_token(
        resolved.model_args, cfg.training.seq_len
    )
    tokens_per_step = cfg.layout.global_batch_size * cfg.training.seq_len
    flops_per_step = flops_per_token * tokens_per_step
    step_time = flops_per_step / (world * device.peak_tflops * 1e12 * cfg.plan.assumed_mfu)
    wall_h = step_time * cfg.training.steps / 3600
    return {
        "flops_per_token": flops_per_token,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": flops_per_step,
        "peak_tflops": device.peak_tflops,
        "assumed_mfu": cfg.plan.assumed_mfu,
        "steps": cfg.training.steps,
        "step_time_s": step_time,
        "roofline_step_time_s": measured.roofline.time_s * cfg.layout.grad_accum_steps,
        "roofline_method": method,
        "measured_flops_per_rank_step": measured.roofline.flops * cfg.layout.grad_accum_steps,
        "wall_time_h": wall_h,
        "device_hours": wall_h * world,
    }


def _formula_mode(mode: str) -> str:
    return "none" if mode == "auto" else mode


def apply_plan_choices(job_config: Any, plan: dict[str, Any]) -> None:
    """Write what the plan chose into the job config the workers get.

    With ``training.activation_checkpoint: auto`` and no blocks named, the blocks the
    plan measured fitting become ``training.activation_checkpoint_blocks``.
    """
    training = job_config.training
    if training.activation_checkpoint == "auto" and training.activation_checkpoint_blocks is None:
        training.activation_checkpoint_blocks = list(plan["activation_checkpoint_blocks"])
