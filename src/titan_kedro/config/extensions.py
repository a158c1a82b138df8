"""Merge train-spec extensions into the job config.

A train spec may add fields to a section, e.g. DeepSeek-V3 adds
``training.mtp_loss_weight``. Each extension is a pydantic model whose fields
carry their own defaults. We build a new section class that inherits from both the base
section and the extension, so pydantic keeps every field's declared default (an
extension field ``int = 2`` stays 2 when unset — torchtitan's dataclass merge once
reset such fields to the type's zero value), values from YAML/CLI still win, and
``extra="forbid"`` still rejects unknown keys.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, create_model

from titan_kedro.config.schema import JobConfig, Section

Extensions = Mapping[str, type[BaseModel]]
"""Section name → pydantic model holding the extra fields for that section."""


def _merge_section(section_name: str, base: type[Section], exts: list[type[BaseModel]]) -> type:
    clashes = {
        name: ext.__name__ for ext in exts for name in ext.model_fields if name in base.model_fields
    }
    if clashes:
        raise ValueError(
            f"config extension for section '{section_name}' redefines existing fields {clashes}; "
            "an extension may only add new fields"
        )
    seen: dict[str, str] = {}
    for ext in exts:
        for name in ext.model_fields:
            if name in seen:
                raise ValueError(
                    f"config extensions {seen[name]} and {ext.__name__} both add "
                    f"'{section_name}.{name}'"
                )
            seen[name] = ext.__name__
    merged = create_model(  # type: ignore[call-overload]
        f"{base.__name__}With{''.join(e.__name__ for e in exts)}",
        __base__=(base, *exts),
        __module__=base.__module__,
    )
    merged.model_config = ConfigDict(extra="forbid", validate_assignment=True)
    merged.model_rebuild(force=True)
    return merged


def merge_extensions(*extension_sets: Extensions) -> type[JobConfig]:
    """Return a ``JobConfig`` subclass whose sections include every extension's fields.

    Args:
        *extension_sets: One mapping per train spec (or custom module), section name to
            the pydantic model of extra fields.

    Returns:
        ``JobConfig`` itself when there is nothing to merge, else a subclass.

    Raises:
        ValueError: An extension names an unknown section or redefines a field.
    """
    # Cached, so the same extensions always give the same class (configs compare equal).
    return _merge(tuple(item for ext in extension_sets for item in ext.items()))


@functools.cache
def _merge(items: tuple[tuple[str, type[BaseModel]], ...]) -> type[JobConfig]:
    by_section: dict[str, list[type[BaseModel]]] = {}
    for section, ext in items:
        if section not in JobConfig.model_fields:
            raise ValueError(
                f"config extension {ext.__name__} targets unknown section '{section}'; "
                f"sections are {sorted(JobConfig.model_fields)}"
            )
        by_section.setdefault(section, []).append(ext)
    if not by_section:
        return JobConfig

    fields = {}
    for section, exts in by_section.items():
        base = JobConfig.model_fields[section].annotation
        merged = _merge_section(section, base, exts)
        fields[section] = (merged, Field(default_factory=merged))
    return create_model(  # type: ignore[call-overload]
        "ExtendedJobConfig", __base__=JobConfig, __module__=JobConfig.__module__, **fields
    )
