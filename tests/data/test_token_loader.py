"""TokenLoader: shapes, rank sharding, determinism, exact resume (also across world sizes),
epoch wrap, too-small errors, and no memory that grows with the corpus."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_kedro.data.loader import TokenLoader, WindowPermutation

SEQ = 8


def _stream(n: int = 2000) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)


def _loader(
    tokens: np.ndarray, rank: int = 0, degree: int = 1, seed: int = 0, batch: int = 4
) -> TokenLoader:
    return TokenLoader(
        tokens, seq_len=SEQ, local_batch_size=batch, data_rank=rank, data_ranks=degree, seed=seed
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
    other = TokenLoader(
        _stream(), seq_len=16, local_batch_size=4, data_rank=0, data_ranks=1, seed=0
    )
    with pytest.raises(ValueError, match="seq_len=8 but this loader has 16"):
        other.load_state_dict(state)


def test_too_small_split_says_how_many_tokens_are_needed() -> None:
    with pytest.raises(ValueError) as err:
        TokenLoader(
            np.arange(60, dtype=np.uint32),
            seq_len=SEQ,
            local_batch_size=4,
            data_rank=0,
            data_ranks=2,
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
        data_rank=1,
        data_ranks=2,
        seed=0,
    )
    assert loader.batches_per_epoch == 1
    next(loader)
    next(loader)
    assert loader.epoch == 1


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4097])
def test_window_permutation_is_a_bijection_that_depends_on_the_key(n: int) -> None:
    images = WindowPermutation(n, [5, 0])(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))
    if n >= 100:
        assert not np.array_equal(images, WindowPermutation(n, [5, 1])(np.arange(n)))
        assert not np.array_equal(images, np.arange(n))


def test_global_order_does_not_depend_on_the_number_of_ranks() -> None:
    tokens = _stream()
    one = _loader(tokens, batch=4)
    two = [_loader(tokens, rank=r, degree=2, batch=2) for r in range(2)]
    for _ in range(5):
        expected = next(one)[0]
        got = torch.cat([next(loader)[0] for loader in two])
        assert torch.equal(got, expected)


def test_state_from_two_ranks_resumes_on_four_ranks_at_the_same_window() -> None:
    tokens = _stream()
    two = [_loader(tokens, rank=r, degree=2, batch=2) for r in range(2)]
    for _ in range(3):
        for loader in two:
            next(loader)
    state = two[0].state_dict()
    assert state["windows"] == 12
    four = [_loader(tokens, rank=r, degree=4, batch=1) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    for _ in range(4):
        expected = torch.cat([next(loader)[0] for loader in two])
        assert torch.equal(torch.cat([next(loader)[0] for loader in four]), expected)


def test_position_that_is_no_whole_batch_of_the_new_layout_is_refused() -> None:
    first = _loader(_stream(), batch=3)
    next(first)
    with pytest.raises(ValueError, match="3 windows into epoch 0, not a whole number"):
        _loader(_stream(), batch=2).load_state_dict(first.state_dict())


def test_loader_over_a_huge_sparse_file_starts_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    with path.open("wb") as handle:
        handle.truncate(4 * 20_000_000_000)  # 20B uint32 tokens, no disk used
    tokens = np.memmap(path, dtype="<u4", mode="r")
    tracemalloc.start()
    loader = _loader(tokens, batch=8)
    inputs, _ = next(loader)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert loader.num_windows == (20_000_000_000 - 1) // SEQ
    assert inputs.shape == (8, SEQ)
    assert peak < 32 * 2**20  # a bounded index cache, no per-window array (that would be 20 GB)
