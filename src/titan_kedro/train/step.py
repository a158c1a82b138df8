"""One optimizer step: the code the trainer runs and the plan measures (under fake tensors).

Per step: ``grad_accum_steps`` micro-batches (forward, cross-entropy + MoE auxiliary loss
+ weighted multi-token-prediction loss (``mtp.py``), backward of loss / accumulation),
gradient clipping by the global norm, a check that loss and norm are finite, the
optimizer and LR-schedule steps, then the MoE bias update from the expert load summed
over data-parallel ranks.

The step reads values in two places only, both through ``reads`` (``HostReads``): the
scalars it reports and checks (loss, gradient norm, auxiliary losses) and the expert-load
statistics. Everything else (clipping included) is value-free tensor code, so the same
``TrainStep`` runs under ``FakeTensorMode`` when ``reads`` does not read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_kedro.models.tensor_parallel import loss_context, reduce_partial_gradients
from titan_kedro.train.documents import document_inputs
from titan_kedro.train.grad_clip import clip_grad_norm_
from titan_kedro.train.metrics import expert_load_stats
from titan_kedro.train.mtp import mtp_loss, mtp_loss_weight


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; training stopped before the bad update."""


class HostReads:
    """How the step turns result tensors into host values: for real (the trainer's)."""

    def scalar(self, value: torch.Tensor) -> float:
        """A scalar tensor's value (a device sync on CUDA)."""
        return float(value)

    def expert_load_stats(self, load: torch.Tensor) -> dict[str, Any]:
        """``metrics.expert_load_stats`` of the global ``[layers, experts]`` load."""
        return expert_load_stats(load)


def _no_failure_context() -> tuple[int, Path | None]:
    return 0, None


