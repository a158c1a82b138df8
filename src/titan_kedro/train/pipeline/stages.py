"""Cut a meta-device model into pipeline stages (whole blocks), each a pruned model.

The trainer builds the model on the meta device; a stage is that model with the other
blocks deleted, ``tok_embeddings`` kept on the first stage only and ``norm`` / ``output`` /
the MTP blocks on the last stage only (a rank holding several stages prunes a fresh meta
build for each: nothing is allocated or copied). Parameter names are unchanged, so
checkpoints, the optimizer's FQN-keyed state, HF export and the initialisation by name
(``models/sharded_init``: a stage draws the values the whole model would) see the names
of the unsplit model, and ``parallelize_fn`` (AC, compile, EP, FSDP) applies to a stage as
to a model. The trainer then allocates and initialises each stage's shards.

A stage's forward (:func:`stage_forward`, bound to the copy) passes on the hidden state
``h``; with MTP the first stage also sends the token embeddings, which every later stage
passes through to the last (MTP depth ``k`` reads ``emb(t_{i+k})``). The positions and
document ids of document masking reach every stage as keyword arguments.

**Auxiliary losses.** A stage's MoE balance losses (its ``moe_aux_loss()``) never reach the
loss the schedule differentiates, which exists on the last stage only. :class:`AddAuxGrad`
ties them to the stage's output instead: its forward returns the output unchanged, and its
backward gives the stage's auxiliary loss the gradient 1 — what ``(ce + aux).backward()``
would give it — so each stage's auxiliary gradients are the one-process ones, scaled like
the main loss by the schedule (``1 / n_microbatches``). Their values are recorded per
microbatch for the step's ``moe_aux_loss`` metric (summed over stages by the step).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_kedro.models.common import rotations_and_mask


class AddAuxGrad(torch.autograd.Function):
    """``out = output``; in backward the auxiliary loss gets gradient 1 (Megatron's
    ``MoEAuxLossAutoScaler`` without its scale: the schedule scales every gradient)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def stage_blocks(layout: list[int]) -> list[list[int]]:
    """The main blocks of each stage (``layout``: blocks per stage, in order)."""
    blocks, start = [], 0
    for count in layout:
        blocks.append(list(range(start, start + count)))
        start += count
    return blocks


def stage_ids(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: ``pp_rank, pp_rank + pp, …`` (looped)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def _stage_forward(
    self: nn.Module,
    x: torch.Tensor,
    embeddings: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> Any:
    """A stage's forward: tokens (first stage) or the previous stage's hidden state (and,
    with MTP, the token embeddings) in; the next stage's input, or on the last stage what
    the loss takes (logits, or hidden states under the fused loss), out."""
    info = self.pipeline_stage
    record = not info["probe"]  # torch's shape inference records nothing
    if info["first"]:
        h = embeddings = self.tok_embeddings(x)
        shape_of = x
    else:
        h, shape_of = x, x[..., 0]
    freqs_cis, mask = rotations_and_mask(self.freqs_cis, shape_of, positions, document_ids)
    for name in info["blocks"]:
        h = self.layers[name](h, freqs_cis, mask)
    if info["last"]:
        if info["mtp"]:
            self._after_layers(h, embeddings, positions, document_ids)
        out: Any = self.output(self.norm(h)).float()
    else:
        out = (h, embeddings) if info["mtp"] else h
    if not info["moe"]:
        return out
    aux = self.moe_aux_loss()  # this stage's MoE layers (and MTP blocks) of this forward
    if record:
        info["aux"].append(aux.detach().float())
    if self.training and aux.requires_grad:
        if isinstance(out, tuple):
            return AddAuxGrad.apply(out[0], aux), out[1]
        return AddAuxGrad.apply(out, aux)
    return out


def make_stage(model: nn.Module, index: int, layout: list[int]) -> nn.Module:
    """Prune ``model`` (the whole model, on meta) in place into stage ``index`` of ``layout``.

    Args:
        model: A whole model (``tok_embeddings``, ``layers``, ``norm``, ``output``,
            ``freqs_cis``; DeepSeek-V3's MTP blocks after ``n_layers``), unallocated.
        index: The stage.
        layout: Main blocks per stage.

    Raises:
        TypeError: The model lacks a part the stage forward needs.
    """
    missing = [
        name
        for name in ("tok_embeddings", "layers", "norm", "output", "freqs_cis", "args")
        if not hasattr(model, name)
    ]
    if missing:
        raise TypeError(
            f"{type(model).__name__} has no {missing}: pipeline stages need a model shaped "
            "like the built-in ones (docs/ARCHITECTURE.md, Pipeline parallelism); set "
            "parallelism.pipeline_parallel_degree: 1"
        )
    stage = model
    n_main = sum(layout)
    mine = [str(i) for i in stage_blocks(layout)[index]]
    first, last = index == 0, index == len(layout) - 1
    mtp = [name for name in stage.layers if int(name) >= n_main]
    for name in list(stage.layers):
        if name not in mine and not (last and name in mtp):
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    moe = hasattr(stage, "moe_aux_loss") and bool(stage.moe_layers())
    stage.pipeline_stage = {
        "index": index,
        "first": first,
        "last": last,
        "blocks": mine,
        "mtp": bool(mtp),
        "moe": moe,
        "aux": [],
        "probe": False,
    }
    stage.forward = types.MethodType(_stage_forward, stage)  # type: ignore[method-assign]
    return stage


def moe_layer_ids(stage: nn.Module) -> list[int]:
    """The model-wide ids of the stage's MoE blocks, in the order of ``moe_layers()``."""
    return [int(name) for name, block in stage.layers.items() if getattr(block, "moe_enabled", 0)]


def take_aux_values(stage: nn.Module) -> list[torch.Tensor]:
    """The auxiliary-loss values this stage recorded since the last call (one per forward)."""
    values = list(stage.pipeline_stage["aux"])
    stage.pipeline_stage["aux"].clear()
    return values


@contextmanager
def probing(stage: nn.Module) -> Iterator[None]:
    """Run ``stage`` for shapes only: no recorded losses, expert loads restored afterwards."""
    moe = stage.moe_layers() if hasattr(stage, "moe_layers") else []
    loads = [m.tokens_per_expert.clone() for m in moe]
    stage.pipeline_stage["probe"] = True
    try:
        yield
    finally:
        stage.pipeline_stage["probe"] = False
        with torch.no_grad():
            for m, load in zip(moe, loads, strict=True):
                m.tokens_per_expert.copy_(load)


class ProbedStage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves no trace in the step's numbers.

    In its first step torch infers each stage's activation shapes by running the stage
    (and the last stage's loss) forward and backward on stand-in tensors. Those runs would
    count tokens into the expert loads (and so the bias update) and add losses to the
    step's metrics; under :func:`probing` they do neither.
    """

    def _compute_outputs(self, *args: torch.Tensor, module: nn.Module, **kwargs: Any) -> Any:
        with probing(module):
            return module(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with probing(self.submod):
            return super()._backward_metadata_inference(*args, **kwargs)
