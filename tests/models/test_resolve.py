"""resolve_job_config: the chosen spec's extensions, other specs' keys, model checks."""

from __future__ import annotations

import logging

import pytest

from titan_kedro.config import ConfigError
from titan_kedro.models.resolve import resolve_job_config


def test_deepseek_spec_extends_parallelism_with_its_default() -> None:
    resolved = resolve_job_config({"model": {"name": "deepseek_v2"}})
    assert resolved.spec.name == "deepseek_v2"
    assert resolved.config.parallelism.expert_parallel_degree == 1


def test_another_specs_extension_key_is_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = {"model": {"name": "llama3"}, "parallelism": {"expert_parallel_degree": 2}}
    with caplog.at_level(logging.WARNING):
        resolved = resolve_job_config(raw)
    assert not hasattr(resolved.config.parallelism, "expert_parallel_degree")
    assert "added by model 'deepseek_v2'" in caplog.text


def test_keys_no_spec_declares_are_still_rejected() -> None:
    raw = {"model": {"name": "llama3"}, "parallelism": {"expert_paralel_degree": 2}}
    with pytest.raises(ConfigError, match=r"parallelism\.expert_paralel_degree"):
        resolve_job_config(raw)


def test_expert_parallel_degree_must_divide_the_experts() -> None:
    raw = {
        "launch": {"nproc_per_node": 3},
        "parallelism": {"expert_parallel_degree": 3},
    }
    with pytest.raises(ConfigError, match="expert_parallel_degree"):
        resolve_job_config(raw)


def test_unknown_model_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'gpt5'.*deepseek_v2.*llama3"):
        resolve_job_config({"model": {"name": "gpt5"}})
