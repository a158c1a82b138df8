"""DeepSeek-V3: multi-token prediction, aux-loss-free balancing, counting, config and export."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titan_kedro.config.load import ConfigError
from titan_kedro.models import get_train_spec
from titan_kedro.models.counting import count_parameters
from titan_kedro.models.deepseek_v3 import FLAVORS, flops_per_token, param_counts
from titan_kedro.models.hf_export import compare_logits, export_hf_folder
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.hf_init import load_hf_weights
from titan_kedro.train.mtp import mtp_loss

SPEC = get_train_spec("deepseek_v3")
# The debugmodel shrunk: 3 blocks (1 dense), 8 experts in 2 groups, q-LoRA, one MTP depth.
TINY = dataclasses.replace(
    FLAVORS["debugmodel"],
    vocab_size=256,
    dim=64,
    n_layers=3,
    n_heads=4,
    max_seq_len=64,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    mtp_depth=1,
)


def _model(args=TINY, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return SPEC.build_model(args)


def _tokens(seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, TINY.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed)
    )


def test_mtp_outputs_predict_further_ahead_in_training_mode_only() -> None:
    model = _model(dataclasses.replace(TINY, mtp_depth=2)).train()
    tokens = _tokens()
    logits = model(tokens)
    depths = model.mtp_outputs()
    assert [tuple(o.shape) for o in depths] == [(2, 23, 256), (2, 22, 256)]
    assert logits.shape == (2, 24, 256)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), logits.detach())  # MTP leaves the logits alone
    assert model.mtp_outputs() == []


def test_mtp_sees_only_the_tokens_up_to_the_one_it_is_told() -> None:
    """Depth 1 at position i uses tokens ≤ i + 1 and predicts i + 2: later tokens change nothing."""
    model = _model().train()
    tokens = _tokens()
    with torch.no_grad():
        model(tokens)
        before = model.mtp_outputs()[0].clone()
        changed = tokens.clone()
        changed[:, 12] = (changed[:, 12] + 1) % TINY.vocab_size
        model(changed)
        after = model.mtp_outputs()[0]
    # Position 10 is told token 11 and predicts 12: unchanged. Position 11 is told token 12.
    torch.testing.assert_close(after[:, :11], before[:, :11], rtol=0, atol=1e-6)
    assert (after[:, 11] - before[:, 11]).abs().max() > 1e-3


def test_mtp_loss_is_the_mean_cross_entropy_over_depths_and_trains() -> None:
    model = _model(dataclasses.replace(TINY, mtp_depth=2)).train()
    tokens = _tokens(seq=25)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    model(inputs)
    # Depth k at position i predicts the input token i + k + 1, i.e. labels[:, i + k].
    by_hand = [
        F.cross_entropy(out.flatten(0, 1), tokens[:, k + 1 :].flatten())
        for k, out in enumerate(model.mtp_outputs(), start=1)
    ]
    loss = mtp_loss(model, loss_fn, labels)
    torch.testing.assert_close(loss, torch.stack(by_hand).mean())
    loss.backward()
    mtp_block = model.layers[str(TINY.n_layers)]
    assert mtp_block.eh_proj.weight.grad.abs().sum() > 0
    assert model.output.weight.grad.abs().sum() > 0  # the head is shared
    model.eval()
    model(inputs)
    assert mtp_loss(model, loss_fn, labels) is None


def test_aux_loss_free_bias_moves_the_load_towards_balance() -> None:
    """Under a router skewed towards two experts, the correction bias spreads the load."""
    args = dataclasses.replace(TINY, mtp_depth=0, load_balance_bias_update_speed=0.01)
    model = _model(args).eval()
    tokens = _tokens(seq=64, seed=3)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        moe.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, moe in enumerate(model.moe_layers())
    ]
    with torch.no_grad():
        model(tokens)
        for hook in hooks:
            hook.remove()
        # Experts 0 and 1 point along the mean MoE input: most tokens pick them.
        for i, moe in enumerate(model.moe_layers()):
            mean = inputs[i].flatten(0, 1).mean(dim=0)
            moe.router.gate.weight[:2] = 4.0 * mean / mean.norm()

    def spread() -> float:
        model.reset_expert_load()
        with torch.no_grad():
            model(tokens)
        load = model.expert_load()
        return float((load.max(dim=1).values / load.mean(dim=1)).mean())

    spreads = []
    for _ in range(80):
        spreads.append(spread())
        model.update_expert_bias(model.expert_load())
    assert spreads[0] > 2.5, spreads[0]  # skewed at the start (4 = everyone on two experts)
    assert sum(spreads[-10:]) / 10 < 0.6 * spreads[0], spreads
    assert all(m.expert_bias[:2].max() < m.expert_bias[2:].min() for m in model.moe_layers())


def test_counts_and_flops_include_mtp() -> None:
    model = _model()
    assert count_parameters(model) == param_counts(TINY)
    without = dataclasses.replace(TINY, mtp_depth=0)
    assert count_parameters(_model(without)) == param_counts(without)
    extra_flops = flops_per_token(TINY, 64) - flops_per_token(without, 64)
    mtp_params = param_counts(TINY).active - param_counts(without).active
    # One more block, eh_proj and norms (6 FLOPs per parameter), the head's matmul again and
    # the block's attention: more than the parameters alone.
    assert extra_flops > 6 * (mtp_params + TINY.vocab_size * TINY.dim)


def _raw(**model: object) -> dict[str, object]:
    return {
        "model": {"name": "deepseek_v3", "flavor": "debugmodel", **model},
        "tokenizer": {"name_or_path": "deepseek-ai/DeepSeek-V3"},
        "training": {"seq_len": 64},
    }


def test_model_mtp_depth_is_an_override_and_conflicts_fail() -> None:
    resolved = resolve_job_config(_raw(mtp_depth=1))
    assert resolved.model_args.mtp_depth == 1
    assert resolved.config.model.overrides == {"mtp_depth": 1}  # a maths setting on resume
    assert resolved.config.training.mtp_loss_weight == pytest.approx(0.3)
    assert resolve_job_config(_raw()).model_args.mtp_depth == 0
    with pytest.raises(ConfigError, match=r"model\.mtp_depth=1 and model\.overrides\.mtp_depth=2"):
        resolve_job_config(_raw(mtp_depth=1, overrides={"mtp_depth": 2}))
    # V2 has no MTP: a V3 key given to it is refused, naming the model that adds it.
    with pytest.raises(ConfigError, match=r"model\.mtp_depth is added by model 'deepseek_v3'"):
        resolve_job_config({**_raw(), "model": {"name": "deepseek_v2", "mtp_depth": 1}})


def test_export_matches_transformers_and_initial_load_keeps_mtp_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model(seed=5)
    with torch.no_grad():
        for moe in model.moe_layers():  # a trained correction bias exports faithfully
            moe.expert_bias.normal_(0.0, 0.3)
    export_hf_folder(model, SPEC, TINY, tmp_path / "hf")
    assert compare_logits(tmp_path / "hf", model.eval(), _tokens()) <= 1e-4

    target = _model(seed=9)
    fresh_mtp = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("layers.3.")}
    with caplog.at_level(logging.WARNING):
        load_hf_weights([target], SPEC, TINY, tmp_path / "hf")
    assert "multi-token prediction" in caplog.text
    loaded = target.state_dict()
    for key, value in model.state_dict().items():
        expected = fresh_mtp[key] if key in fresh_mtp else value
        assert torch.equal(loaded[key], expected), key
    assert fresh_mtp  # the MTP block exists and was left alone
