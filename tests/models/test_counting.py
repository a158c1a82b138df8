"""Parameter counts and the model card, checked by hand (memory: tests/plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from titan_kedro.config import build_job_config
from titan_kedro.models import get_train_spec, import_custom_model
from titan_kedro.models.counting import ParamCounts, count_parameters, model_card
from titan_kedro.plan.roofline import EXTRA_FLOP_FORMULAS

REPO = Path(__file__).resolve().parents[2]
SPEC = get_train_spec("llama3")
DIM, VOCAB, LAYERS, FFN = 256, 512, 2, 768
ATTENTION = 2 * DIM * DIM + 2 * DIM * 128  # q, o: 256×256; k, v: 256×128 (8 kv heads of 16)
BLOCK = ATTENTION + 3 * DIM * FFN + 2 * DIM  # + SwiGLU + two norms
TOTAL = 2 * VOCAB * DIM + LAYERS * BLOCK + DIM


def job(**sections: dict[str, Any]) -> Any:
    sections.setdefault("training", {})
    sections["training"] = {
        "seq_len": 32,
        "local_batch_size": 2,
        "device": "cpu",
        **sections["training"],
    }
    return build_job_config(sections, source="test")


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
    assert "memory" not in card  # the model_spec node adds the measured plan


@pytest.mark.parametrize(
    ("path", "name", "flavor"),
    [
        ("examples/custom_model/tiny_gpt.py", "tiny_gpt", "tiny"),
        ("tests/train/tiny_model.py", "tiny_dense", "debugmodel"),
        ("tests/train/tiny_model.py", "tiny_moe", "debugmodel"),
    ],
)
def test_user_models_flops_per_token_is_what_torch_counts(
    path: str, name: str, flavor: str
) -> None:
    """The example's and the test models' analytic counts against torch's ``FlopCounterMode``
    on a real forward + backward (matmuls and attention; no elementwise work, as the specs).

    Both count attention over the full sequence (``is_causal`` halves neither); CPU SDPA's
    fused backward also recomputes ``q·kᵀ``, ``2 · seq · dim`` per token and layer more
    than the specs' backward = 2 × forward, added to the expected count.
    """
    import_custom_model(path=str(REPO / path))
    spec = get_train_spec(name)
    args = spec.flavors[flavor]
    seq, batch = 32, 2
    model = spec.build_model(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        if hasattr(model, "moe_aux_loss"):
            loss = loss + model.moe_aux_loss()
        loss.backward()
    recompute = 2 * seq * args.dim * args.n_layers
    expected = (spec.flops_per_token(args, seq) + recompute) * batch * seq
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)
