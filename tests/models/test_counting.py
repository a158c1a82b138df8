"""Parameter counts and the per-device training-memory estimate, checked by hand."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import BaseModel
from torch import nn

from titan_kedro.config import build_job_config
from titan_kedro.models import get_train_spec
from titan_kedro.models.counting import (
    GIB,
    ParamCounts,
    count_parameters,
    estimate_training_memory,
    memory_layout,
    model_card,
)

SPEC = get_train_spec("llama3")
DIM, VOCAB, LAYERS, FFN = 256, 512, 2, 768
ATTENTION = 2 * DIM * DIM + 2 * DIM * 128  # q, o: 256×256; k, v: 256×128 (8 kv heads of 16)
BLOCK = ATTENTION + 3 * DIM * FFN + 2 * DIM  # + SwiGLU + two norms
TOTAL = 2 * VOCAB * DIM + LAYERS * BLOCK + DIM
# Saved per token and block: 6·dim + 2·kv_dim + 4·ffn_active, ffn_active = non-attention / 3·dim.
ELEMENTS = 6 * DIM + 2 * 128 + 4 * (BLOCK - ATTENTION) / (3 * DIM)


class ExpertParallelExtension(BaseModel):
    expert_parallel_degree: int = 1


def job(**sections: dict[str, Any]) -> Any:
    sections.setdefault("training", {})
    sections["training"] = {
        "seq_len": 32,
        "local_batch_size": 2,
        "device": "cpu",
        **sections["training"],
    }
    return build_job_config(sections, [{"parallelism": ExpertParallelExtension}], source="test")


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, Any]:
    args = SPEC.resolve_args("debugmodel", {"vocab_size": VOCAB, "n_layers": LAYERS})
    with torch.device("meta"):
        return SPEC.build_model(args), args


class ToyMoE(nn.Module):
    """Two blocks with attention, 4 routed experts of 10·dim params each, one shared expert."""

    def __init__(self, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict()
        for i in range(2):
            block = nn.Module()
            block.attention = nn.Linear(dim, dim, bias=False)
            block.moe = nn.Module()
            block.moe.experts = nn.Module()
            block.moe.experts.w = nn.Parameter(torch.zeros(4, 10, dim))
            block.moe.shared_experts = nn.Linear(dim, dim, bias=False)
            self.layers[str(i)] = block
        self.norm = nn.LayerNorm(dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)

    def active_params(self) -> int:
        routed = sum(b.moe.experts.w.numel() for b in self.layers.values())
        return sum(p.numel() for p in self.parameters()) - routed + routed // 4  # top-1 of 4


def test_count_parameters_of_a_dense_model(llama: tuple[nn.Module, Any]) -> None:
    counts = count_parameters(llama[0])
    assert counts == ParamCounts(total=TOTAL, active=TOTAL, embedding=VOCAB * DIM, routed_experts=0)


def test_tied_weights_are_counted_once() -> None:
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(10, 4)
    model.output = nn.Linear(4, 10, bias=False)
    model.output.weight = model.tok_embeddings.weight
    assert count_parameters(model).total == 40


def test_moe_counts_active_and_routed_experts_but_not_shared_ones() -> None:
    counts = count_parameters(ToyMoE())
    dense = 16 * 8 + 2 * (8 * 8 + 8 * 8) + 8 + 8 * 16
    routed = 2 * 4 * 10 * 8
    assert counts.total == dense + routed
    assert counts.routed_experts == routed
    assert counts.active == dense + routed // 4
    assert counts.embedding == 16 * 8


def test_memory_on_one_cpu_rank_by_hand(llama: tuple[nn.Module, Any]) -> None:
    model, args = llama
    memory = estimate_training_memory(model, args, job())
    tokens = 2 * 32
    assert memory["params_gib"] == pytest.approx(TOTAL * 4 / GIB)
    assert memory["grads_gib"] == pytest.approx(TOTAL * 4 / GIB)
    assert memory["optimizer_gib"] == pytest.approx(TOTAL * 8 / GIB)
    assert memory["compute_copy_gib"] == 0  # one fp32 rank computes on its own parameters
    assert memory["activations_gib"] == pytest.approx(tokens * LAYERS * ELEMENTS * 4 / GIB)
    assert memory["logits_gib"] == pytest.approx(tokens * VOCAB * 8 / GIB)
    parts = [v for k, v in memory.items() if k != "total_gib"]
    assert memory["total_gib"] == pytest.approx(sum(parts))


def test_fsdp_shards_states_and_adds_gathered_units(llama: tuple[nn.Module, Any]) -> None:
    model, args = llama
    memory = estimate_training_memory(model, args, job(launch={"nproc_per_node": 4}))
    assert memory["params_gib"] + memory["grads_gib"] + memory["optimizer_gib"] == pytest.approx(
        TOTAL * 16 / 4 / GIB
    )
    # Two blocks gathered (current + prefetched) in fp32, plus one block's unsharded grads.
    assert memory["compute_copy_gib"] == pytest.approx((2 * BLOCK * 4 + BLOCK * 4) / GIB)


def test_gpu_mixed_precision_halves_activations_and_adds_a_bf16_copy(
    llama: tuple[nn.Module, Any],
) -> None:
    model, args = llama
    cfg = job(training={"device": "cuda"})
    layout = memory_layout(cfg)
    assert (layout.on_gpu, layout.compute_dtype, layout.fsdp_degree) == (True, "bfloat16", 1)
    memory = estimate_training_memory(model, args, cfg)
    tokens = 2 * 32
    assert memory["compute_copy_gib"] == pytest.approx(2 * BLOCK * 2 / GIB)
    assert memory["activations_gib"] == pytest.approx(tokens * LAYERS * ELEMENTS * 2 / GIB)
    assert memory["logits_gib"] == pytest.approx(tokens * VOCAB * (8 + 2) / GIB)


@pytest.mark.parametrize(("mode", "checkpointed"), [("none", 0), ("selective", 1), ("full", 2)])
def test_activation_checkpointing_keeps_block_inputs_only(
    llama: tuple[nn.Module, Any], mode: str, checkpointed: int
) -> None:
    model, args = llama
    cfg = job(training={"activation_checkpoint": mode, "seq_len": 64})
    stored = (LAYERS - checkpointed) * ELEMENTS + checkpointed * DIM
    if checkpointed:
        stored += ELEMENTS  # one block recomputed at a time
    expected = 2 * 64 * stored * 4 / GIB
    assert estimate_training_memory(model, args, cfg)["activations_gib"] == pytest.approx(expected)


def test_expert_parallelism_gathers_only_local_experts() -> None:
    model = ToyMoE()
    args = SimpleNamespace(dim=8, vocab_size=16, n_heads=2)
    cfg = job(launch={"nproc_per_node": 4}, parallelism={"expert_parallel_degree": 2})
    assert memory_layout(cfg).expert_parallel_degree == 2
    memory = estimate_training_memory(model, args, cfg)
    counts = count_parameters(model)
    assert memory["params_gib"] == pytest.approx(counts.total * 4 / 4 / GIB)
    block_dense = 8 * 8 + 8 * 8
    gathered_block = block_dense + 4 * 10 * 8 / 2  # half the experts live on this EP rank
    assert memory["compute_copy_gib"] == pytest.approx(3 * gathered_block * 4 / GIB)


def test_expert_parallel_degree_must_divide_the_shard_degree() -> None:
    cfg = job(launch={"nproc_per_node": 2}, parallelism={"expert_parallel_degree": 4})
    with pytest.raises(ValueError, match="expert_parallel_degree=4 must divide"):
        memory_layout(cfg)


def test_8b_on_eight_gpus_fits_an_80gb_card() -> None:
    args = SPEC.flavors["8B"]
    with torch.device("meta"):
        model = SPEC.build_model(args)
    cfg = job(
        training={
            "device": "cuda",
            "seq_len": 8192,
            "local_batch_size": 1,
            "activation_checkpoint": "full",
        },
        launch={"nproc_per_node": 8},
    )
    memory = estimate_training_memory(model, args, cfg)
    states = memory["params_gib"] + memory["grads_gib"] + memory["optimizer_gib"]
    assert states == pytest.approx(8_030_261_248 * 16 / 8 / GIB)  # ≈ 14.96 GiB
    assert memory["logits_gib"] == pytest.approx(8192 * 128256 * 10 / GIB)  # ≈ 9.79 GiB
    assert 20 < memory["total_gib"] < 80


def test_model_card_is_json_safe_and_complete(llama: tuple[nn.Module, Any]) -> None:
    _, args = llama
    cfg = job(training={"seq_len": 128})
    card = model_card(SPEC, args, cfg)
    assert json.loads(json.dumps(card)) == card
    assert card["spec"] == "llama3" and card["flavor"] == "debugmodel"
    assert card["args"]["rope_scaling"]["factor"] == 8.0
    assert card["parameters"]["total"] == TOTAL
    assert card["parameters"]["non_embedding"] == TOTAL - VOCAB * DIM
    # 6 FLOPs per non-embedding parameter, plus q·kᵀ and scores·v over 128 positions:
    # 12 · layers · (heads · head_dim = DIM) · seq_len.
    assert card["flops_per_token"] == 6 * (TOTAL - VOCAB * DIM) + 12 * LAYERS * DIM * 128
    assert card["memory"]["layout"]["fsdp_degree"] == 1
    assert math.isclose(
        card["memory"]["estimate_gib"]["total_gib"],
        estimate_training_memory(llama[0], args, cfg)["total_gib"],
    )
