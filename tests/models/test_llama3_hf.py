"""Llama 3 ↔ transformers' LlamaForCausalLM: configs, weight names and logit parity."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan_kedro.models import get_train_spec
from titan_kedro.models.common import Llama3RopeScaling

SPEC = get_train_spec("llama3")
ADAPTER = SPEC.state_dict_adapter

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS = {
    "gqa-llama3-rope-untied": {"num_key_value_heads": 2, "rope_parameters": LLAMA3_ROPE},
    "mha-plain-rope-tied": {
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
    "gqa-wide-heads": {"num_key_value_heads": 1, "head_dim": 32, "rope_parameters": LLAMA3_ROPE},
}


def hf_model(**overrides: Any) -> LlamaForCausalLM:
    """A small random fp32 LlamaForCausalLM with eager attention."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm gains, so a swapped norm mapping shows up
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_logits_match_transformers_after_from_hf(overrides: dict[str, Any]) -> None:
    hf = hf_model(**overrides)
    args = ADAPTER.args_from_hf_config(hf.config)
    ours = SPEC.build_model(args).eval()
    ours.load_state_dict(ADAPTER.from_hf(hf.state_dict()))
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape == (2, 100, 256)
    assert (got - expected).abs().max().item() <= 1e-4


def test_to_hf_round_trip_into_a_fresh_llama_for_causal_lm() -> None:
    torch.manual_seed(0)
    args = SPEC.resolve_args("debugmodel", {"vocab_size": 300, "n_layers": 2, "max_seq_len": 64})
    ours = SPEC.build_model(args).eval()
    config = ADAPTER.hf_config_from_args(args)
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(ADAPTER.to_hf(ours.state_dict()), strict=True)
    assert not missing and not unexpected
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4
    back = ADAPTER.from_hf(ADAPTER.to_hf(ours.state_dict()))
    assert back.keys() == ours.state_dict().keys()


def test_config_round_trip_keeps_every_field() -> None:
    for flavor in ("debugmodel", "8B"):
        args = SPEC.flavors[flavor]
        config = ADAPTER.hf_config_from_args(args, bos_token_id=0, eos_token_id=1)
        assert config.tie_word_embeddings is False
        assert config.eos_token_id == 1
        assert ADAPTER.args_from_hf_config(config) == args
    config = ADAPTER.hf_config_from_args(SPEC.flavors["8B"])
    assert (config.hidden_size, config.intermediate_size, config.num_key_value_heads) == (
        4096,
        14336,
        8,
    )
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_args_from_hf_config_reads_rope_and_heads() -> None:
    args = ADAPTER.args_from_hf_config(hf_model(**CONFIGS["gqa-wide-heads"]).config)
    assert (args.n_heads, args.kv_heads, args.head_size, args.dim) == (4, 1, 32, 64)
    assert args.rope_scaling == Llama3RopeScaling(original_max_position_embeddings=32)
    plain = ADAPTER.args_from_hf_config(hf_model(**CONFIGS["mha-plain-rope-tied"]).config)
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type='linear'",
        ),
    ],
)
def test_unsupported_hf_configs_fail_clearly(overrides: dict[str, Any], message: str) -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, **overrides)
    with pytest.raises(ValueError, match=f"not supported.*{message}"):
        ADAPTER.args_from_hf_config(config)


def test_unknown_keys_fail_in_both_directions() -> None:
    with pytest.raises(KeyError, match=re.escape("model.layers.0.self_attn.q_proj.bias")):
        ADAPTER.from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})
    with pytest.raises(KeyError, match=re.escape("layers.0.attention.wq.bias")):
        ADAPTER.to_hf({"layers.0.attention.wq.bias": torch.zeros(1)})
