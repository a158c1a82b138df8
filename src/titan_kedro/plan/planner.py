"""``build_plan``: will the configured job fit on its devices, and what will it cost?"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from titan_kedro.models.counting import count_parameters
from titan_kedro.models.parallel import training_dtypes
from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan.devices import planned_device, planned_kind
from titan_kedro.plan.fake_world import fake_process_group
from titan_kedro.plan.memory import activation_bytes, measure_sharded
from titan_kedro.train.fused_loss import uses_fused_loss
from titan_kedro.train.parallel_dims import ParallelDims

GIB = 1024**3
KINDS = (
    "params",
    "grads",
    "optimizer",
    "gathered_params",
    "unsharded_grads",
    "activations",
    "loss",
)
"""The per-rank byte counts of a plan, in the order they are printed."""


class PlanDoesNotFitError(RuntimeError):
    """The job's plan needs more memory per rank than its device has."""


def build_plan(resolved: ResolvedJob) -> dict[str, Any]:
    """Measure the job's per-rank memory on the sharded model and estimate its cost.

    The model is built on the meta device inside a fake process group of
    ``launch.world_size`` ranks, and ``spec.parallelize_fn`` shards it exactly as the
    trainer would (``titan_kedro.plan.memory`` says what is measured and what estimated).
    The fake group is destroyed before returning.

    Args:
        resolved: The resolved job (config, train spec, model args).

    Returns:
        A JSON-safe dict: ``world_size, layout, device, compute_dtype, reduce_dtype,
        activation_checkpoint, fused_loss, micro_batch_tokens, bytes_per_rank`` (by kind
        and ``total``), ``gib_per_rank``, ``device_memory_gib, reserved_gib, fits,
        headroom_gib, cost`` (``flops_per_step, tokens_per_step, peak_tflops,
        assumed_mfu, step_time_s, wall_time_h, device_hours``), ``suggestions`` (empty
        when it fits) and ``planned_in_s``.
    """
    start = time.perf_counter()
    cfg, spec, args = resolved.config, resolved.spec, resolved.model_args
    world = cfg.launch.world_size
    dims = ParallelDims.from_config(cfg, world, torch.device("cpu"))
    compute_dtype, reduce_dtype = training_dtypes(cfg, torch.device(planned_kind(cfg)))
    device = planned_device(cfg, compute_dtype)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    with fake_process_group(world):
        dims.build_mesh()
        with torch.device("meta"):
            model = spec.build_model(args)
        counts = count_parameters(model)
        fused = uses_fused_loss(cfg, spec, model)
        transient = activation_bytes(
            model,
            args,
            active_params=counts.active,
            tokens=tokens,
            compute_dtype=compute_dtype,
            activation_checkpoint=cfg.training.activation_checkpoint,
            fused_loss=fused,
        )
        model = spec.parallelize_fn(model, dims, cfg)
        sharded = measure_sharded(
            model, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, world_size=world
        )
        del model
    per_rank = {
        "params": sharded.params,
        "grads": sharded.grads,
        "optimizer": sharded.optimizer,
        "gathered_params": sharded.gathered_params,
        "unsharded_grads": sharded.unsharded_grads,
        **transient,
    }
    per_rank["total"] = sum(per_rank.values())
    reserved = cfg.plan.reserved_gib
    headroom = device.memory_gib - reserved - per_rank["total"] / GIB
    flops_per_token = (
        float(spec.flops_per_token(args, cfg.training.seq_len))
        if spec.flops_per_token
        else 6.0 * counts.active
    )
    tokens_per_step = cfg.global_batch_size * cfg.training.seq_len
    flops_per_step = flops_per_token * tokens_per_step
    step_time = flops_per_step / (world * device.peak_tflops * 1e12 * cfg.plan.assumed_mfu)
    wall_h = step_time * cfg.training.steps / 3600
    plan: dict[str, Any] = {
        "world_size": world,
        "layout": {
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "ep": dims.ep,
            "dp_shard_mod_ep": dims.dp_shard_mod_ep,
            "grad_accum_steps": cfg.grad_accum_steps,
        },
        "device": {
            "kind": device.kind,
            "name": device.name,
            "memory_gib": device.memory_gib,
            "peak_tflops": device.peak_tflops,
        },
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "reduce_dtype": str(reduce_dtype).removeprefix("torch."),
        "activation_checkpoint": cfg.training.activation_checkpoint,
        "fused_loss": bool(fused),
        "micro_batch_tokens": tokens,
        "bytes_per_rank": per_rank,
        "gib_per_rank": {kind: value / GIB for kind, value in per_rank.items()},
        "device_memory_gib": device.memory_gib,
        "reserved_gib": reserved,
        "fits": headroom >= 0,
        "headroom_gib": headroom,
        "cost": {
            "flops_per_token": flops_per_token,
            "tokens_per_step": tokens_per_step,
            "flops_per_step": flops_per_step,
            "peak_tflops": device.peak_tflops,
            "assumed_mfu": cfg.plan.assumed_mfu,
            "steps": cfg.training.steps,
            "step_time_s": step_time,
            "wall_time_h": wall_h,
            "device_hours": wall_h * world,
        },
    }
    plan["suggestions"] = [] if plan["fits"] else _suggestions(plan, resolved)
    plan["planned_in_s"] = time.perf_counter() - start
    return plan


