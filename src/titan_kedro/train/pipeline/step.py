"""The pipelined optimizer step: ``TrainStep``'s contract, run through a torch schedule.

Per step every rank draws its ``grad_accum_steps`` micro-batches (each stage of a
pipeline draws the same samples: the first stage needs the tokens, the last the labels),
concatenates them, and ``schedule.step`` runs ``Layout.n_microbatches`` pipeline
microbatches forward and backward. The loss the schedule differentiates is, on the last
stage, ``ce + mtp_loss_weight · L_MTP`` per microbatch; each stage's MoE auxiliary loss
reaches the gradients through ``stages.AddAuxGrad``. The schedule divides every gradient
by the microbatch count (``scale_grads``), as ``(loss / accum).backward()`` does without
pipelining, and FSDP reduces a stage's gradients once, after its last microbatch.

Then, as ``TrainStep``: clipping by the global norm (the one all-reduce spans every stage,
``grad_clip.clip_grad_norm_(holders=world / pp)``), the finite check, the optimizer and
LR steps and each stage's MoE bias update from its layers' load summed over its
data-parallel ranks. Loss values exist on the last stage only: the reported ``loss``,
``mtp_loss`` and ``moe_aux_loss`` are summed over the pipeline (zeros elsewhere) and then
averaged over data-parallel ranks, so every rank (rank 0 logs) holds the same numbers.

With one microbatch per accumulation step (``pipeline_microbatch_size`` left at
``local_batch_size``) the losses and gradients are those of one process accumulating the
same batch. Smaller microbatches average per-microbatch means (equal when no label is
ignored) and compute the MoE balance loss per microbatch, a different (valid) objective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from titan_kedro.config.layout import INTERLEAVED_SCHEDULES
from titan_kedro.models.tensor_parallel import loss_context, reduce_partial_gradients
from titan_kedro.train.grad_clip import clip_grad_norm_
from titan_kedro.train.metrics import memory_metrics
from titan_kedro.train.mtp import mtp_loss, mtp_loss_weight
from titan_kedro.train.pipeline.stages import moe_layer_ids, take_aux_values
from titan_kedro.train.step import TrainStep


@dataclass
class PipelineTrainStep(TrainStep):
    """A ``TrainStep`` whose ``model_parts`` are this rank's pipeline stages."""

    pipeline_stages: list[Any] = field(default_factory=list)
    """This rank's ``PipelineStage`` s, in stage order."""
    pp_group: Any = None
    """Process group of this rank's pipeline (one rank per stage group)."""
    holders: int = 1
    """Ranks holding each parameter (``world / pp``), for the global gradient norm."""
    _recorded: dict[str, list[torch.Tensor]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        layout = self.config.layout
        if layout.pp_schedule in INTERLEAVED_SCHEDULES:
            self.schedule = ScheduleInterleaved1F1B(
                self.pipeline_stages, layout.n_microbatches, loss_fn=self.pipeline_loss
            )
        else:
            (stage,) = self.pipeline_stages
            self.schedule = Schedule1F1B(stage, layout.n_microbatches, loss_fn=self.pipeline_loss)

    @property
    def last_stage(self) -> Any:
        """This rank's last stage if it holds the pipeline's last, else None."""
        part = self.model_parts[-1]
        return part if part.pipeline_stage["last"] else None

    def pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn`` on the last stage: ``ce + weight · L_MTP`` of a microbatch."""
        ce = self.loss_fn(output, labels)
        record = not self.last_stage.pipeline_stage["probe"]  # not torch's shape inference
        if record:
            self._recorded.setdefault("ce", []).append(_plain(ce))
        mtp = mtp_loss(self.last_stage, self.loss_fn, labels)
        if mtp is None:
            return ce
        if record:
            self._recorded.setdefault("mtp", []).append(_plain(mtp))
        return ce + mtp_loss_weight(self.config) * mtp

    def _pipeline_sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Sum of ``values`` (this rank's) over the pipeline, then divided by microbatches."""
        total = torch.zeros((), device=self.device)
        for value in values:
            total = total + value.to(self.device)
        dist.all_reduce(total, group=self.pp_group)
        return total / self.config.layout.n_microbatches

    def _run_schedule(self) -> float:
        """Draw the step's samples and run the schedule; the data time."""
        inputs, labels, data_time = [], [], 0.0
        for _ in range(self.config.layout.grad_accum_steps):
            start = time.perf_counter()
            batch, label = self.next_batch()
            data_time += time.perf_counter() - start
            inputs.append(batch)
            labels.append(label)
        tokens, target = torch.cat(inputs), torch.cat(labels)
        extra = _document_kwargs(tokens, self.document_bos)
        first = self.model_parts[0].pipeline_stage["first"]
        args = (tokens,) if first else ()
        # Under tensor parallelism the last stage's logits are split over the vocabulary.
        with self.mixed_precision(), loss_context(self.config.layout.tp)():
            self.schedule.step(
                *args, target=target if self.last_stage is not None else None, **extra
            )
        return data_time

    def __call__(self) -> dict[str, Any]:
        """One pipelined optimizer step; its metrics (the same keys as ``TrainStep``)."""
        reads, parts = self.reads, self.model_parts
        # Every stage of a MoE model has these (a stage of dense blocks: an empty load).
        moe_parts = [part for part in parts if hasattr(part, "expert_load")]
        for part in moe_parts:
            part.reset_expert_load()
        self.optimizers.zero_grad()
        self._recorded = {}
        data_time = self._run_schedule()
        params = [p for part in parts for p in part.parameters() if p.requires_grad]
        if self.config.layout.tp > 1:  # without FSDP, the sequence-parallel norms' sums
            reduce_partial_gradients(params)
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, holders=self.holders)
        aux = [v for part in parts for v in take_aux_values(part)]
        loss_value = reads.scalar(self.dp_mean(self._pipeline_sum(self._recorded.get("ce", []))))
        norm_value = reads.scalar(grad_norm)
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self._raise_non_finite(loss_value, norm_value)
        lr = self.optimizers.param_groups[0]["lr"]
        metrics: dict[str, Any] = {
            "loss": loss_value,
            "grad_norm": norm_value,
            "lr": lr,
            "data_time_s": data_time,
        }
        if getattr(self.model.args, "mtp_depth", 0):  # every stage knows the model's args
            mtp = self._pipeline_sum(self._recorded.get("mtp", []))
            metrics["mtp_loss"] = reads.scalar(self.dp_mean(mtp))
        if moe_parts:
            metrics["moe_aux_loss"] = reads.scalar(self.dp_mean(self._pipeline_sum(aux)))
        loads = []
        for part in moe_parts:
            load = part.expert_load().detach().float().to(self.device)
            dist.all_reduce(load, group=self.load_group or self.dp_group)
            loads.append(load)
        self.optimizers.step()
        self.lr_schedulers.step()
        for part, load in zip(moe_parts, loads, strict=True):
            part.update_expert_bias(load)
        if loads:
            load = self._whole_model_load(moe_parts, loads)
            if load.numel():
                metrics.update(reads.expert_load_stats(load))
        metrics.update(self._stage_memory())
        return metrics

    def evaluate(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n_batches: int
    ) -> float:
        """Mean loss over ``n_batches`` held-out batches per rank, run through the schedule.

        The batches go in groups of ``grad_accum_steps`` (a training step's samples, so the
        schedule's microbatch count holds); a remainder of fewer is not scored. The mean is
        over every microbatch of every data-parallel rank (per batch, as ``validation.
        mean_loss`` averages, when the microbatch is the local batch).

        Raises:
            ValueError: Fewer batches than one group.
        """
        accum, n_micro = self.config.layout.grad_accum_steps, self.config.layout.n_microbatches
        groups = n_batches // accum
        if groups == 0:
            raise ValueError(
                f"validation.steps gives {n_batches} batch(es) per rank, fewer than the "
                f"{accum} a pipelined step scores at once; raise validation.steps to {accum}"
            )
        total = torch.zeros((), device=self.device)
        source = iter(batches)
        for part in self.model_parts:
            part.eval()
        try:
            tp = self.config.layout.tp
            with torch.no_grad(), self.mixed_precision(), loss_context(tp)():
                for _ in range(groups):
                    pairs = [next(source) for _ in range(accum)]
                    tokens = torch.cat([i for i, _ in pairs]).to(self.device)
                    target = torch.cat([t for _, t in pairs]).to(self.device)
                    losses: list[torch.Tensor] = []
                    first = self.model_parts[0].pipeline_stage["first"]
                    self.schedule.eval(
                        *((tokens,) if first else ()),
                        target=target if self.last_stage is not None else None,
                        losses=losses,
                        **_document_kwargs(tokens, self.document_bos),
                    )
                    for loss in losses:
                        total += _plain(loss)
        finally:
            for part in self.model_parts:
                part.train()
            self._recorded = {}
            for part in self.model_parts:
                take_aux_values(part)
        dist.all_reduce(total, group=self.pp_group)
        dist.all_reduce(total, group=self.dp_group)
        return self.reads.scalar(total / (groups * n_micro * self.dp_degree))

    def _whole_model_load(self, parts: list[Any], loads: list[torch.Tensor]) -> torch.Tensor:
        """Every MoE layer's load ``[layers, experts]`` in model order, on every rank: each
        rank fills its stages' rows and the pipeline sums them (so the heatmap and the
        balance statistics cover all stages)."""
        args = self.model.args
        total = args.n_layers + getattr(args, "mtp_depth", 0)
        order = [i for i in range(total) if args.is_moe_layer(i)]
        full = torch.zeros(len(order), args.n_routed_experts, device=self.device)
        for part, load in zip(parts, loads, strict=True):
            for layer, row in zip(moe_layer_ids(part), load, strict=True):
                full[order.index(layer)] = row
        dist.all_reduce(full, group=self.pp_group)
        return full

    def _stage_memory(self) -> dict[str, float]:
        """``pp{r}_peak_memory_gib``: the peak memory of each rank of this rank's pipeline
        (CUDA: peak allocated; CPU: peak resident set), so rank 0 logs every stage's."""
        measured = memory_metrics(self.device)
        peak = measured.get("memory_allocated_gib", measured.get("vmhwm_gib"))
        value = torch.tensor([peak if peak is not None else measured["memory_gib"]])
        value = value.to(self.device)
        gathered = [torch.zeros_like(value) for _ in range(self.pp_group.size())]
        dist.all_gather(gathered, value, group=self.pp_group)
        return {f"pp{r}_peak_memory_gib": self.reads.scalar(v[0]) for r, v in enumerate(gathered)}


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached float copy of ``loss`` (a replicated DTensor under tensor parallelism)."""
    loss = loss.detach().float()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _document_kwargs(tokens: torch.Tensor, bos: int | None) -> dict[str, torch.Tensor]:
    from titan_kedro.train.documents import document_inputs

    return document_inputs(tokens, bos)
