"""Train/validation assignment by a stable hash of each document's text.

A document goes to validation iff ``blake2b-64(utf-8 text) / 2**64 < validation_fraction``,
so the split never depends on order, shard boundaries or the run, and identical texts
always land in the same split (no document is in both).
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLITS = ("train", "validation")
HASH_RULE = (
    "blake2b-64 of the UTF-8 text, read as little-endian uint64; validation iff < fraction * 2**64"
)


def text_hash(text: str) -> int:
    """The document's stable 64-bit hash."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def validation_mask(hashes: np.ndarray, validation_fraction: float) -> np.ndarray:
    """Boolean mask of the documents (given by their ``text_hash``) that go to validation."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    threshold = np.uint64(min(int(validation_fraction * 2**64), 2**64 - 1))
    return np.asarray(hashes, dtype=np.uint64) < threshold
