"""Registry of train specs, resolved by name (``get_train_spec("deepseek_v2")``).

A ``TrainSpec`` bundles everything the trainer needs to know about one model family:
the model class, named flavors (sizes), config extensions, and the functions that
parallelize it, build its optimizers, LR schedulers and loss, map its weights to and
from Hugging Face, and count its FLOPs.

Custom models: ``import_custom_model`` imports a user's ``.py`` file or dotted module,
which calls ``register_train_spec``. That runs the user's code with the project's
permissions — only point it at code you trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
    """``flops_per_token(args, seq_len)`` for training (forward + backward), for MFU."""
    extensions: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    """Job-config section → pydantic model of extra fields this family adds."""
    validate_config_fn: Callable[[Any, Any], None] | None = None
    """``validate_config_fn(job_config, model_args)`` raises ValueError on impossible combos."""

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


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> TrainSpec:
    """Add ``spec`` to the registry; a second spec with the same name is an error."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a train spec named '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_train_spec(name: str) -> None:
    """Remove a spec (tests and re-imports of custom modules)."""
    _REGISTRY.pop(name, None)


def _load_builtin_specs() -> None:
    # Importing the model packages registers their specs.
    import titan_kedro.models.deepseek_v2
    import titan_kedro.models.deepseek_v3
    import titan_kedro.models.llama3  # noqa: F401


def list_train_specs() -> list[str]:
    _load_builtin_specs()
    return sorted(_REGISTRY)


def get_train_spec(name: str) -> TrainSpec:
    """Look a spec up by name; the error lists what is registered."""
    _load_builtin_specs()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model '{name}'; registered train specs: {', '.join(sorted(_REGISTRY))}. "
            "Custom models are loaded with model.custom_model_path or model.custom_import."
        )
    return _REGISTRY[name]


def _forget_specs_added_since(before: set[str]) -> None:
    # A module that registered a spec and then raised is imported afresh next time; its
    # half-done registrations would otherwise turn into a misleading duplicate-name error.
    for name in set(_REGISTRY) - before:
        del _REGISTRY[name]


def import_custom_model(path: str | None = None, module: str | None = None) -> list[str]:
    """Import a user's model module so it can register its train spec.

    Args:
        path: A ``.py`` file.
        module: A dotted module name importable from ``sys.path``.

    Returns:
        The names the import registered (empty if it was already imported).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ImportError: The module raised while importing (the original traceback is shown)
            or registered nothing.
    """
    if not path and not module:
        return []
    _load_builtin_specs()
    before = set(_REGISTRY)
    label = path or module
    if path:
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise FileNotFoundError(
                f"model.custom_model_path '{path}' does not exist (resolved to {file}); "
                "give the path of a .py file that calls register_train_spec"
            )
        # Stable across processes (unlike hash()), so every worker names the module alike.
        digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
        mod_name = f"titan_kedro_custom_{file.stem}_{digest}"
        if mod_name in sys.modules:
            return []
        spec = importlib.util.spec_from_file_location(mod_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"model.custom_model_path '{path}' is not an importable Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as err:
            del sys.modules[mod_name]
            _forget_specs_added_since(before)
            raise ImportError(
                f"importing model.custom_model_path '{path}' failed:\n{traceback.format_exc()}"
            ) from err
    else:
        if module in sys.modules:
            return []
        try:
            importlib.import_module(module)  # type: ignore[arg-type]
        except Exception as err:
            _forget_specs_added_since(before)
            raise ImportError(
                f"importing model.custom_import '{module}' failed:\n{traceback.format_exc()}"
            ) from err
    added = sorted(set(_REGISTRY) - before)
    if not added:
        raise ImportError(
            f"custom model '{label}' was imported but registered no train spec; "
            "call titan_kedro.models.register_train_spec(TrainSpec(...)) at module level"
        )
    return added
