"""``build_plan``: will the configured job fit on its devices, and what will it cost?"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from typing import Any

import torch

from titan_kedro.models.counting import count_parameters
from titan_kedro.models.parallel import training_dtypes
from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan.checkpoint_choice import BlockCost, choose_recompute
from titan_kedro.plan.cuda_kernels import AttentionCorrection, cuda_attention
from titan_kedro.plan.devices import planned_device, planned_kind
from titan_kedro.plan.fake_step import StepMeasurement, measure_step, with_checkpointed
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
    "temporaries",
)
"""The per-rank byte counts of a plan (at the measured peak), in the order they are printed."""

FULL_STEP_MAX_BLOCKS = 8
"""Models with more blocks are measured with ``MEASURED_REPEATS`` repeated blocks and
extrapolated (``plan["extrapolated"]`` says so); a fake step costs seconds per block."""
MEASURED_REPEATS = 2
"""Repeated blocks (after a model's leading special ones) in an extrapolated measurement."""


logger = logging.getLogger(__name__)

_MEASURED: dict[str, dict[str, Any]] = {}
"""Plans measured in this process, by ``_measurement_key``: a ``kedro run`` plans in the
model-spec node and again in the training node, which reuses the first measurement."""


class PlanDoesNotFitError(RuntimeError):
    """The job's plan needs more memory per rank than its device has."""


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
            FULL_STEP_MAX_BLOCKS,
            MEASURED_REPEATS,
        ],
        sort_keys=True,
    )


def _measure(resolved: ResolvedJob) -> dict[str, Any]:
    start = time.perf_counter()
    cfg, spec, args = resolved.config, resolved.spec, resolved.model_args
    world = cfg.launch.world_size
    kind = planned_kind(cfg)
    compute_dtype, reduce_dtype = training_dtypes(cfg, torch.device(kind))
    device = planned_device(cfg, compute_dtype)
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
        step = _StepPlanner(resolved, dims, device, sharded, kind == "cuda")
        measured, choice = step.plan_checkpointing(budget)
    per_rank = {kind_: int(measured.parts.get(kind_, 0)) for kind_ in KINDS}
    per_rank["other"] = measured.peak_bytes - sum(per_rank.values())
    per_rank["total"] = measured.peak_bytes
    method = "fake_step_extrapolated" if step.extrapolated else "fake_step"
    figures = {
        kind_: {"bytes": value, "method": method}
        for kind_, value in per_rank.items()
        if kind_ not in ("params", "grads", "optimizer")
    }
    for kind_ in ("params", "grads", "optimizer"):
        figures[kind_] = {"bytes": per_rank[kind_], "method": method}
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
    roofline_s = measured.roofline.time_s * cfg.grad_accum_steps
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
            "memory_bandwidth_gbs": device.bandwidth_gbs,
        },
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "reduce_dtype": str(reduce_dtype).removeprefix("torch."),
        "activation_checkpoint": cfg.training.activation_checkpoint,
        "activation_checkpoint_blocks": measured.checkpointed,
        "fused_loss": bool(fused),
        "micro_batch_tokens": tokens,
        "bytes_per_rank": per_rank,
        "gib_per_rank": {kind_: value / GIB for kind_, value in per_rank.items()},
        "figures": figures,
        "peak_at": measured.peak_at,
        "extrapolated": step.extrapolation_note(),
        "cuda_corrections": step.corrections(),
        "checkpoint_choice": choice,
        "formula_cross_check": {
            "method": "formula",
            "params": sharded.params,
            "grads": sharded.grads,
            "optimizer": sharded.optimizer,
            "gathered_params": sharded.gathered_params,
            "unsharded_grads": sharded.unsharded_grads,
            **formula,
        },
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
            "roofline_step_time_s": roofline_s,
            "roofline_method": method,
            "measured_flops_per_rank_step": measured.roofline.flops * cfg.grad_accum_steps,
            "wall_time_h": wall_h,
            "device_hours": wall_h * world,
        },
    }
    plan["suggestions"] = [] if plan["fits"] else _suggestions(plan, resolved)
    plan["planned_in_s"] = time.perf_counter() - start
    return plan


def _formula_mode(mode: str) -> str:
    return "none" if mode == "auto" else mode


