"""One training step of the job, run on fake tensors and tracked: the plan's measured memory.

The model is built on the meta device and given fake (shape-only) CPU tensors, sharded by
the spec's own ``parallelize_fn`` on the fake process group, and then runs the trainer's
step — forward (with document masking), the (fused) loss, backward, gradient norms,
optimizer step — under ``FakeTensorMode`` while ``FSDPMemTracker`` (or ``MemTracker``
for the unsharded one-rank model) follows every allocation by category. The optimizer
state is created first (zero gradients, one optimizer step), so the tracked step is a
steady-state one: its peak, the parts at that peak, where it happened (module and
phase), the bytes each block keeps for backward, and FLOPs / roofline seconds from
``RooflineCounter``.

The step is the trainer's own ``train/step.TrainStep`` (nothing copied): built from the
plan's model, loss, optimizers and LR schedulers, on the CPU, with a batch source of
random tokens. It runs ``min(grad_accum_steps, MEASURED_MICRO_BATCHES)`` micro-batches:
the second one runs with the first one's gradients held, as every later one does, so the
peak is the accumulating step's; the roofline totals are reported per micro-batch (the
planner scales them by ``grad_accum_steps``).

Values the step reads: MoE token counts come from ``KnownValues`` (routing is assumed
balanced); the scalars it reports and checks (loss, gradient norm) and the expert-load
statistics come from ``AssumedFinite`` (a fake step has no values: they are assumed
finite and not reported). Nothing is computed for real and nothing touches a GPU: a
CUDA plan runs the same step on the CPU in the GPU's compute dtype (see
``planner.cuda_corrections``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten

from titan_kedro.models.parallel import autocast_dtype
from titan_kedro.models.tensor_parallel import loss_parallel_cross_entropy
from titan_kedro.plan.known_values import KnownValues
from titan_kedro.plan.roofline import RooflineCounter, RooflineTotals
from titan_kedro.plan.trackers import (
    FSDPTracker,
    PlainTracker,
    block_saved_bytes,
    reset_tracker_peak,
)
from titan_kedro.train.documents import takes_document_ids
from titan_kedro.train.fused_loss import (
    FusedOutputLoss,
    defer_output_projection,
    separate_chunk_buffers,
    uses_fused_loss,
)
from titan_kedro.train.step import HostReads, TrainStep
from titan_kedro.train.trainer import build_model

PART_NAMES = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "gathered_params",
    "All Gather": "gathered_params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "unsharded_grads",
    "Reduce Scatter": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Inputs": "inputs",
    "Other": "other",
}
"""The trackers' categories, by the names the plan prints."""

MEASURED_MICRO_BATCHES = 2
"""Micro-batches the measured step runs at most: the first allocates the gradients, the
second accumulates into them (the steady state of every later one)."""

FAKE_BOS_ID = 0
"""Token id that starts documents in the fake batch (its values are random: the masks
have their real shapes, which is all memory depends on)."""


@dataclass
class StepMeasurement:
    """What one tracked step (fake, or real for the check) used on rank 0."""

    peak_bytes: int
    parts: dict[str, int]
    """Bytes by ``PART_NAMES`` category at the peak."""
    peak_at: dict[str, str]
    """``module`` (innermost running) and ``phase`` (forward / backward / optimizer)."""
    block_saved_bytes: dict[str, int]
    """Bytes each block (``model.layers`` key) keeps from its forward until its backward."""
    block_input_bytes: dict[str, int]
    """Bytes of each block's input (what a checkpointed block keeps instead)."""
    roofline: RooflineTotals
    """FLOPs, bytes and roofline seconds of the step."""
    checkpointed: list[str] = field(default_factory=list)
    """Blocks wrapped for recomputation in this step."""
    real_step_s: float | None = None
    """Wall seconds of the same step run untracked (real runs only)."""


class AssumedFinite(HostReads):
    """The step's value reads in a fake step, where tensors have no values.

    Scalars (loss, gradient norm, auxiliary losses) read as ``0.0``: finite, so the step
    goes on to the optimizer as a healthy real step does (the plan measures memory and
    work, not values); expert-load statistics are not computed (no metrics).
    """

    def scalar(self, value: torch.Tensor) -> float:
        return 0.0

    def expert_load_stats(self, load: torch.Tensor) -> dict[str, Any]:
        return {}


