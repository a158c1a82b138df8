"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: logits, weights and configs."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from hf_model_helpers import YARN_SMALL, assert_logits_match, randomize_hf_deepseek
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from titan_kedro.models import get_train_spec
from titan_kedro.models.deepseek_v3 import FLAVORS

SPEC = get_train_spec("deepseek_v3")
ADAPTER = SPEC.state_dict_adapter

# The published config.json of deepseek-ai/DeepSeek-V3 (architecture fields only).
PUBLISHED_671B = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
}  # fmt: skip


def _tiny_hf_config(**overrides: Any) -> DeepseekV3Config:
    fields: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 128,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attn_implementation": "eager",
    }
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def _random_hf_model(config: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    return randomize_hf_deepseek(DeepseekV3ForCausalLM(config).float().eval())


CASES = {
    "full-q_one-group_yarn": {
        "rope_parameters": {**YARN_SMALL, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "lora-q_group-limited_scaled_2-dense": {
        "q_lora_rank": 24,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 2,
    },
    "lora-q_group-limited_no-norm_yarn-mscale": {
        "q_lora_rank": 24,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "n_shared_experts": 2,
        "rope_parameters": {**YARN_SMALL, "mscale": 0.707, "mscale_all_dim": 0.8},
    },
}


def _ours(config: DeepseekV3Config, hf_model: DeepseekV3ForCausalLM) -> torch.nn.Module:
    model = SPEC.build_model(ADAPTER.args_from_hf_config(config)).eval()
    model.load_state_dict(ADAPTER.from_hf(hf_model.state_dict()))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str) -> None:
    config = _tiny_hf_config(**CASES[case])
    hf_model = _random_hf_model(config)
    model = _ours(config, hf_model)
    assert_logits_match(hf_model, model, config.vocab_size)


def test_the_correction_bias_and_the_groups_change_the_output() -> None:
    """Each routing ingredient the parity test covers really changes the logits."""
    config = _tiny_hf_config(**CASES["lora-q_group-limited_scaled_2-dense"])
    hf_model = _random_hf_model(config)
    tokens = torch.randint(
        0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        reference = _ours(config, hf_model)(tokens)
        unbiased = _ours(config, hf_model)
        for moe in unbiased.moe_layers():
            moe.expert_bias.zero_()
        ungrouped_config = _tiny_hf_config(
            **{**CASES["lora-q_group-limited_scaled_2-dense"], "n_group": 1, "topk_group": 1}
        )
        ungrouped = _ours(ungrouped_config, hf_model)
        assert (unbiased(tokens) - reference).abs().max() > 1e-2
        assert (ungrouped(tokens) - reference).abs().max() > 1e-2


def test_state_dict_round_trip_keeps_the_bias_and_drops_mtp() -> None:
    args = dataclasses.replace(FLAVORS["debugmodel"], vocab_size=128, n_layers=2, mtp_depth=1)
    model = SPEC.build_model(args)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.expert_bias.normal_()
    ours = model.state_dict()
    hf = ADAPTER.to_hf(ours)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    assert not any(key.startswith("model.layers.2.") for key in hf)  # the MTP block
    back = ADAPTER.from_hf(hf)
    assert set(back) == set(ours) - ADAPTER.keys_not_in_hf(ours)
    assert ADAPTER.keys_not_in_hf(ours) == {k for k in ours if k.startswith("layers.2.")}
    for key, value in back.items():
        torch.testing.assert_close(value, ours[key], rtol=0, atol=0)


def test_mtp_layers_of_released_weights_are_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _tiny_hf_config()
    hf_sd = dict(_random_hf_model(config).state_dict())
    # The released checkpoint keeps its MTP module as the layer after the last one.
    hf_sd["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    hf_sd["model.layers.3.shared_head.head.weight"] = torch.zeros(97, 64)
    hf_sd["model.layers.3.self_attn.o_proj.weight"] = torch.zeros(64, 48)
    with caplog.at_level(logging.WARNING):
        ours = ADAPTER.from_hf(hf_sd)
    assert not any(key.startswith("layers.3.") for key in ours)
    assert "multi-token-prediction" in caplog.text


def test_671b_flavor_is_the_published_config() -> None:
    published = ADAPTER.args_from_hf_config(PUBLISHED_671B)
    ours = FLAVORS["671B"]
    differing = {
        f.name: (getattr(ours, f.name), getattr(published, f.name))
        for f in dataclasses.fields(ours)
        if getattr(ours, f.name) != getattr(published, f.name)
    }
    # Training-only settings and MTP (which HF configs describe but transformers never loads).
    assert set(differing) <= {"aux_loss_alpha", "load_balance_bias_update_speed", "mtp_depth"}
    assert ours.mtp_depth == PUBLISHED_671B["num_nextn_predict_layers"]


def test_softmax_routing_is_refused_both_ways() -> None:
    with pytest.raises(ValueError, match="scoring_func"):
        ADAPTER.args_from_hf_config({**PUBLISHED_671B, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match=r"scoring_func.*deepseek_v2"):
        dataclasses.replace(FLAVORS["debugmodel"], scoring_func="softmax")
    v2_args = get_train_spec("deepseek_v2").flavors["debugmodel"]
    with pytest.raises(ValueError, match=r"topk_method.*deepseek_v3"):
        dataclasses.replace(v2_args, topk_method="noaux_tc")
