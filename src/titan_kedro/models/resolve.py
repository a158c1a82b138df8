"""Resolve raw parameters into a validated job config, its train spec and model args."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from titan_kedro.config.load import ConfigError, build_job_config, format_validation_error
from titan_kedro.config.schema import JobConfig, ModelSection
from titan_kedro.models.registry import get_train_spec, import_custom_model, list_train_specs
from titan_kedro.models.spec import TrainSpec, missing_flops_message

logger = logging.getLogger(__name__)


class ResolvedJob(NamedTuple):
    config: JobConfig
    """The validated config, with the spec's extensions merged in."""
    spec: TrainSpec
    """The ``TrainSpec`` named by ``model.name``."""
    model_args: Any
    """The flavor's args with ``model.overrides`` applied."""


def _drop_other_specs_extensions(raw: Mapping[str, Any], spec: TrainSpec) -> dict[str, Any]:
    """Drop keys that only another registered spec's extension declares, with a warning.

    An environment written for DeepSeek (``parallelism.expert_parallel_degree``) stays
    usable with ``--params model.name=llama3``; keys no spec knows are still rejected.
    """
    own = {(sec, name) for sec, ext in spec.extensions.items() for name in ext.model_fields}
    others: dict[tuple[str, str], list[str]] = {}
    for other in list_train_specs():
        if other != spec.name:
            for sec, ext in get_train_spec(other).extensions.items():
                for name in ext.model_fields:
                    others.setdefault((sec, name), []).append(f"'{other}'")
    cleaned = dict(raw)
    for (sec, name), adders in others.items():
        section = cleaned.get(sec)
        if (sec, name) in own or not isinstance(section, Mapping) or name not in section:
            continue
        if name in JobConfig.model_fields[sec].annotation.model_fields:
            continue
        cleaned[sec] = {k: v for k, v in section.items() if k != name}
        logger.warning(
            "ignoring %s.%s: it is added by model %s, and model '%s' does not use it",
            sec, name, " / ".join(adders), spec.name,
        )  # fmt: skip
    return cleaned


def _copy_model_fields_into_overrides(cfg: JobConfig, spec: TrainSpec) -> None:
    """A spec's own ``model``-section fields set to a value (e.g. DeepSeek-V3's
    ``model.mtp_depth``) are shorthands for ``model.overrides``; copied there, they take
    effect and count as maths settings like any override.

    Raises:
        ValueError: The field and ``model.overrides`` give different values.
    """
    extension = spec.extensions.get("model")
    if extension is None:
        return
    overrides = dict(cfg.model.overrides)
    for name in extension.model_fields:
        value = getattr(cfg.model, name)
        if value is None:
            continue
        if name in overrides and overrides[name] != value:
            raise ValueError(
                f"model.{name}={value!r} and model.overrides.{name}={overrides[name]!r} "
                "disagree; set only one of them"
            )
        overrides[name] = value
    cfg.model.overrides = overrides


def resolve_job_config(raw: Mapping[str, Any], *, source: str = "parameters") -> ResolvedJob:
    """Validate ``raw`` against the base config plus the chosen train spec's extensions.

    Custom model modules are imported first (that runs user code), so their specs and
    extensions take part. Cross-field checks that need the model (sequence length within
    the model's limit, expert-parallel degree dividing the experts, …) run here too, so
    every mistake surfaces before any worker starts.

    Raises:
        ConfigError: With the key path, the value and how to fix it; also for a spec without
            ``flops_per_token`` (every train spec must count its FLOPs).
    """
    # Only the keys that pick the spec: the spec's own model fields are checked with the rest.
    model_raw = dict(raw).get("model") or {}
    if isinstance(model_raw, Mapping):
        model_raw = {k: v for k, v in model_raw.items() if k in ModelSection.model_fields}
    try:
        model_section = ModelSection.model_validate(model_raw)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, JobConfig, source).replace("'", "'model.", 1)
        ) from None
    try:
        import_custom_model(model_section.custom_model_path, model_section.custom_import)
        spec = get_train_spec(model_section.name)
        if spec.flops_per_token is None:  # no fallback: MFU, the plan and the card need it
            raise ValueError(missing_flops_message(spec.name))
    except (ValueError, ImportError, FileNotFoundError) as err:
        raise ConfigError(f"invalid job config ({source}): {err}") from err

    raw = _drop_other_specs_extensions(raw, spec)
    cfg = build_job_config(raw, [spec.extensions], source=source)
    try:
        _copy_model_fields_into_overrides(cfg, spec)
        args = spec.resolve_args(cfg.model.flavor, cfg.model.overrides)
        max_seq_len = getattr(args, "max_seq_len", None)
        if max_seq_len is not None and cfg.training.seq_len > max_seq_len:
            raise ValueError(
                f"training.seq_len={cfg.training.seq_len} exceeds the model's max_seq_len="
                f"{max_seq_len}; lower it or set model.overrides.max_seq_len"
            )
        if spec.validate_config_fn is not None:
            spec.validate_config_fn(cfg, args)
    except ValueError as err:
        raise ConfigError(f"invalid job config ({source}): {err}") from err
    return ResolvedJob(cfg, spec, args)
