"""Shared layers agree with the transformers reference implementations."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    apply_rotary_emb as hf_deepseek_rotary,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama_rotary

from titan_kedro.models.common import (
    FeedForward,
    Llama3RopeScaling,
    RMSNorm,
    YarnRopeScaling,
    apply_rotary_emb,
    apply_rotary_emb_half,
    precompute_freqs_cis,
    yarn_get_mscale,
)


def test_rmsnorm_matches_transformers() -> None:
    torch.manual_seed(0)
    ours, ref = RMSNorm(16, eps=1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(2, 3, 16) * 3
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    ours.reset_parameters()
    assert torch.equal(ours.weight, torch.ones(16))


def test_feedforward_is_swiglu() -> None:
    torch.manual_seed(0)
    ffn = FeedForward(8, 24)
    x = torch.randn(5, 8)
    expected = (
        torch.nn.functional.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)
    ) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), expected)
    ffn.init_weights(init_std=0.001)
    assert ffn.w2.weight.std() < 0.002 < ffn.w1.weight.std()


def test_plain_and_llama3_frequencies_match_transformers() -> None:
    plain = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    ours = precompute_freqs_cis(128, 10, theta=plain.rope_parameters["rope_theta"])
    torch.testing.assert_close(
        ours.angle()[3], torch.remainder(3 * inv_freq + math.pi, 2 * math.pi) - math.pi
    )

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    ref_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    freqs = precompute_freqs_cis(128, 2, theta=500000.0, scaling=Llama3RopeScaling())
    torch.testing.assert_close(freqs[1].angle(), ref_inv_freq, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ref_inv_freq, inv_freq)  # the scaling did something


@pytest.mark.parametrize("mscale_all_dim", [0.707, 0.0])
def test_yarn_frequencies_and_factor_match_transformers(mscale_all_dim: float) -> None:
    params = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": mscale_all_dim,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    cfg = DeepseekV2Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=params,
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    scaling = YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
        mscale_all_dim=mscale_all_dim,
    )
    freqs = precompute_freqs_cis(64, 2, theta=10000.0, scaling=scaling)
    torch.testing.assert_close(freqs[1].angle(), ref_inv_freq)
    torch.testing.assert_close(freqs.abs(), torch.full_like(freqs.abs(), ref_factor))
    expected_multiplier = yarn_get_mscale(40.0, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    assert scaling.softmax_scale_multiplier() == pytest.approx(expected_multiplier)
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40) + 1)
    assert yarn_get_mscale(1.0, 0.707) == 1.0


def test_interleaved_rotation_matches_transformers_deepseek() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    freqs = precompute_freqs_cis(8, 7)
    # transformers' DeepSeek-V2 takes [batch, heads, seq, dim] and per-batch freqs.
    ref_q, ref_k = hf_deepseek_rotary(
        q.transpose(1, 2), k.transpose(1, 2), freqs[:5].expand(2, 5, 4)
    )
    torch.testing.assert_close(apply_rotary_emb(q, freqs), ref_q.transpose(1, 2))
    torch.testing.assert_close(apply_rotary_emb(k, freqs), ref_k.transpose(1, 2))


def test_half_rotation_matches_transformers_llama() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8)
    freqs = precompute_freqs_cis(8, 5)
    angles = torch.cat([freqs.angle(), freqs.angle()], dim=-1)[None]  # [1, seq, dim]
    ref_q, _ = hf_llama_rotary(q.transpose(1, 2), q.transpose(1, 2), angles.cos(), angles.sin())
    torch.testing.assert_close(apply_rotary_emb_half(q, freqs), ref_q.transpose(1, 2))
    # Position 0 is the identity; the norm of each pair is kept.
    torch.testing.assert_close(apply_rotary_emb_half(q, freqs)[:, 0], q[:, 0])


def test_rotation_longer_than_precomputed_fails_clearly() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        apply_rotary_emb(torch.randn(1, 9, 1, 4), precompute_freqs_cis(4, 8))


def test_rotation_with_a_real_table_fails_clearly() -> None:
    # e.g. after model.to(torch.bfloat16) cast the complex buffer to a real dtype
    with pytest.raises(TypeError, match="complex"):
        apply_rotary_emb(torch.randn(1, 4, 1, 4), precompute_freqs_cis(4, 8).real)
