"""Document masking: a packed window scores each document exactly as if it ran alone."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_deepseek_v2 import TINY
from titan_kedro.models import get_train_spec
from titan_kedro.models.common import (
    attention,
    document_mask,
    document_positions,
    rotations_and_mask,
)

BOS = 1

# MLA with decoupled RoPE and MoE layers; Llama 3 with grouped-query attention.
MODELS = {
    "deepseek_v2": TINY,
    "llama3": get_train_spec("llama3").resolve_args(
        "debugmodel", {"vocab_size": 96, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
    ),
}


def _document(length: int, generator: torch.Generator) -> torch.Tensor:
    body = torch.randint(2, 96, (length - 1,), generator=generator)
    return torch.cat([torch.tensor([BOS]), body])


def test_positions_restart_at_every_bos_and_the_window_start() -> None:
    tokens = torch.tensor([[7, 8, BOS, 5, 6, 9, BOS, 4], [BOS, 3, 3, 3, 3, BOS, 2, 2]])
    positions, ids = document_positions(tokens, BOS)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]]
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]]
    mask = document_mask(ids, flex=False)
    assert mask.shape == (2, 1, 8, 8)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False, False, False]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_window_logits_equal_each_document_alone(name: str) -> None:
    spec = get_train_spec(name)
    torch.manual_seed(0)
    model = spec.build_model(MODELS[name]).float().eval()
    gen = torch.Generator().manual_seed(1)
    rows = [[5, 11, 9, 7], [13, 6, 13]]  # document lengths per row, 32 tokens each
    docs = [[_document(n, gen) for n in lengths] for lengths in rows]
    packed = torch.stack([torch.cat(row) for row in docs])
    positions, ids = document_positions(packed, BOS)
    with torch.no_grad():
        masked = model(packed, positions=positions, document_ids=ids)
        unmasked = model(packed)
        for r, row in enumerate(docs):
            start = 0
            for doc in row:
                alone = model(doc[None])[0]
                got = masked[r, start : start + len(doc)]
                torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
                start += len(doc)
    # Without the mask a later document sees the earlier ones, so the check above can fail.
    assert (unmasked[0, 5:16] - masked[0, 5:16]).abs().max() > 1e-3


def test_flex_block_mask_matches_the_dense_mask() -> None:
    # The CUDA path (FlexAttention, compiled) checked forward-only on CPU, with MLA's
    # value width differing from the query/key width.
    tokens = torch.tensor([[BOS, 5, 6, BOS, 7, 8, 9, BOS] * 16])
    _, ids = document_positions(tokens, BOS)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 2, 128, 8, generator=gen)
    dense = attention(q, k, v, document_mask(ids, flex=False), scale=0.3)
    flex = attention(q, k, v, document_mask(ids, flex=True), scale=0.3)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def test_rotations_and_mask_follow_the_documents_and_check_shapes() -> None:
    tokens = torch.tensor([[7, BOS, 5, 6], [BOS, 3, BOS, 2]])
    positions, ids = document_positions(tokens, BOS)
    table = torch.polar(torch.ones(16, 2), torch.arange(32.0).view(16, 2))
    rotations, mask = rotations_and_mask(table, tokens, positions, ids)
    assert torch.equal(rotations[0, 2], table[1])  # the second token of row 0's second document
    assert torch.equal(mask, document_mask(ids, flex=False))
    assert rotations_and_mask(table, tokens) == (table, None)
    with pytest.raises(ValueError, match=r"document_ids \(2, 3\) must have the shape of tokens"):
        rotations_and_mask(table, tokens, positions, ids[:, :3])
    with pytest.raises(ValueError, match=r"positions \(1, 4\) must have the shape of tokens"):
        rotations_and_mask(table, tokens, positions[:1], ids)
