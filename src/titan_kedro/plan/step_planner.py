"""``StepPlanner``: the fake step of one plan, extrapolated for deep models, with the
activation-checkpointing choice (``training.activation_checkpoint: auto``) that fits.

``measure`` runs ``fake_step.measure_step`` (under CUDA's attention kernel for CUDA
plans); models with more than ``FULL_STEP_MAX_BLOCKS`` blocks are measured with
``MEASURED_REPEATS`` repeated blocks and extended per block (``_extend``);
``plan_checkpointing`` picks blocks with ``checkpoint_choice.choose_recompute`` and checks
them with another fake step (predicted from per-block figures when extrapolating).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan.checkpoint_choice import BlockCost, choose_recompute
from titan_kedro.plan.cuda_kernels import AttentionCorrection, cuda_attention
from titan_kedro.plan.devices import GIB
from titan_kedro.plan.fake_step import StepMeasurement, measure_step
from titan_kedro.plan.roofline import RooflineTotals
from titan_kedro.train.parallel_dims import ParallelDims

FULL_STEP_MAX_BLOCKS = 8
"""Models with more blocks are measured with ``MEASURED_REPEATS`` repeated blocks and
extrapolated (``plan["extrapolated"]`` says so); a fake step costs seconds per block."""
MEASURED_REPEATS = 2
"""Repeated blocks (after a model's leading special ones) in an extrapolated measurement."""


class StepPlanner:
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
        measured_params = small.parts.get("params", 0)
        params_ratio = self.sharded.params / measured_params if measured_params else 1.0
        roofline = _extend_roofline(
            small.roofline, last, range(self.measured_blocks, self.n_blocks), params_ratio
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
            "forward/backward peak those alive belong to the blocks after it); FLOPs and "
            "roofline time add the last measured block's (forward, backward and "
            "recomputation, attributed by hooks on each block's forward and on its output's "
            "and input's gradients) per missing block; the clipping and optimizer time after "
            "the last backward grows with the sharded parameters; embedding, output head "
            "and loss as measured",
        }


def _extend_roofline(
    measured: RooflineTotals, last: str, added: range, params_ratio: float
) -> RooflineTotals:
    """The roofline with the ``added`` blocks, each doing what block ``last`` did.

    Only the blocks' work grows: each added block brings the last measured one's FLOPs and
    roofline seconds (forward, backward and recomputation, attributed by the fake step's
    block hooks). The embedding, output head and loss are kept as measured; the clipping
    and optimizer time after the last backward grows with the parameters
    (``params_ratio``: the full sharded model's over the measured one's; no FLOPs there).
    """

    def extended(per_block: dict[str, float]) -> dict[str, float]:
        return {**per_block, **{str(i): per_block.get(last, 0.0) for i in added}}

    blocks_s = len(added) * measured.block_time_s.get(last, 0.0)
    params_s = (params_ratio - 1.0) * measured.after_backward_s
    return dataclasses.replace(
        measured,
        flops=measured.flops + len(added) * measured.block_flops.get(last, 0.0),
        time_s=measured.time_s + blocks_s + params_s,
        by_block=extended(measured.by_block),
        block_flops=extended(measured.block_flops),
        block_time_s=extended(measured.block_time_s),
        after_backward_s=measured.after_backward_s * params_ratio,
    )