class _StepPlanner:
    """Runs (and, for deep models, extrapolates) the fake step for one plan."""

    def __init__(
        self, resolved: ResolvedJob, dims: ParallelDims, device: Any, sharded: Any, cuda: bool
    ) -> None:
        self.resolved = resolved
        self.dims = dims
        self.device = device
        self.cuda = cuda
        self.sharded = sharded
        self.attention = AttentionCorrection()
        args = resolved.model_args
        n_blocks = int(getattr(args, "n_layers", 0) or 0)
        leading = int(getattr(args, "first_k_dense_replace", 0) or 0)
        measured = leading + MEASURED_REPEATS
        self.extrapolated = (
            n_blocks > FULL_STEP_MAX_BLOCKS
            and measured < n_blocks
            and dataclasses.is_dataclass(args)
        )
        self.n_blocks = n_blocks
        self.measured_blocks = measured if self.extrapolated else n_blocks
        self.small = (
            resolved._replace(model_args=dataclasses.replace(args, n_layers=measured))
            if self.extrapolated
            else resolved
        )

    def measure(self, checkpointed: list[str] | None = None) -> StepMeasurement:
        """One fake step (of the reduced model when extrapolating), extended to the full depth."""
        if self.cuda:
            with cuda_attention() as record:
                measured = self._measure(checkpointed)
            self.attention = record
        else:
            measured = self._measure(checkpointed)
        return self._extend(measured) if self.extrapolated else measured

    def _measure(self, checkpointed: list[str] | None) -> StepMeasurement:
        if checkpointed is not None and self.extrapolated:
            checkpointed = [b for b in checkpointed if int(b) < self.measured_blocks]
        return measure_step(
            self.small,
            self.dims,
            peak_flops=self.device.peak_tflops * 1e12,
            bandwidth=(self.device.bandwidth_gbs or math.inf) * 1e9,
            checkpointed=checkpointed,
        )

    def _extend(self, small: StepMeasurement) -> StepMeasurement:
        """Add the missing blocks: each like the last measured one; states exactly."""
        last = str(self.measured_blocks - 1)
        extra = self.n_blocks - self.measured_blocks
        saved = dict(small.block_saved_bytes)
        inputs = dict(small.block_input_bytes)
        for index in range(self.measured_blocks, self.n_blocks):
            saved[str(index)] = saved.get(last, 0)
            inputs[str(index)] = inputs.get(last, 0)
        parts = dict(small.parts)
        added = extra * saved.get(last, 0)
        if small.peak_at.get("phase") in ("forward", "backward"):
            parts["activations"] = parts.get("activations", 0) + added
        else:
            added = 0
        states = {
            "params": self.sharded.params,
            "grads": self.sharded.grads,
            "optimizer": self.sharded.optimizer,
        }
        if small.peak_at.get("phase") != "optimizer":
            # Gradients alive at a forward/backward peak are those of the blocks after it
            # (and the root): the added blocks come before the last one, so they add none.
            del states["grads"]
        for kind, full in states.items():
            if kind in parts:
                added += full - parts[kind]
                parts[kind] = full
        per_block_s = 3 * small.roofline.by_block.get(last, 0.0)  # forward + 2× backward
        roofline = dataclasses.replace(
            small.roofline,
            time_s=small.roofline.time_s + extra * per_block_s,
            flops=small.roofline.flops * self.n_blocks / self.measured_blocks,
            by_block={
                **small.roofline.by_block,
                **{
                    str(i): small.roofline.by_block.get(last, 0.0)
                    for i in range(self.measured_blocks, self.n_blocks)
                },
            },
        )
        checkpointed = list(small.checkpointed)
        if checkpointed and last in checkpointed:
            checkpointed += [str(i) for i in range(self.measured_blocks, self.n_blocks)]
        return dataclasses.replace(
            small,
            peak_bytes=small.peak_bytes + added,
            parts=parts,
            block_saved_bytes=saved,
            block_input_bytes=inputs,
            roofline=roofline,
            checkpointed=checkpointed,
        )

    def plan_checkpointing(self, budget: int) -> tuple[StepMeasurement, dict[str, Any] | None]:
        """Measure the configured step; with ``auto``, choose blocks until it fits."""
        training = self.resolved.config.training
        if training.activation_checkpoint != "auto":
            return self.measure(), None
        if training.activation_checkpoint_blocks is not None:
            chosen = list(training.activation_checkpoint_blocks)
            measured = self.measure(chosen)
            return measured, {"chosen_by": "config", "blocks": chosen}
        measured = self.measure([])
        baseline = measured
        blocks = [
            BlockCost(
                name,
                measured.block_saved_bytes.get(name, 0),
                measured.block_input_bytes.get(name, 0),
                measured.roofline.by_block.get(name, 0.0),
            )
            for name in sorted(measured.block_saved_bytes, key=int)
        ]
        chosen: list[str] = []
        tries = 0
        if self.extrapolated and measured.peak_bytes > budget:
            chosen = choose_recompute(blocks, measured.peak_bytes - budget)
            return self._predicted(measured, blocks, chosen), {
                "chosen_by": "greedy solver on the extrapolated step (predicted, not re-measured)",
                "blocks": chosen,
                "peak_without_gib": measured.peak_bytes / GIB,
                "peak_with_gib": self._predicted(measured, blocks, chosen).peak_bytes / GIB,
                "recompute_roofline_s": sum(b.seconds for b in blocks if b.name in chosen),
                "measured_steps": 1,
            }
        while measured.peak_bytes > budget and len(chosen) < len(blocks) and tries < 4:
            chosen = choose_recompute(blocks, measured.peak_bytes - budget, chosen)
            measured = self.measure(chosen)
            tries += 1
        recompute_s = sum(b.seconds for b in blocks if b.name in chosen)
        return (
            measured,
            {
                "chosen_by": "greedy solver, checked by a fake step",
                "blocks": chosen,
                "peak_without_gib": baseline.peak_bytes / GIB,
                "peak_with_gib": measured.peak_bytes / GIB,
                "recompute_roofline_s": recompute_s,
                "measured_steps": tries + 1,
            },
        )

    @staticmethod
    def _predicted(
        measured: StepMeasurement, blocks: list[BlockCost], chosen: list[str]
    ) -> StepMeasurement:
        """The step with ``chosen`` recomputed, predicted from its per-block figures."""
        picked = [b for b in blocks if b.name in chosen]
        change = max((b.saved for b in picked), default=0) - sum(b.freed for b in picked)
        if measured.peak_at.get("phase") not in ("forward", "backward"):
            change = 0  # the peak holds no activations: recomputing does not lower it
        parts = dict(measured.parts)
        parts["activations"] = parts.get("activations", 0) + change
        return dataclasses.replace(
            measured,
            peak_bytes=measured.peak_bytes + change,
            parts=parts,
            checkpointed=list(chosen),
        )

    def corrections(self) -> list[dict[str, Any]]:
        """What the CUDA plan changed from the CPU step, visibly."""
        if not self.cuda:
            return []
        record = self.attention
        return [
            {
                "what": "attention",
                "cpu_kernel": "SDPA (math path with a dense document mask or MLA head dims: "
                "keeps batch×heads×seq×seq weights)",
                "cuda_kernel": "FlexAttention / fused SDPA (keeps output + log-sum-exp); "
                "measured with aten._scaled_dot_product_efficient_attention",
                "calls": record.calls,
                "cpu_weights_bytes_not_kept": record.cpu_weights_bytes,
                "shapes": record.shapes,
            },
            {
                "what": "routed experts",
                "note": "bf16 torch._grouped_mm runs its own fake kernel (as on CUDA); no "
                "correction",
            },
        ]

    def extrapolation_note(self) -> dict[str, Any] | None:
        """How the figures were extended from fewer blocks, or None (full step)."""
        if not self.extrapolated:
            return None
        return {
            "measured_blocks": self.measured_blocks,
            "model_blocks": self.n_blocks,
            "rule": "activations at a forward/backward peak grow by the last measured "
            "block's saved bytes per missing block; params and optimizer state are the "
            "full sharded model's, gradients too at an optimizer peak (at a "
            "forward/backward peak those alive belong to the blocks after it); roofline "
            "adds 3× the last block's forward",
        }


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
    if not plan["fused_loss"] and logits > 0.05 * budget:
        out.append(f"training.fused_loss: true (the full logits take about {logits:.1f} GiB)")
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


def apply_plan_choices(job_config: Any, plan: dict[str, Any]) -> None:
    """Write what the plan chose into the job config the workers get.

    With ``training.activation_checkpoint: auto`` and no blocks named, the blocks the
    plan measured fitting become ``training.activation_checkpoint_blocks``.
    """
    training = job_config.training
    if training.activation_checkpoint == "auto" and training.activation_checkpoint_blocks is None:
        training.activation_checkpoint_blocks = list(plan["activation_checkpoint_blocks"])


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
