"""Split tokenized shards into train/validation and pack each split into one stream.

A packed stream is ``BOS doc EOS BOS doc EOS …`` as little-endian ``uint32``. Packing
reads the intermediate shards one at a time and yields bounded chunks, so the token files
are written without ever holding a split in memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from titan_kedro.data.shard_store import ShardStore
from titan_kedro.data.splitting import HASH_RULE, SPLITS, validation_mask
from titan_kedro.data.token_store import TOKEN_DTYPE

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 1 << 20


def pack_documents(
    tokens: np.ndarray,
    lengths: np.ndarray,
    keep: np.ndarray | None,
    *,
    bos_id: int,
    eos_id: int,
) -> np.ndarray:
    """Pack the kept documents of a flat token array as ``BOS doc EOS`` each.

    Args:
        tokens: All documents' tokens back to back (no control tokens).
        lengths: Tokens per document (sums to ``len(tokens)``).
        keep: Boolean mask of the documents to pack (None: all).
        bos_id: Token id put before every document.
        eos_id: Token id put after every document.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    if keep is not None:
        starts, lengths = starts[keep], lengths[keep]
    out_starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] + 2, out=out_starts[1:])
    total = int(lengths.sum()) + 2 * len(lengths)
    out = np.empty(total, dtype=TOKEN_DTYPE)
    if not len(lengths):
        return out
    out[out_starts] = bos_id
    out[out_starts + lengths + 1] = eos_id
    body = np.ones(total, dtype=bool)
    body[out_starts] = False
    body[out_starts + lengths + 1] = False
    body_positions = np.flatnonzero(body)
    # Output position p of document i holds tokens[starts[i] + p - out_starts[i] - 1].
    out[body_positions] = tokens[body_positions + np.repeat(starts - out_starts - 1, lengths)]
    return out


def plan_split(
    store: ShardStore, entries: Sequence[dict[str, Any]], validation_fraction: float
) -> dict[str, Any]:
    """Count documents and packed tokens per split and shard (reads only lengths and hashes).

    Raises:
        ValueError: The train split would be empty (never train on nothing).
    """
    shards = []
    totals = {split: {"documents": 0, "tokens": 0} for split in SPLITS}
    for entry in entries:
        shard = store.read(entry)
        to_validation = validation_mask(shard.hashes, validation_fraction)
        row: dict[str, Any] = {"key": entry["key"], "name": entry["name"]}
        for split, mask in (("train", ~to_validation), ("validation", to_validation)):
            docs = int(mask.sum())
            tokens = int(shard.lengths[mask].astype(np.int64).sum()) + 2 * docs
            row[split] = {"documents": docs, "tokens": tokens}
            totals[split]["documents"] += docs
            totals[split]["tokens"] += tokens
        shards.append(row)
    if totals["train"]["documents"] == 0:
        raise ValueError(
            f"the train split is empty ({sum(e['documents'] for e in entries)} documents in "
            f"{len(entries)} shard(s), validation_fraction={validation_fraction}); add C4 shards "
            "or lower data.validation_fraction"
        )
    if validation_fraction > 0 and totals["validation"]["documents"] == 0:
        logger.warning(
            "the validation split is empty (validation_fraction=%s over %d documents); add data "
            "or raise data.validation_fraction",
            validation_fraction,
            totals["train"]["documents"],
        )
    return {
        "validation_fraction": validation_fraction,
        "rule": HASH_RULE,
        "splits": totals,
        "shards": shards,
    }


class PackedSplit:
    """One split's packed stream, produced lazily as ``uint32`` chunks shard after shard.

    Iterating twice gives the same chunks; the object holds only paths and counts, so it is
    cheap to copy and pickle.
    """

    def __init__(
        self,
        store_root: str | Path,
        entries: Sequence[dict[str, Any]],
        split: str,
        *,
        validation_fraction: float,
        bos_id: int,
        eos_id: int,
        chunk_tokens: int = CHUNK_TOKENS,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        self.store_root = str(store_root)
        self.entries = [dict(e) for e in entries]
        self.split = split
        self.validation_fraction = validation_fraction
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chunk_tokens = chunk_tokens

    def __iter__(self) -> Iterator[np.ndarray]:
        store = ShardStore(self.store_root)
        for entry in self.entries:
            shard = store.read(entry)
            keep = validation_mask(shard.hashes, self.validation_fraction)
            if self.split == "train":
                keep = ~keep
            offsets = shard.offsets
            # Cut the shard into blocks of whole documents of about chunk_tokens tokens.
            n_docs = len(shard.lengths)
            cuts = np.searchsorted(
                offsets, np.arange(self.chunk_tokens, offsets[-1], self.chunk_tokens)
            )
            bounds = sorted({0, n_docs, *(int(c) for c in cuts)})
            for lo, hi in itertools.pairwise(bounds):
                block = pack_documents(
                    shard.tokens[offsets[lo] : offsets[hi]],
                    shard.lengths[lo:hi],
                    keep[lo:hi],
                    bos_id=self.bos_id,
                    eos_id=self.eos_id,
                )
                if block.size:
                    yield block


def data_fingerprint(tokenizer_fingerprint: str, split_hashes: dict[str, str]) -> str:
    """Fingerprint of a token folder: the tokenizer plus the sha256 of each split file."""
    payload = json.dumps(
        {"tokenizer": tokenizer_fingerprint, "splits": split_hashes}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
