"""``TokenLoader``: deterministic, resumable, data-parallel batches from a packed token stream.

Memory does not grow with the corpus: the order of windows is a keyed permutation
(``WindowPermutation``) computed on the fly for the windows of each batch, never an
array over all windows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LAYOUT_KEYS = ("seq_len", "seed", "num_tokens")
_ROUNDS = 6
_CACHE_WINDOWS = 1 << 16
"""Window indices of upcoming batches computed at once (512 KiB), to amortise numpy calls."""
_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL_2 = np.uint64(0x94D049BB133111EB)


class WindowPermutation:
    """A seeded permutation of ``range(n)`` evaluated index by index (no table).

    A balanced Feistel network over the smallest even number of bits that holds ``n``
    (a bijection of ``[0, 2**bits)``), restricted to ``[0, n)`` by cycle walking: an
    image ``≥ n`` is permuted again until it lands below ``n``. Since the domain is
    less than ``4n``, a few rounds suffice on average. State: six round keys.

    Args:
        n: Size of the permuted range (≥ 1).
        key: Seed material (e.g. ``[seed, epoch]``) for ``np.random.default_rng``.
    """

    def __init__(self, n: int, key: Any):
        if n < 1:
            raise ValueError(f"a permutation needs n ≥ 1, got {n}")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = np.random.default_rng(key).integers(0, 2**63, _ROUNDS, dtype=np.uint64)

    def _round(self, right: np.ndarray, key: np.uint64) -> np.ndarray:
        v = (right ^ key) * _MUL_1
        v ^= v >> np.uint64(31)
        v *= _MUL_2
        v ^= v >> np.uint64(29)
        return v & self._mask

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ self._round(right, key)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """Images of ``indices`` (each in ``[0, n)``) as ``int64``."""
        x = np.asarray(indices, dtype=np.uint64)
        with np.errstate(over="ignore"):
            y = self._feistel(x)
            outside = y >= self.n
            while outside.any():
                y[outside] = self._feistel(y[outside])
                outside = y >= self.n
        return y.astype(np.int64)


class TokenLoader:
    """Yields ``(inputs, labels)`` of shape ``[local_batch_size, seq_len]`` (``torch.long``).

    The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (window ``i``
    starts at ``i * seq_len``); labels are inputs shifted by one. Each epoch orders the
    windows by a ``WindowPermutation`` keyed by ``(seed, epoch)``; that global order does
    not depend on the number of ranks. Batch ``b`` of the epoch is global positions
    ``[b·G, (b+1)·G)`` with ``G = data_ranks × local_batch_size``, and rank ``r`` takes
    positions ``b·G + r·local_batch_size …`` of it, so within an epoch no two ranks see
    the same window. The ``num_windows mod G`` windows that do not fill a last batch are
    left out of that epoch (a different few next epoch). When the epoch ends the loader
    wraps around, logging the new epoch.

    The position is global (windows consumed in this epoch, identical on every rank), so
    ``state_dict()`` from any rank restores every rank, under any data-parallel degree
    and batch size whose ``G`` divides that position.

    Args:
        tokens: The packed split (``open_split(token_dir, split)``), any 1-D integer array.
        seq_len: Tokens per sample.
        local_batch_size: Samples per batch on this rank.
        data_rank: This rank's index among the ranks that read different data.
        data_ranks: Ranks that read different data (``Layout.data_ranks``: every
            data-parallel rank of every replica group).
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
        data_rank: int,
        data_ranks: int,
        seed: int,
        name: str = "tokens",
    ) -> None:
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be ≥ 1"
            )
        if not 0 <= data_rank < data_ranks:
            raise ValueError(f"data_rank must be in [0, data_ranks={data_ranks}), got {data_rank}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.data_rank = data_rank
        self.data_ranks = data_ranks
        self.seed = seed
        self.name = name
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        self.global_batch_windows = data_ranks * local_batch_size
        self.batches_per_epoch = self.num_windows // self.global_batch_windows
        if self.batches_per_epoch == 0:
            needed = data_ranks * local_batch_size * seq_len + 1
            raise ValueError(
                f"{name}: {len(tokens)} tokens are too few for one batch — {data_ranks} rank(s) × "
                f"{local_batch_size} samples × {seq_len} tokens + 1 = {needed} tokens needed. Add "
                "data (more C4 shards, or a larger data.validation_fraction for validation) or "
                "lower training.seq_len / training.local_batch_size"
            )
        self.epoch = 0
        self._batch = 0
        self._permutation: WindowPermutation | None = None
        self._permutation_epoch = -1
        self._cache_batches = max(1, _CACHE_WINDOWS // local_batch_size)
        self._cache_first = -1
        self._cache = np.empty((0, local_batch_size), dtype=np.int64)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self._mine = data_rank * local_batch_size + np.arange(local_batch_size, dtype=np.int64)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batch >= self.batches_per_epoch:
            self.epoch += 1
            self._batch = 0
            logger.info(
                "%s loader (rank %d): starting epoch %d after %d batches",
                self.name,
                self.data_rank,
                self.epoch,
                self.batches_per_epoch,
            )
        windows = self._windows(self._batch)
        self._batch += 1
        block = np.asarray(
            self.tokens[(windows * self.seq_len)[:, None] + self._offsets], dtype=np.int64
        )
        inputs = torch.from_numpy(np.ascontiguousarray(block[:, :-1]))
        labels = torch.from_numpy(np.ascontiguousarray(block[:, 1:]))
        return inputs, labels

    def _windows(self, batch: int) -> np.ndarray:
        """This rank's window indices in batch ``batch`` of the current epoch."""
        if self._permutation_epoch != self.epoch:
            self._permutation = WindowPermutation(self.num_windows, [self.seed, self.epoch])
            self._permutation_epoch = self.epoch
            self._cache_first = -1
        offset = batch - self._cache_first
        if self._cache_first < 0 or not 0 <= offset < len(self._cache):
            stop = min(batch + self._cache_batches, self.batches_per_epoch)
            batches = np.arange(batch, stop, dtype=np.int64)[:, None]
            self._cache = self._permutation(batches * self.global_batch_windows + self._mine)
            self._cache_first, offset = batch, 0
        return self._cache[offset]

    def state_dict(self) -> dict[str, int]:
        """The global position and the layout, as plain ints (fits in a DCP checkpoint).

        ``windows`` (windows of the global order consumed in this epoch) and ``epoch``
        are the position; ``local_batch_size`` and ``data_ranks`` are recorded for
        information only.
        """
        return {
            "epoch": self.epoch,
            "windows": self._batch * self.global_batch_windows,
            "seq_len": self.seq_len,
            "local_batch_size": self.local_batch_size,
            "data_ranks": self.data_ranks,
            "seed": self.seed,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly after the last global batch yielded when ``state`` was taken.

        The state may come from another data-parallel degree or batch size: the global
        order is the same, and this loader continues at the same window.

        Raises:
            ValueError: The state comes from other data (sequence length, seed or token
                file), or its position is not a whole number of this layout's batches.
        """
        mine = self.state_dict()
        for key in _LAYOUT_KEYS:
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"{self.name} loader state has {key}={int(state[key])} but this loader has "
                    f"{mine[key]}; resume with the same data and layout, or start the data order afresh"
                )
        if "windows" in state:
            windows = int(state["windows"])
        else:  # states written before the position became global
            windows = int(state["batch"]) * int(state["dp_degree"]) * int(state["local_batch_size"])
        if windows % self.global_batch_windows:
            raise ValueError(
                f"{self.name} loader state is {windows} windows into epoch {int(state['epoch'])}, "
                f"not a whole number of batches of {self.data_ranks} rank(s) × "
                f"{self.local_batch_size} samples = {self.global_batch_windows}; resume with a "
                "data-parallel degree × training.local_batch_size that divides it (keep "
                "training.global_batch_size)"
            )
        self.epoch = int(state["epoch"])
        self._batch = windows // self.global_batch_windows