def fake_model(model: nn.Module) -> nn.Module:
    """Give a meta-device model (sharded or not) fake CPU storage; call inside ``FakeTensorMode``.

    FSDP2 modules take ``to_empty`` (it re-creates their sharded parameters); the others
    get their parameters and buffers replaced one by one (``to_empty`` cannot swap a
    meta parameter for a fake one).
    """
    if isinstance(model, FSDPModule):
        return model.to_empty(device="cpu")
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad
                )
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    return model


def _create_optimizer_state(model: nn.Module, optimizers: Any) -> None:
    """Let the optimizer allocate its state (zero gradients, one step), as after step 1."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizers.step()
    optimizers.zero_grad()


def with_checkpointed(job_config: Any, blocks: list[str]) -> Any:
    """A copy of ``job_config`` recomputing exactly ``blocks`` (``activation_checkpoint: auto``)."""
    training = job_config.training.model_copy(
        update={"activation_checkpoint": "auto", "activation_checkpoint_blocks": list(blocks)}
    )
    return job_config.model_copy(update={"training": training})


def measure_step(
    resolved: Any,
    parallel_dims: Any,
    *,
    peak_flops: float,
    bandwidth: float,
    checkpointed: list[str] | None = None,
    fake: bool = True,
) -> StepMeasurement:
    """Run one fake training step of ``resolved`` on rank 0 of the fake world and measure it.

    With ``fake=False`` the same step runs for real (initialised weights, random tokens, on
    the real process group of a CPU job): the check of the fake measurement.

    Args:
        resolved: The resolved job (its ``training.activation_checkpoint`` is applied, or
            ``checkpointed`` when given).
        parallel_dims: Built ``ParallelDims`` on the fake process group; its ``device``
            decides the compute dtype (``cuda``: the GPU's mixed precision).
        peak_flops: Planned device FLOP/s for the roofline.
        bandwidth: Planned device memory bytes/s for the roofline.
        checkpointed: Block names to recompute (``activation_checkpoint: auto``).
        fake: Fake tensors (the plan) or real ones (the check).

    Returns:
        The measurement of the step (optimizer state already allocated).
    """
    spec = resolved.spec
    cfg = (
        resolved.config
        if checkpointed is None
        else with_checkpointed(resolved.config, checkpointed)
    )
    micro_batches = measured_micro_batches(cfg)
    cfg = with_micro_batches(cfg, micro_batches)
    if fake:
        with torch.device("meta"):
            model = spec.build_model(resolved.model_args)
    else:  # as the trainer does: allocated and initialised, then sharded
        model = build_model(spec, resolved.model_args, cfg.job.seed, torch.device("cpu"))
    fused = uses_fused_loss(cfg, spec, model)
    loss_fn = FusedOutputLoss(defer_output_projection(model)) if fused else spec.build_loss_fn(cfg)
    if cfg.layout.tp > 1 and not fused:  # as the trainer: logits stay split over the vocabulary
        loss_fn = loss_parallel_cross_entropy(loss_fn)
    masking = cfg.training.document_masking and takes_document_ids(model)
    blocks = dict(model.layers.items())
    # Fake: sharded on the meta device, fast at any world size; storage comes below.
    model = spec.parallelize_fn(model, parallel_dims, cfg)
    wrapped = [name for name, block in model.layers.items() if block is not blocks[name]]
    autocast = autocast_dtype(model, cfg, parallel_dims.device)
    seq, batch = cfg.training.seq_len, cfg.training.local_batch_size
    vocab = int(getattr(resolved.model_args, "vocab_size", 2))
    # Device meshes stay real tensors inside the fake mode.
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    timed_s = None
    with mode, separate_chunk_buffers():
        if fake:
            model = fake_model(model)
        optimizers = spec.build_optimizers_fn([model], cfg)
        tracker: Any
        if isinstance(model, FSDPModule):
            tracker = FSDPTracker(model, optimizers.optimizers[0])
        else:
            tracker = PlainTracker()
            tracker.track_external(model, *optimizers.optimizers)
        roofline = RooflineCounter(peak_flops, bandwidth)
        step = TrainStep(
            [model],
            loss_fn,
            optimizers,
            spec.build_lr_schedulers_fn(optimizers, cfg),
            cfg,
            torch.device("cpu"),  # fake or real, the plan's tensors live on the CPU
            parallel_dims.dp_mesh.get_group(),
            parallel_dims.dp_degree,
            _random_batches(vocab, batch, seq, between=tracker.reset_mod_stats),
            FAKE_BOS_ID if masking else None,
            autocast,
            reads=AssumedFinite() if fake else HostReads(),
            load_group=parallel_dims.load_group,
        )
        inputs_seen: dict[str, int] = {}
        values = KnownValues() if fake else nullcontext()
        with tracker, values, _block_hooks(model, roofline, inputs_seen):
            _create_optimizer_state(model, optimizers)
            tracker.reset_mod_stats()
            reset_tracker_peak(tracker)
            with roofline:
                step()
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        saved = block_saved_bytes(tracker, model)
        if not fake:  # the same step untracked, timed (for the roofline's ratio)
            start = time.perf_counter()
            step()
            timed_s = (time.perf_counter() - start) / micro_batches
    parts: dict[str, int] = {}
    for kind, value in snapshot.items():
        if kind == "Total":
            continue
        name = PART_NAMES.get(getattr(kind, "value", str(kind)), "other")
        parts[name] = parts.get(name, 0) + int(value)
    return StepMeasurement(
        peak_bytes=int(snapshot["Total"]),
        parts=parts,
        peak_at=dict(tracker.peak_at),
        block_saved_bytes=saved,
        block_input_bytes=inputs_seen,
        roofline=_per_micro_batch(roofline.totals, micro_batches),
        checkpointed=wrapped,
        real_step_s=timed_s,
    )


def measured_micro_batches(job_config: Any) -> int:
    """``MEASURED_MICRO_BATCHES`` (at most the job's), or more when fewer would not fill
    the job's pipeline (``Layout`` refuses a pipeline with too few microbatches)."""
    accum = job_config.layout.grad_accum_steps
    for micro_batches in range(min(accum, MEASURED_MICRO_BATCHES), accum):
        try:
            with_micro_batches(job_config, micro_batches).layout  # noqa: B018
        except ValueError:
            continue
        return micro_batches
    return accum


def with_micro_batches(job_config: Any, micro_batches: int) -> Any:
    """A copy of ``job_config`` whose step accumulates ``micro_batches`` micro-batches."""
    layout = job_config.layout
    if layout.grad_accum_steps == micro_batches:
        return job_config
    samples = layout.local_batch_size * layout.data_ranks * micro_batches
    training = job_config.training.model_copy(update={"global_batch_size": samples})
    return job_config.model_copy(update={"training": training})


def _random_batches(vocab: int, batch: int, seq: int, *, between: Any) -> Any:
    """The step's batch source: random tokens, the same tensor as inputs and labels.

    ``between`` runs before every micro-batch after a step's first: the trackers refuse a
    module's second forward unless their per-module stats are reset
    (``reset_mod_stats``), so the block figures are the last micro-batch's.
    """
    drawn = 0

    def batches() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal drawn
        if drawn:
            between()
        drawn += 1
        tokens = torch.randint(0, vocab, (batch, seq))
        return tokens, tokens

    return batches


def _per_micro_batch(totals: RooflineTotals, micro_batches: int) -> RooflineTotals:
    """The roofline of a step of ``micro_batches`` as the mean per micro-batch (the
    clipping and optimizer share spread over them)."""
    if micro_batches == 1:
        return totals
    return RooflineTotals(
        flops=totals.flops / micro_batches,
        bytes=totals.bytes / micro_batches,
        time_s=totals.time_s / micro_batches,
        by_block={name: s / micro_batches for name, s in totals.by_block.items()},
        block_flops={name: f / micro_batches for name, f in totals.block_flops.items()},
        block_time_s={name: s / micro_batches for name, s in totals.block_time_s.items()},
        after_backward_s=totals.after_backward_s / micro_batches,
    )


@contextmanager
def _block_hooks(
    model: nn.Module, roofline: RooflineCounter, inputs_seen: dict[str, int]
) -> Iterator[None]:
    """Attribute roofline FLOPs and time to blocks and record each block's input size.

    A block's forward runs between its forward hooks; its backward (with any
    recomputation) from its output's gradient to its input's: multi-gradient hooks on
    those tensors, registered in the forward, tell the counter (``start_backward`` /
    ``end_backward``)."""
    handles = []
    for name, block in model.layers.items():

        def before(module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # a recomputation inside backward
            roofline.block = name
            inputs_seen[name] = args[0].numel() * args[0].element_size()
            needing = _needing_grad(args)
            if needing:
                register_multi_grad_hook(needing, lambda _: roofline.end_backward(name))

        def after(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            roofline.block = None
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            needing = _needing_grad(output)
            if needing:
                hook = lambda _: roofline.start_backward(name)  # noqa: E731
                register_multi_grad_hook(needing, hook, mode="any")

        handles += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _needing_grad(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
