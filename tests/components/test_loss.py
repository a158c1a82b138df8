"""Cross-entropy loss: value, ignored positions, dtype and shape checks."""

from __future__ import annotations

import math

import pytest
import torch
from train.conftest import make_config

from titan_kedro.components.loss import IGNORE_INDEX, build_cross_entropy_loss


def test_matches_manual_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    labels = torch.randint(0, 7, (2, 3))
    loss = build_cross_entropy_loss(make_config())(logits, labels)
    logp = logits.float().log_softmax(-1)
    manual = -logp.gather(-1, labels[..., None]).mean()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, manual)


def test_uniform_logits_give_log_vocab_and_ignore_index_is_skipped() -> None:
    loss_fn = build_cross_entropy_loss(make_config())
    labels = torch.tensor([[1, IGNORE_INDEX, 2]])
    logits = torch.zeros(1, 3, 5)
    logits[0, 1, 0] = 100.0  # an ignored position would add a large loss
    assert loss_fn(logits, labels).item() == pytest.approx(math.log(5))


def test_shape_mismatch_is_explained() -> None:
    with pytest.raises(ValueError, match=r"logits \[batch, seq, vocab\]"):
        build_cross_entropy_loss(make_config())(
            torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)
        )
