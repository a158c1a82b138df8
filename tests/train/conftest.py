"""Fixtures for training tests: the tiny dense train spec and small job configs."""

from __future__ import annotations

from typing import Any

import pytest

from titan_kedro.config import JobConfig, build_job_config
from titan_kedro.models.registry import get_train_spec, import_custom_model
from train.helpers import TINY_MODEL


@pytest.fixture
def tiny_spec() -> Any:
    """The ``tiny_dense`` TrainSpec, imported through ``import_custom_model`` like a user model."""
    import_custom_model(path=str(TINY_MODEL))
    return get_train_spec("tiny_dense")


def make_config(**sections: dict[str, Any]) -> JobConfig:
    """A ``JobConfig`` with the given sections (nested dicts) over the defaults."""
    return build_job_config(sections, source="test")
