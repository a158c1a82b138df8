"""``TokenLoader``: deterministic, resumable, data-parallel batches from a packed token stream."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LAYOUT_KEYS = ("seq_len", "local_batch_size", "dp_degree", "seed", "num_tokens")


class TokenLoader:
    """Yields ``(inputs, labels)`` of shape ``[local_batch_size, seq_len]`` (``torch.long``).

    The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (window ``i``
    starts at ``i * seq_len``); labels are inputs shifted by one. Each epoch shuffles the
    windows with a generator seeded by ``(seed, epoch)`` and deals them round-robin to the
    ``dp_degree`` data-parallel ranks, so within an epoch no two ranks see the same window.
    Every rank gets the same number of batches per epoch; the few windows that do not fill a
    batch on every rank are left out of that epoch (a different few next epoch). When the
    epoch ends the loader wraps around, logging the new epoch.

    The position (epoch, batch) is identical on every rank, so ``state_dict()`` from any rank
    restores all of them.

    Args:
        tokens: The packed split (``open_split(token_dir, split)``), any 1-D integer array.
        seq_len: Tokens per sample.
        local_batch_size: Samples per batch on this rank.
        dp_rank: This rank's index among the data-parallel ranks.
        dp_degree: Number of data-parallel ranks (every rank of the world here).
        seed: Shuffling seed; the same seed gives the same batches.
        name: Used in log lines and errors (e.g. ``"train"``).

    Raises:
        ValueError: Bad arguments, or too few tokens for one batch on every rank.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        name: str = "tokens",
    ) -> None:
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be ≥ 1"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, dp_degree={dp_degree}), got {dp_rank}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.name = name
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        self.batches_per_epoch = self.num_windows // dp_degree // local_batch_size
        if self.batches_per_epoch == 0:
            needed = dp_degree * local_batch_size * seq_len + 1
            raise ValueError(
                f"{name}: {len(tokens)} tokens are too few for one batch — {dp_degree} rank(s) × "
                f"{local_batch_size} samples × {seq_len} tokens + 1 = {needed} tokens needed. Add "
                "data (more C4 shards, or a larger data.validation_fraction for validation) or "
                "lower training.seq_len / training.local_batch_size"
            )
        self.epoch = 0
        self._batch = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batch >= self.batches_per_epoch:
            self.epoch += 1
            self._batch = 0
            logger.info(
                "%s loader (rank %d): starting epoch %d after %d batches",
                self.name,
                self.dp_rank,
                self.epoch,
                self.batches_per_epoch,
            )
        order = self._windows_of_epoch()
        first = self._batch * self.local_batch_size
        windows = order[first : first + self.local_batch_size]
        self._batch += 1
        block = np.asarray(
            self.tokens[(windows * self.seq_len)[:, None] + self._offsets], dtype=np.int64
        )
        inputs = torch.from_numpy(np.ascontiguousarray(block[:, :-1]))
        labels = torch.from_numpy(np.ascontiguousarray(block[:, 1:]))
        return inputs, labels

    def state_dict(self) -> dict[str, int]:
        """Position and layout as plain ints (fits in a DCP checkpoint)."""
        return {
            "epoch": self.epoch,
            "batch": self._batch,
            "seq_len": self.seq_len,
            "local_batch_size": self.local_batch_size,
            "dp_degree": self.dp_degree,
            "seed": self.seed,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly after the last batch yielded when ``state`` was taken.

        Raises:
            ValueError: The state comes from a different layout (sequence length, batch
                size, data-parallel degree, seed or token file).
        """
        mine = self.state_dict()
        for key in _LAYOUT_KEYS:
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"{self.name} loader state has {key}={int(state[key])} but this loader has "
                    f"{mine[key]}; resume with the same data and layout, or start the data order afresh"
                )
        self.epoch = int(state["epoch"])
        self._batch = int(state["batch"])

    def _windows_of_epoch(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            mine = rng.permutation(self.num_windows)[self.dp_rank :: self.dp_degree]
            self._order = mine[: self.batches_per_epoch * self.local_batch_size]
            self._order_epoch = self.epoch
        return self._order
