"""Thin Kedro nodes over ``titan_kedro.data``: clean → tokenize → split → pack → save."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from titan_kedro.config.schema import DataSection, TokenizerSection, section_from_params
from titan_kedro.config.sections.tokenize import TORCHX_EXECUTOR
from titan_kedro.data.packing import PackedSplit, plan_split
from titan_kedro.data.shard_store import ShardStore
from titan_kedro.data.shard_tokenizing import tokenize_sources
from titan_kedro.data.sources import DocumentSource, ShardFile, is_shard_name, select_sources
from titan_kedro.data.splitting import SPLITS
from titan_kedro.data.token_store import read_token_metadata
from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.launch.tokenize_job import tokenize_with_torchx

logger = logging.getLogger(__name__)

_SAMPLE_TOKENS = 1 << 20


def clean_documents(
    c4_raw: Mapping[str, Callable[[], ShardFile]], data: Mapping[str, Any]
) -> list[DocumentSource]:
    """Choose the document sources and check there is something to read.

    Cleaning is lazy: each source drops bad records (invalid JSON or UTF-8, no or empty
    text, a truncated tail, a line over ``data.max_line_bytes`` or nested too deep) while
    it is read by ``tokenize_documents``, counting them.

    Args:
        c4_raw: Lazy loaders of the raw shards, by partition id (``PartitionedDataset``).
        data: The ``data`` parameters.

    Raises:
        NoDataSourceError: No local shards (``source: local``) or no hub (``source: hub``).
    """
    cfg = section_from_params(DataSection, data)
    shards = []
    if cfg.source == "local":
        shards = [
            dataclasses.replace(load(), name=partition, max_line_bytes=cfg.max_line_bytes)
            for partition, load in sorted(c4_raw.items())
            if is_shard_name(partition)
        ]
    return select_sources(cfg, shards)


def tokenize_documents(
    c4_documents: list[DocumentSource], data: Mapping[str, Any], tokenizer: Mapping[str, Any]
) -> dict[str, Any]:
    """Tokenize every source not yet in the intermediate manifest, shard by shard.

    With ``data.tokenize.executor: torchx`` the shards are tokenized by a TorchX job of
    ``data.tokenize.tasks`` tasks (``launch.tokenize_job``) and merged into the manifest.

    Returns:
        ``{"store", "tokenizer", "shards"}``: the intermediate folder, the tokenizer's
        identity and ids, and one manifest entry per source (counts, skips, damage).
    """
    cfg = section_from_params(DataSection, data)
    tok = build_tokenizer(section_from_params(TokenizerSection, tokenizer).name_or_path)
    store = ShardStore(cfg.intermediate_dir)
    if cfg.tokenize.executor == TORCHX_EXECUTOR:  # local shards only (DataSection checks)
        entries = tokenize_with_torchx(cfg, cast(list[ShardFile], c4_documents), tok)
    else:
        entries = tokenize_sources(
            c4_documents,
            tok,
            store,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            min_chars=cfg.min_chars,
            max_bad_fraction=cfg.max_bad_fraction,
            max_documents=cfg.max_documents,
        )
    return {
        "store": str(store.root),
        "tokenizer": {
            "name": tok.name,
            "fingerprint": tok.fingerprint,
            "source": tok.source,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
        },
        "shards": entries,
    }


def split_documents(c4_token_shards: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """Assign documents to train/validation by text hash; count documents and tokens per split."""
    cfg = section_from_params(DataSection, data)
    store = ShardStore(c4_token_shards["store"])
    plan = plan_split(store, c4_token_shards["shards"], cfg.validation_fraction)
    for split in SPLITS:
        logger.info(
            "%s split: %d documents, %d tokens",
            split,
            plan["splits"][split]["documents"],
            plan["splits"][split]["tokens"],
        )
    return plan


def pack_documents(
    c4_token_shards: Mapping[str, Any], c4_split: Mapping[str, Any]
) -> dict[str, Any]:
    """Pack each split into one ``BOS doc EOS …`` stream for ``TokenFilesDataset`` to write.

    The streams are lazy (``PackedSplit``): the dataset pulls bounded chunks shard by shard.
    """
    tok = c4_token_shards["tokenizer"]
    fraction = c4_split["validation_fraction"]
    splits = {
        split: PackedSplit(
            c4_token_shards["store"],
            c4_token_shards["shards"],
            split,
            validation_fraction=fraction,
            bos_id=tok["bos_id"],
            eos_id=tok["eos_id"],
        )
        for split in SPLITS
    }
    return {"splits": splits, "metadata": token_metadata(c4_token_shards, c4_split)}


def token_metadata(
    c4_token_shards: Mapping[str, Any], c4_split: Mapping[str, Any]
) -> dict[str, Any]:
    """The metadata written beside the token files (the dataset adds checksums and fingerprint)."""
    shards = c4_token_shards["shards"]
    tok = dict(c4_token_shards["tokenizer"])
    skipped_by_reason: dict[str, int] = {}
    for entry in shards:
        for reason, count in entry["skipped_by_reason"].items():
            skipped_by_reason[reason] = skipped_by_reason.get(reason, 0) + count
    identity = {"name": tok["name"], "fingerprint": tok["fingerprint"]}
    return {
        "format": "packed uint32 little-endian: BOS doc EOS BOS doc EOS …",
        "tokenizer": tok,
        "tokenizer_fingerprint": tok["fingerprint"],
        "vocab_size": tok["vocab_size"],
        "bos_id": tok["bos_id"],
        "eos_id": tok["eos_id"],
        "validation_fraction": c4_split["validation_fraction"],
        "split_rule": c4_split["rule"],
        "documents": sum(e["documents"] for e in shards),
        "skipped": sum(skipped_by_reason.values()),
        "skipped_by_reason": dict(sorted(skipped_by_reason.items())),
        "splits": {split: {**c4_split["splits"][split], "tokenizer": identity} for split in SPLITS},
        "sources": [
            {
                **entry["source"],
                "documents": entry["documents"],
                "tokens": entry["tokens"],
                "skipped": entry["skipped"],
                "skipped_by_reason": entry["skipped_by_reason"],
                "damage": entry["damage"],
                "content_hash": entry["content_hash"],
            }
            for entry in shards
        ],
    }


def save_token_metadata(token_files: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """Check the written token files and return their metadata (catalog ``token_metadata``).

    Raises:
        ValueError: The files are inconsistent, or the catalog's ``token_files`` folder is not
            ``data.token_dir`` (where training reads them).
    """
    cfg = section_from_params(DataSection, data)
    meta = dict(token_files["metadata"])
    for split in SPLITS:
        _check_stream(split, token_files[split], meta)
    try:
        at_token_dir = read_token_metadata(cfg.token_dir).get("fingerprint")
    except FileNotFoundError:
        at_token_dir = None
    if at_token_dir != meta["fingerprint"]:
        raise ValueError(
            f"the catalog's token_files folder is not data.token_dir={cfg.token_dir} "
            f"({Path(cfg.token_dir).resolve()}), where training reads the tokens; make "
            "conf/<env>/catalog_data_processing.yml's token_files.path and data.token_dir agree"
        )
    logger.info(
        "token files OK: fingerprint %s, train %d tokens, validation %d tokens",
        meta["fingerprint"],
        meta["splits"]["train"]["tokens"],
        meta["splits"]["validation"]["tokens"],
    )
    return meta


def _check_stream(split: str, tokens: np.ndarray, meta: Mapping[str, Any]) -> None:
    if len(tokens) == 0:
        return
    bos, eos, vocab = meta["bos_id"], meta["eos_id"], meta["vocab_size"]
    if tokens[0] != bos or tokens[-1] != eos:
        raise ValueError(f"{split}.bin does not start with BOS {bos} and end with EOS {eos}")
    head, tail = tokens[:_SAMPLE_TOKENS], tokens[-_SAMPLE_TOKENS:]
    top = max(int(head.max()), int(tail.max()))
    if top >= vocab:
        raise ValueError(f"{split}.bin holds token id {top} ≥ vocab_size {vocab}")
