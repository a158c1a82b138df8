"""The data_processing pipeline on an in-memory catalog built from the project's catalog file."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
import yaml
from conftest import project_parameters, write_c4_shard
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from titan_kedro.data.bad_input import BadInputError
from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.sources import NoDataSourceError
from titan_kedro.data.splitting import text_hash, validation_mask
from titan_kedro.data.token_store import open_split
from titan_kedro.pipelines.data_processing import create_pipeline

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "conf" / "base" / "catalog_data_processing.yml"
LAYERS = {"raw", "intermediate", "primary", "model_input"}


@pytest.fixture(scope="module")
def test_params() -> dict[str, Any]:
    """The project's parameters as ``kedro run --env test`` sees them."""
    return project_parameters("test")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _catalog(root: Path, raw: Path, params: dict[str, Any]) -> DataCatalog:
    """The project's data_processing catalog with every ``data/…`` path moved under ``root``."""
    config = yaml.safe_load(CATALOG.read_text())
    for entry in config.values():
        for key in ("path", "filepath"):
            if key in entry:
                entry[key] = str(root / entry[key])
    config["c4_raw"]["path"] = str(raw)
    catalog = DataCatalog.from_config(config)
    catalog["params:data"] = MemoryDataset(params["data"])
    catalog["params:tokenizer"] = MemoryDataset(params["tokenizer"])
    return catalog


def _params(base: dict[str, Any], root: Path, **data: Any) -> dict[str, Any]:
    params = copy.deepcopy(base)
    params["data"].update(
        token_dir=str(root / "data/05_model_input/tokens"),
        intermediate_dir=str(root / "data/02_intermediate/c4_tokens"),
        **data,
    )
    return params


def _run(root: Path, raw: Path, params: dict[str, Any]) -> dict[str, Any]:
    catalog = _catalog(root, raw, params)
    SequentialRunner().run(create_pipeline(), catalog)
    return catalog["token_metadata"].load()


def test_catalog_layers_and_pipeline_shape() -> None:
    config = yaml.safe_load(CATALOG.read_text())
    for name, entry in config.items():
        assert entry["metadata"]["kedro-viz"]["layer"] in LAYERS, name
    assert config["c4_raw"]["type"] == "partitions.PartitionedDataset"
    assert config["token_metadata"]["metadata"]["kedro-viz"]["layer"] == "model_input"
    pipeline = create_pipeline()
    assert [n.name for n in pipeline.nodes] == [
        "clean_documents",
        "tokenize_documents",
        "split_documents",
        "pack_documents",
        "save_token_metadata",
    ]
    assert pipeline.outputs() == {"token_metadata"}
    assert set(pipeline.all_outputs()) <= set(config)


