"""The shard manifest: re-runs redo only new or changed shards; failures keep earlier shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import write_c4_shard
from data_helpers import offline_tokenizer

from titan_kedro.data import batch_encoding
from titan_kedro.data.bad_input import BadInputError
from titan_kedro.data.shard_store import ManifestPathError, ShardStore
from titan_kedro.data.shard_tokenizing import tokenize_sources
from titan_kedro.data.sources import ShardFile


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the documents that actually go through the encoder."""
    counts: list[int] = []
    real = batch_encoding.encode_texts

    def counting(backend, texts):  # type: ignore[no-untyped-def]
        counts.append(len(texts))
        return real(backend, texts)

    monkeypatch.setattr(batch_encoding, "encode_texts", counting)
    return counts


def _run(raw: Path, store: ShardStore, **kwargs: object) -> list[dict]:
    shards = [ShardFile.from_path(p) for p in sorted(raw.glob("*.json*"))]
    return tokenize_sources(
        shards, offline_tokenizer(), store, batch_size=16, num_workers=1, **kwargs
    )


def test_rerun_and_new_shards_only_process_what_is_new(tmp_path: Path, encoded: list[int]) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 40, seed=0)
    write_c4_shard(raw / "c4-train.00001.json.gz", 30, seed=1)
    store = ShardStore(tmp_path / "inter")

    first = _run(raw, store)
    assert sum(encoded) == 70
    assert [e["documents"] for e in first] == [40, 30]
    assert len(store.manifest()) == 2

    encoded.clear()
    again = _run(raw, store)
    assert sum(encoded) == 0
    assert again == first

    write_c4_shard(raw / "c4-train.00002.json.gz", 25, seed=2)
    encoded.clear()
    third = _run(raw, store)
    assert sum(encoded) == 25
    assert third[:2] == first and third[2]["documents"] == 25

    # A changed shard (new size and mtime) is redone and replaces its old entry.
    write_c4_shard(raw / "c4-train.00001.json.gz", 35, seed=7)
    os.utime(raw / "c4-train.00001.json.gz", ns=(1, 1))
    encoded.clear()
    fourth = _run(raw, store)
    assert sum(encoded) == 35
    assert [e["documents"] for e in fourth] == [40, 35, 25]
    names = sorted(e["name"] for e in store.manifest().values())
    assert names == ["c4-train.00000.json.gz", "c4-train.00001.json.gz", "c4-train.00002.json.gz"]
    assert len(list((tmp_path / "inter" / "shards").iterdir())) == 3


def test_bad_shard_fails_but_earlier_shards_stay_recorded(
    tmp_path: Path, encoded: list[int]
) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 40)
    bad = raw / "c4-train.00001.json"
    bad.write_text('{"text": "fine"}\n' + "not json\n" * 3 + '{"text": "also fine"}\n')
    store = ShardStore(tmp_path / "inter")
    with pytest.raises(BadInputError, match=r"c4-train\.00001\.json: 3 of 5 records skipped"):
        _run(raw, store, max_bad_fraction=0.01)
    recorded = [e["name"] for e in store.manifest().values()]
    assert recorded == ["c4-train.00000.json.gz"]
    assert not list((tmp_path / "inter" / "shards").glob("*.partial"))

    # After the fix, only the repaired shard is tokenized.
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n')
    encoded.clear()
    entries = _run(raw, store, max_bad_fraction=0.01)
    assert sum(encoded) == 2
    assert [e["documents"] for e in entries] == [40, 2]


def test_interrupted_shard_is_redone(
    tmp_path: Path, encoded: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 20, seed=0)
    write_c4_shard(raw / "c4-train.00001.json.gz", 20, seed=1)
    store = ShardStore(tmp_path / "inter")
    real = batch_encoding.encode_texts
    calls = {"n": 0}

    def dies_in_second_shard(backend, texts):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:  # batches of 16: the 3rd batch belongs to the second shard
            raise KeyboardInterrupt
        return real(backend, texts)

    monkeypatch.setattr(batch_encoding, "encode_texts", dies_in_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(raw, store)
    assert [e["name"] for e in store.manifest().values()] == ["c4-train.00000.json.gz"]

    monkeypatch.setattr(batch_encoding, "encode_texts", real)
    entries = _run(raw, store)
    assert [e["documents"] for e in entries] == [20, 20]


def test_max_documents_stops_early(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 20, seed=0)
    write_c4_shard(raw / "c4-train.00001.json.gz", 20, seed=1)
    write_c4_shard(raw / "c4-train.00002.json.gz", 20, seed=2)
    entries = _run(raw, ShardStore(tmp_path / "inter"), max_documents=30)
    assert [e["documents"] for e in entries] == [20, 10]


@pytest.mark.parametrize(
    "recorded", ["../victim", "{victim}", "shards/../../victim", ".", "shards"]
)
def test_a_manifest_folder_outside_the_shards_is_refused_not_deleted(
    tmp_path: Path, recorded: str
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    root = tmp_path / "inter"
    root.mkdir()
    store = ShardStore(root)
    folder = recorded.format(victim=victim)
    entry = {"key": "old", "name": "c4-a.json", "folder": folder, "documents": 0, "tokens": 0}
    store.manifest_path.write_text(json.dumps({"format": 1, "shards": {"old": entry}}))

    with pytest.raises(ManifestPathError, match=r"manifest.json: entry 'old' names folder"):
        store.lookup("old")
    with pytest.raises(ManifestPathError, match="refusing to read or delete"):
        store.read(entry)
    # Committing a new version of the same source used to delete the old entry's folder.
    writer = store.writer("new", "c4-a.json")
    writer.append(np.array([1, 2], dtype=np.uint32), np.array([2], dtype=np.uint32), np.zeros(1))
    with pytest.raises(ManifestPathError, match=r"entry 'old' names folder"):
        store.commit(writer, {"key": "new", "name": "c4-a.json"})
    assert (victim / "precious.txt").read_text() == "keep me"
    assert root.is_dir() and (root / "shards").is_dir()


def test_an_empty_shard_is_recorded_as_damage_and_the_others_go_on(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 40)
    (raw / "c4-train.00001.json").write_bytes(b"")
    entries = _run(raw, ShardStore(tmp_path / "inter"))
    assert [e["documents"] for e in entries] == [40, 0]
    assert entries[0]["damage"] == []
    assert entries[1]["damage"] == ["the shard holds no records (an empty file); nothing was read"]
