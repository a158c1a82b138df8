"""Reading a plan: the memory kinds it reports, the settings that would help, its
printout (``format_plan``), and the launch check (``check_plan_fits``)."""

from __future__ import annotations

import math
from typing import Any

from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan.devices import GIB

KINDS = (
    "params",
    "grads",
    "optimizer",
    "gathered_params",
    "unsharded_grads",
    "activations",
    "temporaries",
)
"""The per-rank byte counts of a plan (at the measured peak), in the order they are printed."""


class PlanDoesNotFitError(RuntimeError):
    """The job's plan needs more memory per rank than its device has."""


def suggestions(plan: dict[str, Any], resolved: ResolvedJob) -> list[str]:
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
    if plan["layout"]["dp_shard"] > ep and resolved.spec.expert_parallel:
        out.append(
            f"more expert parallelism (parallelism.expert_parallel_degree > {ep}, dividing "
            f"{plan['layout']['dp_shard']}): each rank then gathers only its own experts "
            f"(gathered parameters are {gib['gathered_params']:.1f} GiB now)"
        )
    acts = gib["activations"] + gib["temporaries"]
    if cfg.training.activation_checkpoint not in ("full", "auto") and acts > 0.05 * budget:
        out.append(
            f"training.activation_checkpoint: auto or full (activations and temporaries are "
            f"{acts:.1f} GiB at the peak now)"
        )
    if cfg.training.local_batch_size > 1 and acts > 0.05 * budget:
        out.append(
            f"a smaller micro-batch: training.local_batch_size "
            f"{cfg.training.local_batch_size} → 1 with training.global_batch_size kept "
            f"(accumulation) shrinks activations and loss buffers ({acts:.1f} GiB)"
        )
    logits = plan["formula_cross_check"]["loss"] / GIB
    # Under TP the logits are already split over the vocabulary, and the fused loss is off.
    if not plan["fused_loss"] and plan["layout"].get("tp", 1) == 1 and logits > 0.05 * budget:
        out.append(f"training.fused_loss: true (the full logits take about {logits:.1f} GiB)")
    return out


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a few readable lines (memory by kind, fit, cost, suggestions)."""
    gib = plan["gib_per_rank"]
    layout = plan["layout"]
    device = plan["device"]
    cost = plan["cost"]
    tp = f" × TP {layout['tp']}" if layout.get("tp", 1) > 1 else ""
    lines = [
        f"plan: {plan['world_size']} rank(s) (replicate {layout['dp_replicate']} × shard "
        f"{layout['dp_shard']}{tp}, EP {layout['ep']}) on {device['name']} "
        f"({plan['device_memory_gib']:.1f} GiB, {plan['reserved_gib']:.1f} GiB reserved), "
        f"{plan['compute_dtype']} compute, AC {plan['activation_checkpoint']}, fused loss "
        f"{plan['fused_loss']}, {plan['micro_batch_tokens']} tokens per micro-batch",
        "  per rank: "
        + ", ".join(f"{kind} {gib[kind]:.2f}" for kind in KINDS)
        + f" — peak {gib['total']:.2f} GiB in {plan['peak_at']['phase']} at "
        f"{plan['peak_at']['module']} (measured: one fake step"
        + (", extrapolated per block" if plan["extrapolated"] else "")
        + ")",
        f"  {'fits' if plan['fits'] else 'DOES NOT FIT'}: headroom {plan['headroom_gib']:.2f} GiB",
        f"  cost: {cost['flops_per_step']:.3g} FLOPs/step, {cost['step_time_s']:.3g} s/step and "
        f"{cost['wall_time_h']:.3g} h for {cost['steps']} steps ({cost['device_hours']:.3g} "
        f"device-hours) at MFU {cost['assumed_mfu']:.0%} of {cost['peak_tflops']:.3g} TFLOP/s;"
        f" roofline of the fake step {cost['roofline_step_time_s']:.3g} s/step",
    ]
    if plan["checkpoint_choice"]:
        choice = plan["checkpoint_choice"]
        lines.append(
            f"  activation checkpointing ({choice['chosen_by']}): recompute blocks "
            f"{choice['blocks'] or 'none'}"
        )
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
