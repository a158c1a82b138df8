"""The plan of a pipelined job (``parallelism.pipeline_parallel_degree > 1``).

The fake step does not run pipelined steps, so a pipelined job is planned as **its
heaviest pipeline rank's model**: the most blocks any rank holds (``pipeline_split``'s
split, over the rank's stages), placed at the end of the model (so they are its MoE
blocks) and kept together with the embedding, the output head, the loss and the MTP
modules (a bound: a rank holds the embedding or the head, not both), trained with the
pipeline microbatch as its batch by the ``1 / pp`` of the world that holds one stage.
Two things are added to that plan:

- **in-flight microbatches**: 1F1B's first rank holds ``min(pp, microbatches)``
  microbatches' activations; an interleaved schedule ``1 + (pp − 1) / (pp × stages per
  rank)`` times that (Narayanan et al., 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §2.2). The stage plan's activations at
  its peak are one microbatch's;
- **the bubble**: the roofline step time is the stage's ×
  ``1 + (pp − 1) / (stages per rank × microbatches)``.

With ``training.activation_checkpoint: auto`` an extrapolated stage (more than
``FULL_STEP_MAX_BLOCKS`` blocks) that fits one microbatch but not the held ones is
planned once more on a device made smaller by what they need (``_squeezed``), so the
recompute choice counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from titan_kedro.config.layout import INTERLEAVED_SCHEDULES
from titan_kedro.models.counting import count_parameters
from titan_kedro.models.parallel import reshard_after_forward
from titan_kedro.models.pipeline_split import pipeline_layout
from titan_kedro.models.resolve import ResolvedJob, resolve_job_config
from titan_kedro.plan.devices import GIB
from titan_kedro.train.pipeline.stages import stage_ids


def bubble_share(layout: Any) -> float:
    """The pipeline's idle share of a step: ``(pp − 1) / (stages per rank × microbatches)``."""
    if layout.pp == 1:
        return 0.0
    return (layout.pp - 1) / (layout.pp_stages_per_rank * max(layout.n_microbatches, 1))


def pipelined_plan(
    resolved: ResolvedJob, measure: Callable[[ResolvedJob], dict[str, Any]]
) -> dict[str, Any]:
    """``measure`` (the planner's fake-step plan) of the heaviest rank, made the job's plan."""
    layout = resolved.config.layout
    stage, blocks = stage_job(resolved)
    plan = measure(stage)
    extra = _in_flight_bytes(plan, layout)
    squeezed = _squeezed(stage, plan, extra)
    if squeezed is not None:  # auto recompute, chosen again for all the microbatches held
        memory = plan["device_memory_gib"]
        plan = measure(squeezed)
        plan["device_memory_gib"] = memory
        extra = _in_flight_bytes(plan, layout)
    per_rank = dict(plan["bytes_per_rank"])
    per_rank["activations"] = per_rank.get("activations", 0) + extra
    per_rank["total"] += extra
    held = stage_held_bytes(stage, plan)
    for kind, value in held.items():
        added = max(0, value - per_rank.get(kind, 0))  # what the stage plan did not count
        per_rank[kind] = per_rank.get(kind, 0) + added
        per_rank["total"] += added
    plan["bytes_per_rank"] = per_rank
    plan["gib_per_rank"] = {kind: value / GIB for kind, value in per_rank.items()}
    plan["headroom_gib"] = (
        plan["device_memory_gib"] - plan["reserved_gib"] - per_rank["total"] / GIB
    )
    plan["fits"] = plan["headroom_gib"] >= 0
    bubble = bubble_share(layout)
    plan["cost"]["roofline_step_time_s"] *= 1.0 + bubble
    plan["world_size"] = layout.world_size
    plan["layout"] = {
        **plan["layout"],
        "pp": layout.pp,
        "pp_schedule": layout.pp_schedule,
        "pp_stages_per_rank": layout.pp_stages_per_rank,
        "pp_microbatches": layout.n_microbatches,
        "grad_accum_steps": layout.grad_accum_steps,
    }
    plan["pipeline"] = {
        "method": "the heaviest pipeline rank's blocks with the embedding, the head and the "
        "loss, as a job of world / pp ranks, + in-flight microbatches + bubble "
        "(titan_kedro.plan.pipeline_plan)",
        "rank_blocks": blocks,
        "in_flight_activation_bytes": extra,
        "held_bytes": held,
        "bubble": bubble,
    }
    for kind in held:
        plan["figures"][kind] = {
            "bytes": per_rank[kind],
            "method": "the stage's parameters on this rank (dense over TP, experts over EP), "
            "unsharded through the step (titan_kedro.plan.pipeline_plan.stage_held_bytes)",
        }
    return plan


