"""The plan of a tensor-parallel layout: the fake step runs the TP model on the fake process
group, so each rank is charged its share of the work and of the activations."""

from __future__ import annotations

from typing import Any

import pytest

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan
from titan_kedro.plan.report import format_plan

SEQ, BATCH = 64, 4


def _llama_plan(tp: int) -> dict[str, Any]:
    small = {"vocab_size": 512, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
    raw = {
        "model": {"name": "llama3", "overrides": {**small, "ffn_hidden_dim": 128}},
        "launch": {"nproc_per_node": 4},
        "training": {"seq_len": SEQ, "local_batch_size": BATCH, "device": "cpu"},
        "parallelism": {"tensor_parallel_degree": tp},
        "metrics": {"peak_tflops": 1.0},
    }
    return build_plan(resolve_job_config(raw))


def test_tensor_parallelism_halves_each_ranks_flops_and_shrinks_its_activations() -> None:
    plain, split = _llama_plan(1), _llama_plan(2)
    assert (split["layout"]["tp"], split["layout"]["dp_shard"]) == (2, 2)
    assert "shard 2 × TP 2," in format_plan(split)
    # Both ranks run a micro-batch of the same size; TP 2 splits every matmul (heads, MLP
    # columns, vocabulary) over 2 ranks, so a rank's measured FLOPs halve.
    flops = {
        name: plan["cost"]["measured_flops_per_rank_step"]
        for name, plan in (("plain", plain), ("split", split))
    }
    assert flops["split"] == pytest.approx(flops["plain"] / 2, rel=0.03)
    # The blocks' inner activations and the residual stream are split; only the gathered
    # inputs of the attention and the MLP stay whole, so well under the unsplit step's.
    assert split["bytes_per_rank"]["activations"] < 0.75 * plain["bytes_per_rank"]["activations"]


@pytest.mark.parametrize("model", ["llama3", "deepseek_v2"])
def test_tensor_parallelism_alone_is_planned(model: str) -> None:
    # TP 2 on 2 ranks: no FSDP, so nothing but the step sums the sequence-parallel norms'
    # Partial gradients; the fake step's clipping refused them before (issue 43).
    small = {"vocab_size": 512, "n_layers": 2, "dim": 64, "n_heads": 4}
    extra = {"n_kv_heads": 2, "ffn_hidden_dim": 128} if model == "llama3" else {}
    raw = {
        "model": {"name": model, "overrides": {**small, **extra}},
        "launch": {"nproc_per_node": 2},
        "training": {"seq_len": SEQ, "local_batch_size": BATCH, "global_batch_size": 2 * BATCH,
                     "device": "cpu"},
        "parallelism": {"tensor_parallel_degree": 2,
                        "expert_parallel_degree": 2 if model == "deepseek_v2" else 1},
        "metrics": {"peak_tflops": 1.0},
    }  # fmt: skip
    plan = build_plan(resolve_job_config(raw))
    assert (plan["layout"]["tp"], plan["layout"]["dp_shard"]) == (2, 1)
    assert plan["bytes_per_rank"]["total"] > 0 and plan["fits"]
