"""Parameter counts and the model card, from a model built on meta.

``count_parameters`` only reads shapes, so it works on a model built under
``torch.device("meta")`` (an 8B model costs no memory there). The per-rank memory and
cost of a job are measured on the sharded model by ``titan_kedro.plan``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model."""

    total: int
    """Every distinct parameter (tied weights counted once)."""
    active: int
    """Parameters one token goes through: ``model.active_params()`` for MoE, else ``total``."""
    embedding: int
    """Parameters of the token embedding (``model.tok_embeddings``)."""
    routed_experts: int = 0
    """Parameters of routed experts (submodules named ``experts``); 0 for dense models."""


def routed_expert_params(model: nn.Module) -> int:
    """Parameters held by submodules named ``experts`` (MoE routed experts; not ``shared_experts``)."""
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    return total


def count_parameters(model: nn.Module) -> ParamCounts:
    """Count a model's parameters (works on the meta device).

    Args:
        model: A model following the contract of ``docs/ARCHITECTURE.md``.

    Returns:
        Total, active-per-token and embedding counts; MoE models report ``active`` through
        their ``active_params()`` method.
    """
    total = sum(p.numel() for p in model.parameters())
    embedding_module = getattr(model, "tok_embeddings", None)
    embedding = (
        sum(p.numel() for p in embedding_module.parameters()) if embedding_module is not None else 0
    )
    active = int(model.active_params()) if hasattr(model, "active_params") else total
    return ParamCounts(
        total=total, active=active, embedding=embedding, routed_experts=routed_expert_params(model)
    )


def _json_safe(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def model_card(spec: Any, model_args: Any, job_config: Any) -> dict[str, Any]:
    """Describe the configured model: args, parameter counts and FLOPs per token.

    The model is built on the meta device, so even an 8B or 236B model costs no memory.

    Args:
        spec: The resolved ``TrainSpec``.
        model_args: The flavor's args with the overrides applied.
        job_config: The resolved job config (sequence length, batch, parallelism).

    Returns:
        A JSON-safe dict: ``spec, flavor, overrides, custom_model, args, parameters
        (total, active, embedding, non_embedding, routed_experts), seq_len,
        flops_per_token, extensions`` (the values of the config fields the spec's
        extensions add). The ``model_spec`` node adds ``plan`` (``titan_kedro.plan``).
    """
    with torch.device("meta"):
        model = spec.build_model(model_args)
    counts = count_parameters(model)
    seq_len = job_config.training.seq_len
    flops = spec.training_flops_per_token(model_args, seq_len)
    extensions = {
        section: {
            name: getattr(getattr(job_config, section), name) for name in extension.model_fields
        }
        for section, extension in spec.extensions.items()
    }
    model_cfg = job_config.model
    card = {
        "spec": spec.name,
        "flavor": model_cfg.flavor,
        "overrides": model_cfg.overrides,
        "custom_model": model_cfg.custom_model_path or model_cfg.custom_import,
        "args": model_args,
        "parameters": {
            **dataclasses.asdict(counts),
            "non_embedding": counts.total - counts.embedding,
        },
        "seq_len": seq_len,
        "flops_per_token": flops,
        "extensions": extensions,
    }
    return _json_safe(card)
