"""One AdamW per model part, wrapped in a single ``torch.optim.Optimizer``.

The container behaves like one optimizer to the training loop (``step``, ``zero_grad``,
``param_groups``) and like one ``Stateful`` to distributed checkpointing: its state dict
is the flattened, FQN-keyed optimizer state of every part (``get_optimizer_state_dict``),
so it loads under any sharding layout.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _no_decay_param_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters exempt from weight decay: norms, biases and embeddings."""
    exempt: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding) or param.ndim < 2:
                exempt.add(id(param))
    return exempt


def param_groups_for(
    model: nn.Module, weight_decay: float, *, no_decay_norm_bias_embed: bool
) -> list[dict[str, Any]]:
    """Split a model's trainable parameters into a decayed and an undecayed group.

    Args:
        model: One model part.
        weight_decay: Decoupled weight decay of the decayed group.
        no_decay_norm_bias_embed: Put norms, biases (any parameter with fewer than two
            dimensions) and embedding tables in a group without weight decay.

    Returns:
        Non-empty parameter groups, split further by kind of tensor (plain, or DTensor on
        each device mesh); parameters with ``requires_grad=False`` are left out.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not no_decay_norm_bias_embed:
        return _split_by_kind(trainable, weight_decay)
    exempt = _no_decay_param_ids(model)
    decay = [p for p in trainable if id(p) not in exempt]
    no_decay = [p for p in trainable if id(p) in exempt]
    return _split_by_kind(decay, weight_decay) + _split_by_kind(no_decay, 0.0)


def _split_by_kind(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """One group per kind of tensor: plain tensors, and DTensors per device mesh.

    A fused or foreach AdamW steps a group in one multi-tensor kernel, which refuses plain
    tensors mixed with DTensors (tensor parallelism without FSDP leaves the parameters it
    does not split, and expert-parallel experts, plain).
    """
    kinds: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        kinds.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(
            param
        )
    return [{"params": group, "weight_decay": weight_decay} for group in kinds.values()]


class OptimizersContainer(torch.optim.Optimizer, Stateful):
    """One optimizer per model part, stepped, zeroed and checkpointed together.

    ``param_groups`` is the concatenation of the parts' groups (the same dicts), so
    reading or setting a group's ``lr`` here acts on the real optimizers. Loading a state
    dict gives each optimizer new group dicts, so ``load_state_dict`` takes them again.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        if len(model_parts) != len(optimizers):
            raise ValueError(
                f"{len(model_parts)} model parts but {len(optimizers)} optimizers; "
                "give one optimizer per model part"
            )
        self.model_parts = model_parts
        self.optimizers = optimizers
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, dict(optimizers[0].defaults))
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step every part's optimizer."""
        for opt in self.optimizers:
            opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every part's gradients."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Flattened, FQN-keyed state of every part (works for DTensor/FSDP2 params)."""
        merged: dict[str, Any] = {}
        for model, opt in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(model, opt, options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state written by ``state_dict`` into every part's optimizer."""
        for model, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, opt, optim_state_dict=state_dict, options=_FLAT)
        # torch.optim.Optimizer.load_state_dict replaced the group dicts: the old ones would
        # keep the lr of the checkpoint while the schedulers move the new ones.
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]


def build_optimizers(model_parts: Iterable[nn.Module], cfg: Any) -> OptimizersContainer:
    """Build AdamW for each model part from the ``optimizer`` config section.

    Args:
        model_parts: The model (or its pipeline stages), already parallelized.
        cfg: The job config (reads ``cfg.optimizer``).

    Returns:
        An ``OptimizersContainer`` over the trainable parameters.

    Raises:
        ValueError: The optimizer is unknown or a model part has nothing to train.
    """
    section = cfg.optimizer
    if section.name != "AdamW":
        raise ValueError(f"optimizer.name={section.name!r} is not supported; use 'AdamW'")
    parts = list(model_parts)
    impl = getattr(section, "implementation", "fused")
    make = functools.partial(
        torch.optim.AdamW,
        lr=section.lr,
        betas=tuple(section.betas),
        eps=section.eps,
        weight_decay=section.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    optimizers = []
    for index, model in enumerate(parts):
        groups = param_groups_for(
            model, section.weight_decay, no_decay_norm_bias_embed=section.no_decay_norm_bias_embed
        )
        if not groups:
            raise ValueError(
                f"model part {index} ({type(model).__name__}) has no parameter with "
                "requires_grad=True; nothing to optimize"
            )
        optimizers.append(make(groups))
    return OptimizersContainer(parts, optimizers)
