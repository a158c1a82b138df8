"""The base of every job-config section, and one section read from Kedro parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: strict about unknown keys, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SectionT = TypeVar("SectionT", bound=BaseModel)


def section_from_params(model: type[SectionT], params: Mapping[str, Any] | None) -> SectionT:
    """One section from its Kedro parameters, keeping only the base section's own fields.

    Fields that train-spec extensions add were validated already by the project hook.
    """
    known = {k: v for k, v in (params or {}).items() if k in model.model_fields}
    return model.model_validate(known)
