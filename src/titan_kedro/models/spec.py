"""``TrainSpec``: everything the trainer needs to know about one model family.

A spec bundles the model class, named flavors (sizes), config extensions, and the
functions that parallelize the model, build its optimizers, LR schedulers and loss, map
its weights to and from Hugging Face, and count its FLOPs.

Both the registry (``models/registry.py``) and the built-in model packages import this
module; it imports neither, so a model package never needs the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from torch import nn

from titan_kedro.components.loss import build_cross_entropy_loss
from titan_kedro.components.lr_schedulers import build_lr_schedulers
from titan_kedro.components.optimizers import build_optimizers
from titan_kedro.models.parallel import parallelize_dense


class StateDictAdapter(Protocol):
    """Maps weights and configs between Hugging Face transformers and our model."""

    def args_from_hf_config(self, config: Any) -> Any: ...

    def hf_config_from_args(self, args: Any) -> Any: ...

    def from_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]: ...

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class TrainSpec:
    """Everything the trainer needs to train one model family."""

    name: str
    """Registry key, e.g. ``deepseek_v2``."""
    model_cls: type[nn.Module]
    """Model class; ``model_cls(args)`` builds it and ``model(tokens)`` returns logits."""
    flavors: Mapping[str, Any]
    """Flavor name → model-args dataclass instance."""
    parallelize_fn: Callable[..., nn.Module] = parallelize_dense
    """``parallelize_fn(model, parallel_dims, job_config)`` applies AC, compile, EP, FSDP2.

    The default suits a dense model (no expert parallelism)."""
    build_optimizers_fn: Callable[..., Any] = build_optimizers
    """``build_optimizers_fn(model_parts, job_config)`` → OptimizersContainer (AdamW per part)."""
    build_lr_schedulers_fn: Callable[..., Any] = build_lr_schedulers
    """``build_lr_schedulers_fn(optimizers, job_config)`` → LRSchedulersContainer."""
    build_loss_fn: Callable[..., Callable[..., Any]] = build_cross_entropy_loss
    """``build_loss_fn(job_config)`` → ``loss(logits, labels)``; the default is token-level
    cross-entropy, which the trainer replaces with its fused output-projection loss."""
    state_dict_adapter: StateDictAdapter | None = None
    """Hugging Face ↔ ours; None if the family has no HF counterpart."""
    flops_per_token: Callable[[Any, int], float] | None = None
    """``flops_per_token(args, seq_len)``: training FLOPs per token (forward + backward), the
    one count the trainer's TFLOP/s and MFU, the plan's cost and the model card read
    (through ``training_flops_per_token``). Required: ``resolve_job_config`` refuses a spec
    without it (``missing_flops_message``); None only lets a spec be built and registered."""
    expert_parallel: bool = False
    """Whether ``parallelize_fn`` shards routed experts over the mesh's ``ep`` dimension;
    without it ``parallelism.expert_parallel_degree`` > 1 is reset to 1 with a warning."""
    extensions: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    """Job-config section → pydantic model of extra fields this family adds."""
    validate_config_fn: Callable[[Any, Any], None] | None = None
    """``validate_config_fn(job_config, model_args)`` raises ValueError on impossible combos."""
    tensor_parallel_widths: Callable[[Any], Mapping[str, int]] | None = None
    """``tensor_parallel_widths(model_args)``: each width tensor parallelism splits (heads,
    MLP hidden widths, vocabulary), by the name a message shows; ``parallelize_fn`` then
    applies TP over the mesh's ``tp`` dimension. None: no TP plan, and
    ``parallelism.tensor_parallel_degree`` > 1 is refused (``models/tensor_parallel``)."""

    def training_flops_per_token(self, args: Any, seq_len: int) -> float:
        """The spec's ``flops_per_token(args, seq_len)`` as a float; what every reader calls.

        Raises:
            ValueError: The spec has none (``missing_flops_message``).
        """
        if self.flops_per_token is None:
            raise ValueError(missing_flops_message(self.name))
        return float(self.flops_per_token(args, seq_len))

    def build_model(self, args: Any) -> nn.Module:
        """Instantiate the model for ``args`` (call under ``torch.device('meta')`` to size it)."""
        return self.model_cls(args)

    def resolve_args(self, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """Flavor args with ``overrides`` applied; unknown flavors or fields fail clearly."""
        if flavor not in self.flavors:
            raise ValueError(
                f"model '{self.name}' has no flavor '{flavor}'; flavors: {sorted(self.flavors)}"
            )
        args = self.flavors[flavor]
        overrides = dict(overrides or {})
        if not overrides:
            return args
        known = {f.name for f in dataclasses.fields(args)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            import difflib

            hints = [
                f"'{k}'"
                + (
                    f" (did you mean '{m[0]}'?)"
                    if (m := difflib.get_close_matches(k, known, 1))
                    else ""
                )
                for k in unknown
            ]
            raise ValueError(
                f"model.overrides: {', '.join(hints)} not a field of {type(args).__name__} "
                f"for model '{self.name}'"
            )
        try:
            return dataclasses.replace(args, **overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"model.overrides for '{self.name}' are invalid: {err}") from err


def missing_flops_message(name: str) -> str:
    """What to do about a spec without ``flops_per_token`` (the resolution refuses it)."""
    return (
        f"train spec '{name}' has no flops_per_token: give its TrainSpec "
        "flops_per_token=fn, where fn(model_args, seq_len) returns the training FLOPs per "
        "token (forward + backward), e.g. 6 × the non-embedding matmul parameters a token "
        "uses + 12 × n_layers × n_heads × head_dim × seq_len for attention's q·kᵀ and "
        "scores·v (examples/custom_model/tiny_gpt.py); MFU, the plan's cost and the model "
        "card read it"
    )
