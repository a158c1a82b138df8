"""resolve_job_config: the chosen spec's extensions, other specs' keys, model checks."""

from __future__ import annotations

import logging

import pytest

from titan_kedro.config import ConfigError
from titan_kedro.models.resolve import resolve_job_config


def test_expert_parallel_degree_defaults_to_one_for_every_spec() -> None:
    for name in ("deepseek_v2", "llama3"):
        resolved = resolve_job_config({"model": {"name": name}})
        assert resolved.config.parallelism.expert_parallel_degree == 1
        assert resolved.config.layout.ep == 1


def test_a_dense_model_trains_without_expert_parallelism_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One rank: a degree of 2 could not even divide the shard degree, were it kept.
    raw = {"model": {"name": "llama3"}, "parallelism": {"expert_parallel_degree": 2}}
    with caplog.at_level(logging.WARNING):
        resolved = resolve_job_config(raw)
    assert resolved.config.parallelism.expert_parallel_degree == 1
    assert resolved.config.layout.ep == 1
    assert "parallelism.expert_parallel_degree=2 is ignored: model 'llama3'" in caplog.text


def test_another_specs_extension_key_is_refused_naming_the_spec() -> None:
    raw = {"model": {"name": "deepseek_v2"}, "training": {"mtp_loss_weight": 0.1}}
    with pytest.raises(
        ConfigError,
        match=r"training\.mtp_loss_weight is added by model 'deepseek_v3', and model "
        r"'deepseek_v2' does not use it",
    ):
        resolve_job_config(raw)


def test_a_misspelt_key_is_refused_with_a_did_you_mean() -> None:
    raw = {"model": {"name": "llama3"}, "parallelism": {"expert_paralel_degree": 2}}
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'parallelism\.expert_paralel_degree': did you mean "
        r"'parallelism\.expert_parallel_degree'",
    ):
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