def stage_held_bytes(stage: ResolvedJob, plan: dict[str, Any]) -> dict[str, int]:
    """What a pipelined stage holds unsharded through a step, beside the ZeRO-3 plan.

    torch's schedules run every microbatch but the last with FSDP's gradient sync off
    (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), so
    the stage accumulates **unsharded gradients** of all its parameters, in the reduce
    dtype (``unsharded_grads``, replacing the block's reduce-scatter buffer the stage plan
    measured); with ``fsdp_reshard_after_forward`` ``never`` (the default under PP) it also keeps every block's **gathered parameters**, in the
    compute dtype, from the first forward to the last backward (``gathered_params``,
    replacing the block or two the stage plan measured). A rank's unsharded share is its
    TP slice of the dense parameters and its EP slice of the routed experts (FSDP gathers
    only over the data-parallel ranks).

    Returns:
        ``{"unsharded_grads": …, "gathered_params": …}`` (the latter only when
        parameters are kept).
    """
    with torch.device("meta"):
        counts = count_parameters(stage.spec.build_model(stage.model_args))
    layout = stage.config.layout
    routed = counts.routed_experts
    dense = counts.total - routed
    local = dense / layout.tp + routed / layout.ep
    size = {name: getattr(torch, plan[name]).itemsize for name in ("compute_dtype", "reduce_dtype")}
    held = {"unsharded_grads": int(local * size["reduce_dtype"])}
    if not reshard_after_forward(stage.config, pipelined=True):
        held["gathered_params"] = int(local * size["compute_dtype"])
    return held


def _squeezed(stage: ResolvedJob, plan: dict[str, Any], extra: int) -> ResolvedJob | None:
    """The stage job with less memory, so that ``auto`` recompute fits the held microbatches.

    ``training.activation_checkpoint: auto`` fits one microbatch's activations ``A`` beside
    the rest ``R`` of the peak; holding ``h`` microbatches needs ``R + h·A'`` to fit, so the
    stage is planned again on a device of ``R + (budget − R) / h`` (plus the reserve).
    None when it fits already, recompute is not ``auto``, nothing could fit, or the stage
    was measured in full (not extrapolated: its choice costs up to 5 fake steps, too many to
    run twice in a search).
    """
    training = stage.config.training
    if training.activation_checkpoint != "auto" or training.activation_checkpoint_blocks:
        return None
    if not plan["extrapolated"]:
        return None  # a full stage's auto choice re-measures up to 4 times: not twice
    per_rank = plan["bytes_per_rank"]
    activations = per_rank.get("activations", 0)
    budget = (plan["device_memory_gib"] - plan["reserved_gib"]) * GIB
    if not extra or not activations or per_rank["total"] + extra <= budget:
        return None
    rest = per_rank["total"] - activations
    held = 1 + extra / activations
    if rest >= budget:
        return None
    memory = (rest + (budget - rest) / held) / GIB + plan["reserved_gib"]
    section = stage.config.plan.model_copy(update={"device_memory_gib": memory})
    return stage._replace(config=stage.config.model_copy(update={"plan": section}))


def _in_flight_bytes(plan: dict[str, Any], layout: Any) -> int:
    """Activations of the microbatches the first pipeline rank holds beyond the plan's one."""
    if plan["peak_at"].get("phase") not in ("forward", "backward"):
        return 0
    held = float(min(layout.pp, layout.n_microbatches))
    if layout.pp_schedule in INTERLEAVED_SCHEDULES:
        held *= 1 + (layout.pp - 1) / (layout.pp * layout.pp_stages_per_rank)
    return int((held - 1) * plan["bytes_per_rank"].get("activations", 0))


def stage_job(job: ResolvedJob) -> tuple[ResolvedJob, int]:
    """The heaviest pipeline rank as a job without pipelining, and its block count."""
    cfg, args, layout = job.config, job.model_args, job.config.layout
    split = pipeline_layout(cfg, args, job.spec)
    blocks = max(
        sum(split[s] for s in stage_ids(r, layout.pp, layout.pp_stages_per_rank))
        for r in range(layout.pp)
    )
    raw = cfg.model_dump(mode="json")
    ranks = layout.world_size // layout.pp
    per_node = cfg.launch.nproc_per_node
    nodes = ranks // per_node if ranks % per_node == 0 else 1
    raw["launch"] = {**raw["launch"], "nnodes": nodes, "nproc_per_node": ranks // nodes}
    raw["parallelism"] = {
        **raw["parallelism"],
        "pipeline_parallel_degree": 1,
        "pipeline_schedule": "1F1B",
        "pipeline_stages_per_rank": None,
        "pipeline_microbatch_size": None,
        "pipeline_layout": None,
    }
    micro = layout.pp_microbatch_size
    raw["training"] = {
        **raw["training"],
        "local_batch_size": micro,
        "global_batch_size": micro * layout.dp_degree * layout.n_microbatches,
    }
    raw["validation"] = {**raw["validation"], "freq": 0}  # its batch rule is the pipeline's
    stage = resolve_job_config(raw)
    changes: dict[str, Any] = {"n_layers": blocks}
    first_dense = getattr(args, "first_k_dense_replace", None)
    if first_dense is not None:  # the rank's blocks are the model's last ones
        changes["first_k_dense_replace"] = max(0, first_dense - (args.n_layers - blocks))
    return stage._replace(model_args=dataclasses.replace(args, **changes)), blocks
