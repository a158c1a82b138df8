"""Build a ``JobConfig`` from Kedro parameters, or from a file plus dotted CLI overrides.

Precedence is command line > file > defaults (and, under Kedro, ``--params`` > ``conf/<env>``
> ``conf/base`` — Kedro's config loader does that layering before we see the dict).
Every error names the full key path, what was given and what was expected.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from titan_kedro.config.extensions import Extensions, merge_extensions
from titan_kedro.config.schema import JobConfig


class ConfigError(ValueError):
    """The job config is invalid; the message says what, where and how to fix it."""


def _model_at(model: type[BaseModel], path: Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model that owns the last key of ``path`` (None if it is not a model)."""
    current: Any = model
    for key in path[:-1]:
        field = current.model_fields.get(key) if isinstance(current, type) else None
        if field is None:
            return None
        current = field.annotation
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _describe(error: Mapping[str, Any], model: type[BaseModel]) -> str:
    loc = [str(p) for p in error["loc"]]
    path = ".".join(loc) or "<root>"
    kind = error["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, error["loc"])
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        prefix = ".".join(loc[:-1])
        hint = (
            f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
            if close
            else f"valid keys here: {', '.join(valid)}"
        )
        return f"unknown key '{path}': {hint}"
    if kind == "value_error" and not loc:
        return error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    return f"'{path}' = {value!r} is invalid: {error['msg']}"


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str) -> str:
    """Turn a pydantic error into one readable line per problem."""
    lines = [_describe(e, model) for e in err.errors()]
    return f"invalid job config ({source}):\n  - " + "\n  - ".join(lines)


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge ``override`` into a copy of ``base`` (override wins per key)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_job_config(
    raw: Mapping[str, Any],
    extensions: Sequence[Extensions] = (),
    *,
    source: str = "parameters",
) -> JobConfig:
    """Validate a nested dict into a (possibly extended) ``JobConfig``.

    Args:
        raw: Sections as nested mappings, e.g. Kedro's ``parameters``.
        extensions: Train-spec extensions to merge into the sections first.
        source: Where ``raw`` came from, quoted in error messages.

    Returns:
        The validated config.

    Raises:
        ConfigError: Unknown keys (with the closest valid key), wrong types, or
            inconsistent values.
    """
    model = merge_extensions(*extensions)
    try:
        return model.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model, source)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON job-config file into a nested dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in {".yaml", ".yml"}:
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file '{path}': use .toml, .yaml/.yml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file '{path}' cannot be parsed: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    return data


def _set_path(target: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = target.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '--{dotted}': '{key}' is not a section")
        target = node
    target[keys[-1]] = value


def parse_cli_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """Parse ``--section.key value`` / ``--section.key=value`` pairs into a nested dict.

    Values are parsed as YAML scalars, so ``20`` is an int, ``true`` a bool, ``[0.9, 0.95]``
    a list; anything else stays a string. A flag with no value means ``true``.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument '{arg}': overrides look like --section.key value"
            )
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            text = argv[i + 1]
            i += 2
        else:
            text = "true"
            i += 1
        key = key.replace("-", "_") if "." not in key else key
        _set_path(out, key, yaml.safe_load(text) if text != "" else "")
    return out


def load_raw_config(config_file: str | Path | None, argv: Sequence[str] = ()) -> dict[str, Any]:
    """File (if any) with command-line overrides on top, as a nested dict."""
    raw = read_config_file(config_file) if config_file else {}
    return deep_merge(raw, parse_cli_overrides(argv))


def dump_job_config(cfg: BaseModel, path: str | Path) -> Path:
    """Write the resolved config as YAML (YAML keeps ``null``; TOML cannot)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested sections to dotted keys (``training.lr``) for logging."""
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