def _suggestions(plan: dict[str, Any], resolved: ResolvedJob) -> list[str]:
    """Settings that would shrink the per-rank total, with what each one saves."""
    cfg = resolved.config
    gib = plan["gib_per_rank"]
    budget = plan["device_memory_gib"] - plan["reserved_gib"]
    world = plan["world_size"]
    out: list[str] = []
    state = gib["params"] + gib["grads"] + gib["optimizer"]
    rest = gib["total"] - state
    if rest < budget:
        needed = 2 ** math.ceil(math.log2(max(1.0, state / (budget - rest)) * world))
        out.append(
            f"more ranks: parameters, gradients and AdamW take {state:.1f} GiB per rank and "
            f"divide by the world size; about {needed} ranks (launch.nnodes × "
            f"launch.nproc_per_node) would bring them to {state * world / needed:.1f} GiB"
        )
    else:
        out.append(
            f"more ranks alone cannot help: the unsharded parts (gathered parameters, "
            f"activations, loss) need {rest:.1f} GiB of the {budget:.1f} GiB available"
        )
    ep = plan["layout"]["ep"]
    if plan["layout"]["dp_shard"] > ep and hasattr(
        resolved.config.parallelism, "expert_parallel_degree"
    ):
        out.append(
            f"more expert parallelism (parallelism.expert_parallel_degree > {ep}, dividing "
            f"{plan['layout']['dp_shard']}): each rank then gathers only its own experts "
            f"(gathered parameters are {gib['gathered_params']:.1f} GiB now)"
        )
    acts = gib["activations"]
    if cfg.training.activation_checkpoint != "full" and acts > 0.05 * budget:
        out.append(
            f"training.activation_checkpoint: full (activations are {acts:.1f} GiB per "
            "micro-batch now)"
        )
    if cfg.training.local_batch_size > 1 and acts + gib["loss"] > 0.05 * budget:
        out.append(
            f"a smaller micro-batch: training.local_batch_size "
            f"{cfg.training.local_batch_size} → 1 with training.global_batch_size kept "
            f"(accumulation) divides activations and loss buffers ({acts + gib['loss']:.1f} "
            f"GiB) by {cfg.training.local_batch_size}"
        )
    if not plan["fused_loss"] and gib["loss"] > 0.05 * budget:
        out.append(f"training.fused_loss: true (the full logits take {gib['loss']:.1f} GiB)")
    return out


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a few readable lines (memory by kind, fit, cost, suggestions)."""
    gib = plan["gib_per_rank"]
    layout = plan["layout"]
    device = plan["device"]
    cost = plan["cost"]
    lines = [
        f"plan: {plan['world_size']} rank(s) (replicate {layout['dp_replicate']} × shard "
        f"{layout['dp_shard']}, EP {layout['ep']}) on {device['name']} "
        f"({plan['device_memory_gib']:.1f} GiB, {plan['reserved_gib']:.1f} GiB reserved), "
        f"{plan['compute_dtype']} compute, AC {plan['activation_checkpoint']}, fused loss "
        f"{plan['fused_loss']}, {plan['micro_batch_tokens']} tokens per micro-batch",
        "  per rank: "
        + ", ".join(f"{kind} {gib[kind]:.2f}" for kind in KINDS)
        + f" — total {gib['total']:.2f} GiB",
        f"  {'fits' if plan['fits'] else 'DOES NOT FIT'}: headroom {plan['headroom_gib']:.2f} GiB",
        f"  cost: {cost['flops_per_step']:.3g} FLOPs/step, {cost['step_time_s']:.3g} s/step and "
        f"{cost['wall_time_h']:.3g} h for {cost['steps']} steps ({cost['device_hours']:.3g} "
        f"device-hours) at MFU {cost['assumed_mfu']:.0%} of {cost['peak_tflops']:.3g} TFLOP/s",
    ]
    lines += [f"  would help: {s}" for s in plan.get("suggestions", [])]
    return "\n".join(lines)


def check_plan_fits(plan: dict[str, Any], *, enforce: bool = True) -> None:
    """Refuse a plan that does not fit (unless ``enforce`` is off).

    Raises:
        PlanDoesNotFitError: With the numbers and the settings that would help.
    """
    if plan["fits"] or not enforce:
        return
    raise PlanDoesNotFitError(
        "the job does not fit on its devices; refusing to launch (set plan.enforce: false "
        "to launch anyway)\n" + format_plan(plan)
    )