@dataclass
class TrainStep:
    """The trainer's optimizer step, callable (``step()`` returns its metrics).

    ``Trainer.train_step`` delegates to one; ``plan/fake_step`` builds another from the
    plan's fake model and calls it under ``FakeTensorMode`` with reads that assume finite
    values. Nothing here knows which.
    """

    model_parts: list[nn.Module]
    loss_fn: Any
    optimizers: Any
    lr_schedulers: Any
    config: Any
    device: torch.device
    """Where the step's accumulators live and the autocast device type."""
    dp_group: Any
    dp_degree: int
    """Data-parallel ranks of this replica group (``Layout.dp_degree``): ``dp_group``'s size."""
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    """Returns the next micro-batch ``(inputs, labels)`` on ``device``."""
    document_bos: int | None
    autocast_dtype: torch.dtype | None
    ft: Any = None
    """The replica groups' seam (``ft/replica.ReplicaGroupFT``), or None."""
    mark_data: Callable[[], Callable[[], None]] | None = None
    """With ``ft``: records the data position, returns what rewinds to it (a retried step)."""
    failure_context: Callable[[], tuple[int, Path | None]] = _no_failure_context
    """(completed steps, last good checkpoint) for the non-finite error's message."""
    reads: HostReads = field(default_factory=HostReads)
    load_group: Any = None
    """Group the expert loads are summed over (None: ``dp_group``); every rank of the
    replica group under tensor parallelism, whose ranks route different tokens."""

    @property
    def model(self) -> nn.Module:
        return self.model_parts[0]

    def mixed_precision(self) -> torch.autocast:
        """Autocast to ``autocast_dtype`` for forward passes (disabled when None)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` over the data-parallel ranks (and the replica groups)."""
        value = value.detach().clone().float()
        dist.all_reduce(value, group=self.dp_group)
        value = value / self.dp_degree
        return value if self.ft is None else self.ft.replica_mean(value)

    def __call__(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; its metrics.

        Returns ``{}`` when the replica groups did not commit it (nothing was applied).
        """
        model, ft, reads = self.model, self.ft, self.reads
        rewind = None
        if ft is not None:  # the quorum (and healing) before any batch is drawn
            ft.begin_step()
            rewind = self.mark_data() if self.mark_data is not None else None
        has_moe = hasattr(model, "expert_load")
        if has_moe:
            model.reset_expert_load()
        self.optimizers.zero_grad()
        # Under tensor parallelism forward and backward run in loss_parallel (the logits
        # stay split over the vocabulary).
        with loss_context(self.config.layout.tp)():
            sums, data_time = self._micro_batches()
        accum = self.config.layout.grad_accum_steps
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        if self.config.layout.tp > 1:  # without FSDP, the sequence-parallel norms' sums
            reduce_partial_gradients(params)
        if ft is not None:
            ft.average_gradients(params)
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm)
        loss_value = reads.scalar(self.dp_mean(sums["ce"] / accum))
        norm_value = reads.scalar(grad_norm)
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self._raise_non_finite(loss_value, norm_value)
        lr = self.optimizers.param_groups[0]["lr"]
        # Every reduction happens before the commit vote, so all groups run the same ones.
        means = {
            name: reads.scalar(self.dp_mean(total / accum))
            for name, total in sums.items()
            if name != "ce"
        }
        if has_moe:
            load = model.expert_load().detach().float().to(self.device)
            load_group = self.dp_group if self.load_group is None else self.load_group
            dist.all_reduce(load, group=load_group)
            if ft is not None:
                ft.replica_sum(load)
        if ft is not None and not ft.should_commit():
            if rewind is not None:
                rewind()  # the retry reads the same batch
            return {}
        self.optimizers.step()
        self.lr_schedulers.step()
        metrics: dict[str, Any] = {
            "loss": loss_value,
            "grad_norm": norm_value,
            "lr": lr,
            "data_time_s": data_time,
        }
        if "mtp" in means:
            metrics["mtp_loss"] = means["mtp"]
        if "aux" in means:
            metrics["moe_aux_loss"] = means["aux"]
        if has_moe:
            model.update_expert_bias(load)
            metrics.update(reads.expert_load_stats(load))
        return metrics

    def _micro_batches(self) -> tuple[dict[str, torch.Tensor], float]:
        """Forward and backward of every micro-batch; summed losses (``ce``, ``aux``, ``mtp``)."""
        model, accum = self.model, self.config.layout.grad_accum_steps
        sums = {"ce": torch.zeros((), device=self.device)}
        if hasattr(model, "moe_aux_loss"):
            sums["aux"] = torch.zeros((), device=self.device)
        data_time = 0.0
        for _ in range(accum):
            start = time.perf_counter()
            inputs, labels = self.next_batch()
            data_time += time.perf_counter() - start
            with self.mixed_precision():
                # No name holds the output: the fused loss needs no more of it after its
                # forward, so it is freed before backward (the plan measures this too).
                ce = self.loss_fn(
                    model(inputs, **document_inputs(inputs, self.document_bos)), labels
                )
                mtp = mtp_loss(model, self.loss_fn, labels)
            loss = ce
            if mtp is not None:
                loss = loss + mtp_loss_weight(self.config) * mtp
                sums["mtp"] = sums.get("mtp", torch.zeros((), device=self.device))
                sums["mtp"] += mtp.detach().float()
            if "aux" in sums:
                aux = model.moe_aux_loss()
                loss = loss + aux
                sums["aux"] += aux.detach().float()
            (loss / accum).backward()
            sums["ce"] += ce.detach().float()
        return sums, data_time

    def _raise_non_finite(self, loss_value: float, norm_value: float) -> None:
        done, last = self.failure_context()
        raise NonFiniteLossError(
            f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient norm'} at "
            f"step {done + 1} (loss={loss_value}, grad_norm={norm_value}); "
            f"no update was applied. Last good checkpoint: {last or 'none'} (it stays the "
            "latest; lower optimizer.lr or raise lr_scheduler.warmup_steps and resume)"
        )
