"""Dataset lineage for the MLflow run: the raw C4 source and the token files it became.

Three ``mlflow.log_input`` records, built from the data stage's ``metadata.json``:

- ``c4-raw`` (context ``raw``): one row per source shard: name, size, documents,
  tokens, skipped, and the file's sha256 (local shards; recorded by the data stage), or the hub dataset, config,
  split and revision (``source: hub``);
- ``tokens-train`` / ``tokens-validation`` (contexts ``train`` / ``validation``): the
  split's file, bytes, sha256, documents and tokens; the digest is the data fingerprint.

The records describe files already on disk, so a run that only reads the token files
(a continued or later-stage run) logs the same ones. Sources are absolute local paths, or
the object-storage URIs as configured (``s3://…``); the digests depend on the content
only, so a token folder copied to object storage keeps its digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from titan_kedro.config.schema import DataSection, section_from_params
from titan_kedro.data.token_store import token_fingerprints
from titan_kedro.storage import is_remote

RAW_CONTEXT = "raw"
SPLITS = ("train", "validation")


def _location(value: str) -> str:
    """An object-storage URI as written; a local path made absolute."""
    return value.rstrip("/") if is_remote(value) else str(Path(value).resolve())


def _raw_rows(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for source in metadata.get("sources") or []:
        path = source.get("path")
        row = {
            "name": source.get("name"),
            "path": path,
            "size_bytes": source.get("size_bytes"),
            "documents": source.get("documents"),
            "tokens": source.get("tokens"),
            "skipped": source.get("skipped"),
            "sha256": source.get("sha256"),  # hashed once, when data_processing read it
        }
        for key in ("dataset", "config", "split", "revision"):
            if key in source:
                row[key] = source[key]
        rows.append(row)
    return rows


def lineage_datasets(metadata: Mapping[str, Any], data: Mapping[str, Any]) -> list[tuple[Any, str]]:
    """The MLflow datasets and their contexts for ``metadata`` (the token ``metadata.json``).

    Args:
        metadata: The data stage's metadata (``sources``, ``splits``, ``fingerprint``).
        data: The ``data`` parameters (``source``, ``raw_dir``, ``hub_*``, ``token_dir``).
    """
    import pandas as pd
    from mlflow.data import from_pandas
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    section = section_from_params(DataSection, data)
    rows = _raw_rows(metadata)
    if section.source == "hub":
        source: Any = HuggingFaceDatasetSource(
            path=section.hub_dataset, config_name=section.hub_config, split=section.hub_split
        )
    else:
        source = _location(section.raw_dir)
    raw_digest = hashlib.sha256(
        "".join(f"{r['name']}:{r['size_bytes']}:{r['sha256']}" for r in rows).encode()
    ).hexdigest()[:16]
    out = [
        (
            from_pandas(pd.DataFrame(rows), source=source, name="c4-raw", digest=raw_digest),
            RAW_CONTEXT,
        )
    ]
    token_dir = _location(section.token_dir)
    fingerprint = str(token_fingerprints(metadata).get("data_fingerprint") or "")
    splits = metadata.get("splits") or {}
    for split in SPLITS:
        info = splits.get(split)
        if not info:
            continue
        row = {
            "split": split,
            "file": info.get("file"),
            "bytes": info.get("bytes"),
            "sha256": info.get("sha256"),
            "documents": info.get("documents"),
            "tokens": info.get("tokens"),
            "fingerprint": fingerprint,
            "tokenizer": (metadata.get("tokenizer") or {}).get("name")
            if isinstance(metadata.get("tokenizer"), Mapping)
            else metadata.get("tokenizer"),
        }
        digest = (str(info.get("sha256") or fingerprint) or split)[:16]
        dataset = from_pandas(
            pd.DataFrame([row]),
            source=f"{token_dir}/{info.get('file') or f'{split}.bin'}",
            name=f"tokens-{split}",
            digest=digest,
        )
        out.append((dataset, split))
    return out


def log_lineage(run_id: str, metadata: Mapping[str, Any], data: Mapping[str, Any]) -> int:
    """Log the lineage datasets into ``run_id``; returns how many were logged."""
    from mlflow import MlflowClient
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = [
        DatasetInput(
            dataset=dataset._to_mlflow_entity(),
            tags=[InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)],
        )
        for dataset, context in lineage_datasets(metadata, data)
    ]
    MlflowClient().log_inputs(run_id, datasets=inputs)
    return len(inputs)
