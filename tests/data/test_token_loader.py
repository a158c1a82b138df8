"""TokenLoader: shapes, rank sharding, determinism, exact resume, epoch wrap, too-small errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from titan_kedro.data.loader import TokenLoader

SEQ = 8


def _stream(n: int = 2000) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)


def _loader(
    tokens: np.ndarray, rank: int = 0, degree: int = 1, seed: int = 0, batch: int = 4
) -> TokenLoader:
    return TokenLoader(
        tokens, seq_len=SEQ, local_batch_size=batch, dp_rank=rank, dp_degree=degree, seed=seed
    )


def _starts(inputs: torch.Tensor) -> set[int]:
    return {
        int(row[0]) for row in inputs
    }  # the stream is arange, so a row's first value is its offset


def test_batches_are_shifted_windows_of_seq_len_plus_one() -> None:
    inputs, labels = next(_loader(_stream()))
    assert inputs.shape == labels.shape == (4, SEQ)
    assert inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(labels[:, -1], inputs[:, -1] + 1)
    assert all(start % SEQ == 0 for start in _starts(inputs))


def test_two_ranks_get_different_samples_that_cover_the_epoch() -> None:
    tokens = _stream()
    ranks = [_loader(tokens, rank=r, degree=2) for r in range(2)]
    per_epoch = ranks[0].batches_per_epoch
    assert per_epoch == ranks[1].batches_per_epoch == (1999 // SEQ) // 2 // 4
    seen = [set().union(*(_starts(next(loader)[0]) for _ in range(per_epoch))) for loader in ranks]
    assert not seen[0] & seen[1]
    assert len(seen[0]) == len(seen[1]) == per_epoch * 4
    assert (
        len(seen[0] | seen[1]) >= (1999 // SEQ) - 2 * 4
    )  # at most one short batch per rank left out


def test_same_seed_same_order_other_seed_other_order() -> None:
    tokens = _stream()
    a = [next(_loader(tokens, seed=1))[0] for _ in range(1)]
    b = [next(_loader(tokens, seed=1))[0] for _ in range(1)]
    c = [next(_loader(tokens, seed=2))[0] for _ in range(1)]
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_resume_continues_exactly_across_an_epoch_boundary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = _stream(400)  # 49 windows → 12 batches per epoch
    reference = _loader(tokens, seed=3)
    per_epoch = reference.batches_per_epoch
    expected = [next(reference) for _ in range(per_epoch + 5)]

    first = _loader(tokens, seed=3)
    for _ in range(per_epoch - 2):
        next(first)
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())

    resumed = _loader(tokens, seed=3)
    resumed.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger="titan_kedro.data.loader"):
        rest = [next(resumed) for _ in range(7)]
    for (x, y), (ex, ey) in zip(rest, expected[per_epoch - 2 :], strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert resumed.epoch == 1
    assert "starting epoch 1" in caplog.text
    # A new epoch reshuffles.
    assert not torch.equal(expected[per_epoch][0], expected[0][0])


def test_state_from_another_rank_restores_this_rank() -> None:
    tokens = _stream()
    rank0, rank1 = _loader(tokens, 0, 2), _loader(tokens, 1, 2)
    for _ in range(3):
        next(rank0), next(rank1)
    fresh1 = _loader(tokens, 1, 2)
    fresh1.load_state_dict(rank0.state_dict())
    assert torch.equal(next(fresh1)[0], next(rank1)[0])


def test_layout_mismatch_on_resume_is_refused() -> None:
    state = _loader(_stream()).state_dict()
    other = TokenLoader(_stream(), seq_len=16, local_batch_size=4, dp_rank=0, dp_degree=1, seed=0)
    with pytest.raises(ValueError, match="seq_len=8 but this loader has 16"):
        other.load_state_dict(state)


def test_too_small_split_says_how_many_tokens_are_needed() -> None:
    with pytest.raises(ValueError) as err:
        TokenLoader(
            np.arange(60, dtype=np.uint32),
            seq_len=SEQ,
            local_batch_size=4,
            dp_rank=0,
            dp_degree=2,
            seed=0,
            name="validation",
        )
    message = str(err.value)
    assert "validation: 60 tokens" in message
    assert "2 rank(s) × 4 samples × 8 tokens + 1 = 65 tokens needed" in message


def test_exactly_enough_tokens_for_one_batch() -> None:
    loader = TokenLoader(
        np.arange(65, dtype=np.uint32),
        seq_len=SEQ,
        local_batch_size=4,
        dp_rank=1,
        dp_degree=2,
        seed=0,
    )
    assert loader.batches_per_epoch == 1
    next(loader)
    next(loader)
    assert loader.epoch == 1
