"""Resolve raw parameters into a validated job config, its train spec and model args."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from titan_kedro.config.load import ConfigError, build_job_config, format_validation_error
from titan_kedro.config.schema import JobConfig, ModelSection
from titan_kedro.models.pipeline_split import check_pipeline_model
from titan_kedro.models.registry import get_train_spec, import_custom_model, list_train_specs
from titan_kedro.models.spec import TrainSpec, missing_flops_message
from titan_kedro.models.tensor_parallel import check_tensor_parallel

logger = logging.getLogger(__name__)


class ResolvedJob(NamedTuple):
    config: JobConfig
    """The validated config, with the spec's extensions merged in."""
    spec: TrainSpec
    """The ``TrainSpec`` named by ``model.name``."""
    model_args: Any
    """The flavor's args with ``model.overrides`` applied."""


def _refuse_other_specs_keys(raw: Mapping[str, Any], spec: TrainSpec, source: str) -> None:
    """Refuse keys that only another registered spec's extension declares.

    Such a key would do nothing for ``spec``; dropping it silently hid mistakes. Keys no
    spec knows are left to the validation, which names them with a did-you-mean.

    Raises:
        ConfigError: Naming each key, the spec(s) that add it and the two ways out.
    """
    own = {(sec, name) for sec, ext in spec.extensions.items() for name in ext.model_fields}
    adders: dict[tuple[str, str], list[str]] = {}
    for other in list_train_specs():
        if other != spec.name:
            for sec, ext in get_train_spec(other).extensions.items():
                for name in ext.model_fields:
                    adders.setdefault((sec, name), []).append(f"'{other}'")
    found = [
        f"{sec}.{name} is added by model {' / '.join(by)}"
        for (sec, name), by in sorted(adders.items())
        if (sec, name) not in own
        and isinstance(raw.get(sec), Mapping)
        and name in raw[sec]
        and name not in JobConfig.model_fields[sec].annotation.model_fields
    ]
    if found:
        raise ConfigError(
            f"invalid job config ({source}): {'; '.join(found)}, and model '{spec.name}' does not use "
            "it: remove the key, or set model.name to the model that adds it"
        )


def _without_expert_parallel(raw: Mapping[str, Any], spec: TrainSpec) -> Mapping[str, Any]:
    """``raw`` with ``parallelism.expert_parallel_degree`` 1 when ``spec`` has no experts.

    An environment written for DeepSeek (``conf/base`` sets 2) stays usable with
    ``--params model.name=llama3``: the degree is reset, with a warning naming it.
    """
    section = raw.get("parallelism")
    if spec.expert_parallel or not isinstance(section, Mapping):
        return raw
    ep = section.get("expert_parallel_degree", 1)
    if ep == 1:
        return raw
    logger.warning(
        "parallelism.expert_parallel_degree=%s is ignored: model '%s' has no expert "
        "parallelism (its TrainSpec's expert_parallel is False); training with 1",
        ep, spec.name,
    )  # fmt: skip
    return {**raw, "parallelism": {**section, "expert_parallel_degree": 1}}


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

    One process resolves each parameter set once: the hooks and nodes of a ``kedro run``
    share a resolution through a small cache keyed by the canonical JSON of ``raw`` (and
    the spec it names). Each call returns its own copy of the config, so a caller that
    changes it (the training node applies the plan's choices) changes no one else's.

    Raises:
        ConfigError: With the key path, the value and how to fix it; also for a spec without
            ``flops_per_token`` (every train spec must count its FLOPs), or a key that only
            another spec declares.
    """
    spec = _spec_of(raw, source)
    key = _cache_key(raw)
    hit = _CACHE.get(key) if key is not None else None
    if hit is None or hit.spec is not spec:
        hit = _resolve(raw, spec, source)
        if key is not None:
            _CACHE[key] = hit
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    elif key is not None:
        _CACHE.move_to_end(key)
    return ResolvedJob(hit.config.model_copy(deep=True), hit.spec, hit.model_args)


_CACHE_SIZE = 8
_CACHE: OrderedDict[str, ResolvedJob] = OrderedDict()
"""Canonical JSON of the raw parameters → their resolution (most recent last)."""


def _cache_key(raw: Mapping[str, Any]) -> str | None:
    """The canonical JSON of ``raw``; None when a value has no JSON form (no caching)."""
    try:
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _spec_of(raw: Mapping[str, Any], source: str) -> TrainSpec:
    """The train spec ``raw`` names, after importing a custom model module if configured.

    Raises:
        ConfigError: A bad ``model`` section, an unknown spec, or a spec without FLOPs.
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
    return spec


def _resolve(raw: Mapping[str, Any], spec: TrainSpec, source: str) -> ResolvedJob:
    """The uncached resolution of ``raw`` for ``spec`` (see :func:`resolve_job_config`)."""
    _refuse_other_specs_keys(raw, spec, source)
    raw = _without_expert_parallel(raw, spec)
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
        check_tensor_parallel(cfg, spec, args)
        check_pipeline_model(cfg, args)
    except ValueError as err:
        raise ConfigError(f"invalid job config ({source}): {err}") from err
    return ResolvedJob(cfg, spec, args)
