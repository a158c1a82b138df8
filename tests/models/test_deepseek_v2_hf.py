"""DeepSeek-V2 against transformers' DeepseekV2ForCausalLM: logits, weights and configs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hf_model_helpers import YARN_SMALL, assert_logits_match, randomize_hf_deepseek
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from titan_kedro.models import get_train_spec
from titan_kedro.models.deepseek_v2 import FLAVORS

SPEC = get_train_spec("deepseek_v2")
ADAPTER = SPEC.state_dict_adapter

# The published config.json files (hub ids deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V2),
# architecture fields only.
_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
PUBLISHED = {
    "v2-lite": {
        "vocab_size": 102400, "hidden_size": 2048, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True,
        "rope_theta": 10000, "rope_scaling": _YARN, "tie_word_embeddings": False,
        "scoring_func": "softmax",
    },
    "v2": {
        "vocab_size": 102400, "hidden_size": 5120, "num_hidden_layers": 60,
        "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 160,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
        "norm_topk_prob": False, "routed_scaling_factor": 16.0, "aux_loss_alpha": 0.001,
        "seq_aux": True, "rope_theta": 10000, "rope_scaling": _YARN,
        "tie_word_embeddings": False, "scoring_func": "softmax",
    },
}  # fmt: skip


def _tiny_hf_config(**overrides: Any) -> DeepseekV2Config:
    fields: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 128,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attn_implementation": "eager",
    }
    fields.update(overrides)
    return DeepseekV2Config(**fields)


def _random_hf_model(config: DeepseekV2Config) -> DeepseekV2ForCausalLM:
    torch.manual_seed(0)
    return randomize_hf_deepseek(DeepseekV2ForCausalLM(config).float().eval())


CASES = {
    "full-q_greedy": {},
    "lora-q_group-limited_scaled_2-dense_yarn": {
        "q_lora_rank": 24,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 2,
        "rope_parameters": {**YARN_SMALL, "mscale": 1.0, "mscale_all_dim": 0.8},
    },
    "lora-q_norm-topk_yarn-deepseek-mscale": {
        "q_lora_rank": 24,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "n_shared_experts": 1,
        "rope_parameters": {**YARN_SMALL, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}


def _normalize_hf_gates(model: DeepseekV2ForCausalLM, scaling: float) -> None:
    # transformers 5 ignores norm_topk_prob; DeepSeek's reference router renormalizes the
    # top-k weights. Emulate that (normalize, then scale) on the HF routers.
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        original = gate.forward

        def forward(hidden: torch.Tensor, _original: Any = original) -> Any:
            logits, weights, indices = _original(hidden)
            return logits, weights / weights.sum(-1, keepdim=True) * scaling, indices

        gate.forward = forward


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str) -> None:
    config = _tiny_hf_config(**CASES[case])
    hf_model = _random_hf_model(config)
    if config.norm_topk_prob:
        _normalize_hf_gates(hf_model, config.routed_scaling_factor)
    args = ADAPTER.args_from_hf_config(config)
    model = SPEC.build_model(args).eval()
    model.load_state_dict(ADAPTER.from_hf(hf_model.state_dict()))

    assert_logits_match(hf_model, model, config.vocab_size)


def test_group_limited_routing_changes_the_output() -> None:
    # Guard against a parity test that passes because routing never mattered.
    config = _tiny_hf_config(**CASES["lora-q_group-limited_scaled_2-dense_yarn"])
    hf_model = _random_hf_model(config)
    greedy_args = dataclasses.replace(ADAPTER.args_from_hf_config(config), topk_method="greedy")
    model = SPEC.build_model(greedy_args).eval()
    model.load_state_dict(ADAPTER.from_hf(hf_model.state_dict()))
    tokens = torch.randint(
        0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        assert (model(tokens) - hf_model(tokens).logits).abs().max().item() > 1e-3


def test_state_dict_round_trip_and_per_expert_checkpoint_layout() -> None:
    hf_model = _random_hf_model(_tiny_hf_config(q_lora_rank=24))
    hf_sd = hf_model.state_dict()
    ours = ADAPTER.from_hf(hf_sd)
    back = ADAPTER.to_hf(ours)
    assert back.keys() == hf_sd.keys()
    for key, value in hf_sd.items():
        assert torch.equal(back[key], value), key

    # Hub checkpoint files store one tensor per routed expert.
    per_expert = {k: v for k, v in hf_sd.items() if ".mlp.experts." not in k}
    for key, value in hf_sd.items():
        prefix = key.rsplit("mlp.experts.", 1)[0]
        if key.endswith("gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                per_expert[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                per_expert[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif key.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                per_expert[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
    from_files = ADAPTER.from_hf(per_expert)
    assert from_files.keys() == ours.keys()
    assert all(torch.equal(from_files[k], ours[k]) for k in ours)


def test_unknown_keys_and_unsupported_configs_fail_clearly() -> None:
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.rotary"):
        ADAPTER.from_hf({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"layers\.0\.attention\.extra"):
        ADAPTER.to_hf({"layers.0.attention.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="attention_bias"):
        ADAPTER.args_from_hf_config({**PUBLISHED["v2"], "attention_bias": True})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ADAPTER.args_from_hf_config({**PUBLISHED["v2"], "num_key_value_heads": 8})


@pytest.mark.parametrize("flavor", ["v2-lite", "v2"])
def test_flavors_are_the_published_configs(flavor: str) -> None:
    from_published = ADAPTER.args_from_hf_config(PUBLISHED[flavor])
    # Fields the HF config has no notion of keep the flavor's values.
    assert from_published == dataclasses.replace(
        FLAVORS[flavor], load_balance_bias_update_speed=0.0, use_grouped_mm=True
    )
    # And back: our args → DeepseekV2Config → args is lossless.
    hf_config = ADAPTER.hf_config_from_args(FLAVORS[flavor])
    assert isinstance(hf_config, DeepseekV2Config)
    assert ADAPTER.args_from_hf_config(hf_config) == FLAVORS[flavor]
    assert hf_config.rope_parameters["rope_type"] == "yarn"
    assert hf_config.num_experts_per_tok == 6


def test_expert_bias_is_dropped_on_export_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    args = ADAPTER.args_from_hf_config(_tiny_hf_config())
    model = SPEC.build_model(dataclasses.replace(args, load_balance_bias_update_speed=0.1))
    model.update_expert_bias(torch.tensor([[5.0, 0, 0, 0, 0, 0, 0, 3.0]] * 2))
    with caplog.at_level("WARNING"):
        hf_sd = ADAPTER.to_hf(model.state_dict())
    assert not any("expert_bias" in k for k in hf_sd)
    assert "expert bias is not zero" in caplog.text
    DeepseekV2ForCausalLM(ADAPTER.hf_config_from_args(args)).load_state_dict(hf_sd, strict=True)
