"""TokenFilesDataset (save/load, checksums, fingerprint) and token_store.open_split."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
from kedro.io import DatasetError

from titan_kedro.data.token_store import open_split
from titan_kedro.datasets import shard_file_dataset, token_files_dataset
from titan_kedro.datasets.token_files_dataset import TokenFilesDataset


def _save(path: Path, train: object, validation: object, fp: str = "tokfp") -> TokenFilesDataset:
    dataset = TokenFilesDataset(path=str(path))
    dataset.save(
        {
            "splits": {"train": train, "validation": validation},
            "metadata": {"tokenizer": {"name": "t", "fingerprint": fp}},
        }
    )
    return dataset


def test_chunks_stream_to_little_endian_uint32_files(tmp_path: Path) -> None:
    chunks = [np.array([1, 2, 3], dtype=np.uint32), np.array([2**32 - 1], dtype=np.uint32)]
    dataset = _save(tmp_path / "tok", iter(chunks), np.array([5, 6], dtype=np.uint32))
    raw = (tmp_path / "tok" / "train.bin").read_bytes()
    assert raw == b"".join(int(v).to_bytes(4, "little") for v in (1, 2, 3, 2**32 - 1))
    loaded = dataset.load()
    assert loaded["train"].tolist() == [1, 2, 3, 2**32 - 1]
    assert isinstance(loaded["train"], np.memmap)
    meta = loaded["metadata"]
    assert meta["splits"]["validation"]["tokens"] == 2
    assert len(meta["splits"]["train"]["sha256"]) == 64
    assert meta["fingerprint"] == meta["data_fingerprint"]
    assert open_split(tmp_path / "tok", "validation").tolist() == [5, 6]


def test_fingerprint_follows_content_and_tokenizer(tmp_path: Path) -> None:
    a = np.arange(10, dtype=np.uint32)
    first = _save(tmp_path / "a", a, a[:3]).load()["metadata"]["fingerprint"]
    same = _save(tmp_path / "b", [a[:4], a[4:]], a[:3]).load()["metadata"]["fingerprint"]
    other_data = _save(tmp_path / "c", a[::-1].copy(), a[:3]).load()["metadata"]["fingerprint"]
    other_tok = _save(tmp_path / "d", a, a[:3], fp="x").load()["metadata"]["fingerprint"]
    assert first == same
    assert len({first, other_data, other_tok}) == 3


def test_token_count_mismatch_fails_and_leaves_no_partial_files(tmp_path: Path) -> None:
    dataset = TokenFilesDataset(path=str(tmp_path / "tok"))
    with pytest.raises(DatasetError, match="wrote 3 tokens but its metadata says 4"):
        dataset.save(
            {
                "splits": {"train": np.arange(3, dtype=np.uint32)},
                "metadata": {"splits": {"train": {"tokens": 4}}},
            }
        )
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == []
    assert not dataset.exists()


def test_open_split_errors_say_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="kedro run --pipelines data_processing"):
        open_split(tmp_path, "train")
    (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a whole number of uint32"):
        open_split(tmp_path, "train")
    (tmp_path / "validation.bin").write_bytes(b"")
    assert len(open_split(tmp_path, "validation")) == 0


@pytest.mark.parametrize("module", [token_files_dataset, shard_file_dataset])
def test_docstring_examples_run(module: object, tmp_path: Path) -> None:
    result = doctest.testmod(module, extraglobs={"tmp_path": tmp_path})  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0
