"""Tensor parallelism: impossible degrees are refused while the config resolves (before any
worker starts), naming the key and the degrees that would work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from titan_kedro.config import ConfigError
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.fused_loss import uses_fused_loss

TINY_MODEL = Path(__file__).parents[1] / "train" / "tiny_model.py"


def _raw(name: str, tp: int, ranks: int, ep: int = 1, **model: Any) -> dict[str, Any]:
    return {
        "model": {"name": name, **model},
        "launch": {"nproc_per_node": ranks},
        "parallelism": {"tensor_parallel_degree": tp, "expert_parallel_degree": ep},
    }


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        # Llama 3's debugmodel has 16 heads, 8 of them for keys and values.
        (
            _raw("llama3", 3, 6),
            r"tensor_parallel_degree=3 must divide model n_heads=16 .*"
            r"\[1, 2, 4, 8, 16\]",
        ),
        (_raw("llama3", 4, 4, overrides={"n_kv_heads": 2}), r"=4 must divide model n_kv_heads=2"),
        (_raw("llama3", 2, 2, overrides={"ffn_hidden_dim": 77}), r"model ffn_hidden_dim=77"),
        (_raw("llama3", 2, 2, overrides={"vocab_size": 513}), r"model vocab_size=513"),
        # DeepSeek-V2's debugmodel: 8 heads; its shared experts are 2 × 256 wide.
        (
            _raw("deepseek_v2", 4, 4, ep=4, overrides={"intermediate_size": 1022}),
            r"=4 must divide model intermediate_size=1022",
        ),
        (
            _raw(
                "deepseek_v2",
                4,
                4,
                ep=4,
                overrides={"moe_intermediate_size": 10, "n_shared_experts": 1},
            ),
            r"model moe_intermediate_size × n_shared_experts=10",
        ),
        (
            _raw("deepseek_v3", 2, 2, ep=2, mtp_depth=1),
            r"tensor_parallel_degree=2 with model.mtp_depth=1",
        ),
        # The TP ranks route different tokens: EP must take them all in.
        (_raw("deepseek_v2", 2, 4), r"expert_parallel_degree=1 with tensor_parallel_degree=2"),
        (_raw("deepseek_v2", 4, 8, ep=2), r"expert_parallel_degree=2 .* multiple of 4"),
        ({**_raw("llama3", 4, 4), "training": {"seq_len": 30}}, r"training\.seq_len=30"),
        ({**_raw("llama3", 2, 2), "training": {"compile": True}}, r"training\.compile with"),
        (
            {
                **_raw("tiny_dense", 2, 2, custom_model_path=str(TINY_MODEL)),
                "training": {"seq_len": 64},
            },
            r"model 'tiny_dense' has no tensor-parallel plan",
        ),
    ],
)
def test_a_degree_the_model_cannot_split_is_refused_naming_the_fix(
    raw: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_job_config(raw)


def test_a_degree_that_splits_every_width_resolves_and_leaves_the_fused_loss_off() -> None:
    resolved = resolve_job_config(
        {**_raw("deepseek_v2", 2, 4, ep=2), "training": {"fused_loss": True}}
    )
    layout = resolved.config.layout
    assert (layout.tp, layout.dp_shard, layout.dp_degree) == (2, 2, 2)
    assert not uses_fused_loss(resolved.config, resolved.spec, _bias_free_output())


def _bias_free_output() -> torch.nn.Module:
    module = torch.nn.Module()
    module.output = torch.nn.Linear(4, 8, bias=False)
    return module
