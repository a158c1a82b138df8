"""Random transformers DeepSeek models for the logit-parity tests (V2 and V3)."""

from __future__ import annotations

import torch
from torch import nn

YARN_SMALL = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
}
"""YaRN at a tiny original context, so a 40-token test sequence is interpolated."""


def randomize_hf_deepseek(model: nn.Module) -> nn.Module:
    """Give an HF DeepSeek model weights far from its init, in place (seeded by the caller).

    Router weights are peaked, so float noise cannot flip a near-tie between experts;
    norms vary around one; a V3 correction bias is large enough to change which experts win.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
    return model


def assert_logits_match(hf_model: nn.Module, model: nn.Module, vocab_size: int) -> None:
    """Our float32 logits equal transformers' within 1e-4 on a random 2 × 40 batch."""
    tokens = torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        ours = model(tokens)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-4
    # The comparison has teeth: the logits are far from trivial.
    assert expected.std().item() > 0.1
