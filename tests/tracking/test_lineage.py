"""Dataset lineage: raw shards and token splits become MLflow dataset inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlflow
from mlflow_store import migrated_store

from titan_kedro.tracking.lineage import log_lineage


def test_raw_and_token_splits_are_logged_with_contexts(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    shard = raw / "c4-0000.json"
    shard.write_text(json.dumps({"text": "a document"}) + "\n", encoding="utf-8")
    metadata = {
        "fingerprint": "f" * 64,
        "tokenizer": {"name": "tok"},
        "sources": [
            {
                "name": shard.name,
                "path": str(shard),
                "size_bytes": shard.stat().st_size,
                "documents": 1,
                "tokens": 4,
                "skipped": 0,
                "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
            },
        ],
        "splits": {
            "train": {
                "documents": 1,
                "tokens": 4,
                "file": "train.bin",
                "bytes": 16,
                "sha256": "a" * 64,
            },
            "validation": {
                "documents": 0,
                "tokens": 0,
                "file": "validation.bin",
                "bytes": 0,
                "sha256": "b" * 64,
            },
        },
    }
    data = {"source": "local", "raw_dir": str(raw), "token_dir": str(tmp_path / "tokens")}
    mlflow.set_tracking_uri(migrated_store(tmp_path / "mlflow.db"))
    mlflow.set_experiment("lineage-test")  # not an id left over by another test
    try:
        with mlflow.start_run() as run:
            assert log_lineage(run.info.run_id, metadata, data) == 3
        inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    finally:
        mlflow.set_tracking_uri(None)
    by_name = {i.dataset.name: i for i in inputs}
    contexts = {
        name: {t.key: t.value for t in i.tags}["mlflow.data.context"] for name, i in by_name.items()
    }
    assert contexts == {"c4-raw": "raw", "tokens-train": "train", "tokens-validation": "validation"}
    profile = json.loads(by_name["tokens-train"].dataset.profile)
    assert profile["num_rows"] == 1
    assert by_name["tokens-train"].dataset.digest == "a" * 16
    schema = json.loads(by_name["c4-raw"].dataset.schema)["mlflow_colspec"]
    assert {"name", "size_bytes", "sha256"} <= {c["name"] for c in schema}
    source = json.loads(by_name["c4-raw"].dataset.source)
    assert source["uri"] == str(raw.resolve())
    expected = hashlib.sha256(shard.read_bytes()).hexdigest()
    raw_digest = hashlib.sha256(
        f"{shard.name}:{shard.stat().st_size}:{expected}".encode()
    ).hexdigest()[:16]
    assert by_name["c4-raw"].dataset.digest == raw_digest


def test_object_storage_locations_are_shown_as_uris_with_the_same_digests(tmp_path: Path) -> None:
    from titan_kedro.tracking.lineage import lineage_datasets

    metadata = {
        "fingerprint": "f" * 64,
        "sources": [{"name": "c4-0.json.gz", "size_bytes": 5, "sha256": "c" * 64}],
        "splits": {"train": {"file": "train.bin", "tokens": 4, "sha256": "a" * 64}},
    }

    def described(raw_dir: str, token_dir: str) -> dict[str, tuple[str, str]]:
        data = {"source": "local", "raw_dir": raw_dir, "token_dir": token_dir}
        return {
            d.name: (json.loads(d.source.to_json())["uri"], d.digest)
            for d, _ in lineage_datasets(metadata, data)
        }

    remote = described("s3://corpus/c4/", "s3://corpus/tokens")
    local = described(str(tmp_path / "c4"), str(tmp_path / "tokens"))
    assert remote["c4-raw"][0] == "s3://corpus/c4"
    assert remote["tokens-train"][0] == "s3://corpus/tokens/train.bin"
    assert local["tokens-train"][0] == str(tmp_path / "tokens" / "train.bin")
    assert {k: v[1] for k, v in remote.items()} == {k: v[1] for k, v in local.items()}