def test_sample_becomes_packed_token_files(
    c4_dir: Path, tmp_path: Path, test_params: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    params = _params(test_params, tmp_path, num_workers=1)
    meta = _run(tmp_path, c4_dir, params)
    token_dir = Path(params["data"]["token_dir"])

    # Every document, in order, as BOS + the raw library's ids + EOS, in the split its hash picks.
    (shard,) = c4_dir.iterdir()
    with gzip.open(shard, "rt", encoding="utf-8") as fh:
        docs = [json.loads(line)["text"] for line in fh]
    raw_tok = tokenizers.Tokenizer.from_file(str(_tokenizer_folder() / "tokenizer.json"))
    bos, eos = meta["bos_id"], meta["eos_id"]
    to_validation = validation_mask(np.array([text_hash(d) for d in docs], dtype=np.uint64), 0.1)
    expected: dict[str, list[int]] = {"train": [], "validation": []}
    for doc, val in zip(docs, to_validation, strict=True):
        ids = raw_tok.encode(doc, add_special_tokens=False).ids
        expected["validation" if val else "train"] += [bos, *ids, eos]
    for split in ("train", "validation"):
        assert open_split(token_dir, split).tolist() == expected[split]
        assert meta["splits"][split]["tokens"] == len(expected[split])
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == len(
        docs
    )
    assert meta["splits"]["validation"]["documents"] == int(to_validation.sum()) > 0

    assert meta["documents"] == len(docs) and meta["skipped"] == 0
    assert meta["skipped_by_reason"] == {}
    assert meta["tokenizer"]["name"] == "deepseek-ai/DeepSeek-V2-Lite"
    assert meta["splits"]["train"]["tokenizer"]["fingerprint"] == meta["tokenizer"]["fingerprint"]
    assert meta["sources"][0]["name"] == shard.name
    assert meta["sources"][0]["size_bytes"] == shard.stat().st_size
    assert meta["sources"][0]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert len(meta["fingerprint"]) == 16
    assert json.loads((token_dir / "metadata.json").read_text()) == meta

    inputs, labels = next(
        TokenLoader(
            open_split(token_dir, "train"),
            seq_len=64,
            local_batch_size=2,
            data_rank=0,
            data_ranks=1,
            seed=0,
        )
    )
    assert inputs.shape == labels.shape == (2, 64)

    # A second run reuses the tokenized shard and reproduces the same data.
    with caplog.at_level(logging.INFO, logger="titan_kedro.data.shard_tokenizing"):
        again = _run(tmp_path, c4_dir, params)
    assert "already tokenized" in caplog.text
    assert again["fingerprint"] == meta["fingerprint"]


def _tokenizer_folder() -> Path:
    from titan_kedro.data.tokenizer import build_tokenizer

    return build_tokenizer("deepseek-ai/DeepSeek-V2-Lite").files.folder


@pytest.mark.slow
def test_two_worker_processes_give_the_same_files(
    small_c4_dir: Path, tmp_path: Path, test_params: dict[str, Any]
) -> None:
    one = _run(
        tmp_path / "one", small_c4_dir, _params(test_params, tmp_path / "one", num_workers=1)
    )
    two = _run(
        tmp_path / "two", small_c4_dir, _params(test_params, tmp_path / "two", num_workers=2)
    )
    assert one["fingerprint"] == two["fingerprint"]
    assert one["splits"] == two["splits"]


def test_no_shards_fails_at_once_naming_both_fixes(
    tmp_path: Path, test_params: dict[str, Any]
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / ".gitkeep").touch()
    with pytest.raises(NoDataSourceError, match=r"data\.source: hub"):
        _run(tmp_path, raw, _params(test_params, tmp_path))


def test_bad_shard_fails_the_node_and_keeps_the_good_one(
    tmp_path: Path, test_params: dict[str, Any]
) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 50)
    (raw / "c4-train.00001.json").write_bytes(b'{"text": "ok"}\n{"url": "x"}\n"\xff"\n')
    params = _params(test_params, tmp_path, num_workers=1)
    with pytest.raises(BadInputError, match=r"c4-train\.00001\.json: 2 of 3 records skipped"):
        _run(tmp_path, raw, params)
    manifest = json.loads((Path(params["data"]["intermediate_dir"]) / "manifest.json").read_text())
    assert [e["name"] for e in manifest["shards"].values()] == ["c4-train.00000.json.gz"]

    # Allowing that share of bad records lets the run finish with the skips reported.
    params["data"]["max_bad_fraction"] = 0.7
    meta = _run(tmp_path, raw, params)
    assert meta["skipped"] == 2
    assert meta["skipped_by_reason"] == {"invalid_utf8": 1, "missing_text": 1}
    assert meta["documents"] == 51


def test_catalog_and_token_dir_must_agree(
    small_c4_dir: Path, tmp_path: Path, test_params: dict[str, Any]
) -> None:
    params = _params(test_params, tmp_path, num_workers=1)
    params["data"]["token_dir"] = str(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"token_files folder is not data\.token_dir"):
        _run(tmp_path, small_c4_dir, params)
