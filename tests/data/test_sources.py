"""Choosing the C4 source: local shards, the hub stream (tested on local files), or a clear failure."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import write_c4_shard

from titan_kedro.config.schema import DataSection
from titan_kedro.data import sources
from titan_kedro.data.bad_input import SkipReport
from titan_kedro.data.sources import HubSource, NoDataSourceError, ShardFile, select_sources


def _both_fixes_named(message: str) -> None:
    assert "data/01_raw/c4" in message
    assert "data.source: hub" in message
    assert "data.source: local" in message


def test_no_local_shards_fails_naming_both_fixes(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("not a shard")
    with pytest.raises(NoDataSourceError) as err:
        select_sources(DataSection(), [ShardFile.from_path(readme)])
    _both_fixes_named(str(err.value))


@pytest.mark.parametrize("offline", [True, False])
def test_hub_without_network_fails_at_once_naming_both_fixes(
    monkeypatch: pytest.MonkeyPatch, offline: bool
) -> None:
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    with pytest.raises(NoDataSourceError) as err:
        select_sources(DataSection(source="hub"), [])
    _both_fixes_named(str(err.value))


def test_local_shards_are_sorted_and_filtered(tmp_path: Path) -> None:
    b = write_c4_shard(tmp_path / "c4-train.00001.json.gz", 2)
    a = write_c4_shard(tmp_path / "c4-train.00000.json.gz", 2)
    (tmp_path / ".gitkeep").touch()
    found = select_sources(
        DataSection(), [ShardFile.from_path(p) for p in (b, tmp_path / ".gitkeep", a)]
    )
    assert [s.name for s in found] == ["c4-train.00000.json.gz", "c4-train.00001.json.gz"]


def test_hub_selected_when_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    (source,) = select_sources(DataSection(source="hub", hub_max_documents=7), [])
    assert source == HubSource("allenai/c4", "en", "train", 7)


def test_hub_loading_code_streams_a_local_shard_through_the_json_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    shard = write_c4_shard(tmp_path / "c4-train.00000.json.gz", 30)
    with gzip.open(shard, "rt") as fh:
        expected = [json.loads(line)["text"] for line in fh]
    source = HubSource("json", None, "train", max_documents=12, data_files=str(shard))
    report = SkipReport(source.name)
    docs = list(source.documents(report, min_chars=1))
    assert [d.text for d in docs] == expected[:12]
    assert [d.line for d in docs] == list(range(1, 13))
    assert report.kept == 12 and report.skipped == 0
    assert source.cache_identity()["max_documents"] == 12
