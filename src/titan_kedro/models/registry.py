"""Registry of train specs, resolved by name (``get_train_spec("deepseek_v2")``).

Built-in families are listed in ``BUILTIN_SPECS`` (name → ``"module:attribute"``) and
imported on their first lookup, so the registry imports no model package at module level
and no model package imports the registry: both sides import ``models/spec.py``.

Custom models: ``import_custom_model`` imports a user's ``.py`` file or dotted module,
which calls ``register_train_spec``. That runs the user's code with the project's
permissions — only point it at code you trust.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from titan_kedro.models.spec import TrainSpec

BUILTIN_SPECS: Mapping[str, str] = {
    "deepseek_v2": "titan_kedro.models.deepseek_v2:DEEPSEEK_V2_SPEC",
    "deepseek_v3": "titan_kedro.models.deepseek_v3:DEEPSEEK_V3_SPEC",
    "llama3": "titan_kedro.models.llama3:LLAMA3_SPEC",
}
"""Built-in model name → ``"module:attribute"`` of its ``TrainSpec``; one line per family."""

_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> TrainSpec:
    """Add ``spec`` to the registry; a second spec with the same name is an error.

    Built-in names are taken even before their first lookup.
    """
    if spec.name in _REGISTRY or spec.name in BUILTIN_SPECS:
        raise ValueError(f"a train spec named '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_train_spec(name: str) -> None:
    """Remove a spec (tests and re-imports of custom modules)."""
    _REGISTRY.pop(name, None)


def _load_builtin_spec(name: str) -> TrainSpec:
    module_name, attribute = BUILTIN_SPECS[name].split(":")
    spec = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(spec, TrainSpec) or spec.name != name:
        raise TypeError(
            f"BUILTIN_SPECS['{name}'] = '{BUILTIN_SPECS[name]}' is not a TrainSpec named '{name}'"
        )
    return spec


def list_train_specs() -> list[str]:
    """Every spec name: the built-ins (imported or not) and those registered."""
    return sorted(set(_REGISTRY) | set(BUILTIN_SPECS))


def get_train_spec(name: str) -> TrainSpec:
    """Look a spec up by name (a built-in is imported now); the error lists the names."""
    if name not in _REGISTRY and name in BUILTIN_SPECS:
        _REGISTRY[name] = _load_builtin_spec(name)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model '{name}'; registered train specs: {', '.join(list_train_specs())}. "
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
