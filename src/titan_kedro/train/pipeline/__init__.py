"""Pipeline parallelism through ``torch.distributed.pipelining`` (``parallelism.pipeline_*``).

- ``models/pipeline_split.py``: which blocks each stage holds (balanced analytic FLOPs by
  default, or ``parallelism.pipeline_layout``) and the model-aware refusals;
- ``stages.py``: cutting the meta-device model into stage modules and their forward
  (hidden state, plus the token embeddings for MTP), and how auxiliary losses reach the
  gradients;
- ``step.py``: the pipelined optimizer step (``PipelineTrainStep``), which builds the
  schedule (``1F1B`` or ``Interleaved1F1B``) over this rank's ``PipelineStage`` s.

The trainer calls :func:`build_pipeline` instead of ``parallelize_fn`` when
``Layout.pp > 1``; each stage is then parallelized (AC, compile, EP, FSDP over the stage's
data-parallel mesh) exactly as a whole model would be.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_kedro.models.pipeline_split import pipeline_layout
from titan_kedro.models.tensor_parallel import loss_parallel_cross_entropy
from titan_kedro.train.fused_loss import FusedOutputLoss, defer_output_projection, uses_fused_loss
from titan_kedro.train.pipeline.stages import ProbedStage, make_stage, stage_ids
from titan_kedro.train.pipeline.step import PipelineTrainStep

__all__ = ["PipelineTrainStep", "build_model_parts", "build_pipeline", "pipeline_fields"]


def build_model_parts(
    model: nn.Module, spec: Any, model_args: Any, parallel_dims: Any, *, cfg: Any, loss_fn: Any
) -> tuple[list[nn.Module], Any, list[PipelineStage] | None]:
    """The trainer's model parts and loss: the whole parallelized model, or this rank's stages.

    With ``training.fused_loss`` (and the default cross-entropy) the output projection is
    deferred into the loss (``fused_loss.py``), on the last stage under pipelining; under
    tensor parallelism the loss is the loss-parallel cross-entropy instead.

    Returns:
        ``(model_parts, loss_fn, stages)``; ``stages`` is None without pipelining.
    """
    if parallel_dims.pp_enabled:
        return build_pipeline(model, spec, model_args, parallel_dims, cfg=cfg, loss_fn=loss_fn)
    if uses_fused_loss(cfg, spec, model):
        loss_fn = FusedOutputLoss(defer_output_projection(model), compile=cfg.training.compile)
    elif cfg.layout.tp > 1:
        loss_fn = loss_parallel_cross_entropy(loss_fn, cfg)
    return [spec.parallelize_fn(model, parallel_dims, cfg)], loss_fn, None


def build_pipeline(
    model: nn.Module, spec: Any, model_args: Any, parallel_dims: Any, *, cfg: Any, loss_fn: Any
) -> tuple[list[nn.Module], Any, list[PipelineStage]]:
    """This rank's stages of ``model``, parallelized, the loss and the ``PipelineStage`` s.

    Args:
        model: The whole model on the meta device (pruned in place into this rank's last
            stage).
        spec: Its train spec (``parallelize_fn``, ``build_model``).
        model_args: Its args.
        parallel_dims: The built meshes (``pp_rank``, ``pp_mesh``, the stage's FSDP meshes).
        cfg: The job config.
        loss_fn: The spec's loss (replaced by the fused output loss on the last stage when
            the job fuses it).

    Returns:
        ``(model_parts, loss_fn, stages)`` in stage order.
    """
    layout = cfg.layout
    split = pipeline_layout(cfg, model_args, spec)
    unknown = set(cfg.training.activation_checkpoint_blocks or ()) - set(model.layers)
    if cfg.training.activation_checkpoint == "auto" and unknown:
        raise ValueError(
            f"training.activation_checkpoint_blocks names {sorted(unknown)}, which are not "
            f"blocks of {type(model).__name__} (its blocks: {list(model.layers)})"
        )
    ids = stage_ids(parallel_dims.pp_rank, layout.pp, layout.pp_stages_per_rank)
    # The given meta model becomes the last of this rank's stages; the others prune fresh
    # meta builds (nothing is allocated until the shards are).
    wholes = [_meta_build(spec, model_args) for _ in ids[1:]] + [model]
    parts = [make_stage(whole, i, split) for whole, i in zip(wholes, ids, strict=True)]
    last = parts[-1]
    if last.pipeline_stage["last"] and uses_fused_loss(cfg, spec, last):
        loss_fn = FusedOutputLoss(defer_output_projection(last), compile=cfg.training.compile)
    parts = [spec.parallelize_fn(part, parallel_dims, stage_config(cfg, part)) for part in parts]
    for part in parts:
        part.train()
    group = parallel_dims.pp_mesh.get_group()
    stages = [
        ProbedStage(part, i, layout.pp_stages, parallel_dims.device, group=group)
        for part, i in zip(parts, ids, strict=True)
    ]
    return parts, loss_fn, stages


def _meta_build(spec: Any, model_args: Any) -> nn.Module:
    with torch.device("meta"):
        return spec.build_model(model_args)


def stage_config(cfg: Any, stage: nn.Module) -> Any:
    """``cfg`` for parallelizing one stage: activation checkpointing by model-wide block ids.

    ``selective`` recomputes the even blocks of the model (not of the stage) and ``auto``
    the chosen blocks that the stage holds, as they would be without pipelining.
    """
    training = cfg.training
    if training.activation_checkpoint not in ("selective", "auto"):
        return cfg
    chosen = set(training.activation_checkpoint_blocks or ())
    if training.activation_checkpoint == "selective":
        chosen = {name for name in stage.layers if int(name) % 2 == 0}
    stage_cfg = cfg.model_copy(deep=True)
    stage_cfg.training.activation_checkpoint = "auto"
    stage_cfg.training.activation_checkpoint_blocks = [n for n in stage.layers if n in chosen]
    return stage_cfg


def pipeline_fields(stages: list[PipelineStage] | None, parallel_dims: Any) -> dict[str, Any]:
    """``PipelineTrainStep``'s own fields (empty without pipelining)."""
    if not stages:
        return {}
    return {
        "pipeline_stages": stages,
        "pp_group": parallel_dims.pp_mesh.get_group(),
        "holders": parallel_dims.world_size // parallel_dims.pp,
    }
