"""Token folders on the S3 test server: written, fingerprinted and read like local ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.storage_fixtures import S3Bucket
from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.remote_tokens import CACHE_ENV, RangedTokens, cached_copy
from titan_kedro.data.token_store import TokenFileWriter, open_split, read_token_metadata
from titan_kedro.datasets.token_files_dataset import TokenFilesDataset


def _save(path: str, train: np.ndarray) -> None:
    TokenFilesDataset(path=path).save(
        {
            "splits": {"train": [train[:700], train[700:]], "validation": train[:300]},
            "metadata": {"tokenizer": {"fingerprint": "tok-1"}},
        }
    )


def _batches(tokens: object) -> list[np.ndarray]:
    loader = TokenLoader(
        tokens,
        seq_len=16,
        local_batch_size=4,
        data_rank=1,
        data_ranks=2,
        seed=3,  # type: ignore[arg-type]
    )
    return [next(loader)[0].numpy() for _ in range(5)]


def test_a_token_folder_on_s3_has_the_local_fingerprint_and_batches(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    train = np.random.default_rng(0).integers(0, 50_000, 2_000).astype("<u4")
    local, remote = str(tmp_path / "tokens"), f"{s3_bucket.uri}/tokens"
    _save(local, train)
    _save(remote, train)
    assert s3_bucket.fs().exists(f"{s3_bucket.name}/tokens/train.bin")
    local_meta, remote_meta = read_token_metadata(local), read_token_metadata(remote)
    assert remote_meta["fingerprint"] == local_meta["fingerprint"]
    assert remote_meta["splits"] == local_meta["splits"]
    loaded = TokenFilesDataset(path=remote).load()
    assert np.array_equal(loaded["train"], train)
    expected = _batches(open_split(local, "train"))
    for got, want in zip(_batches(open_split(remote, "train")), expected, strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(_batches(RangedTokens(f"{remote}/train.bin")), expected, strict=True):
        assert np.array_equal(got, want)


def test_the_node_cache_downloads_once_per_version(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    uri = f"{s3_bucket.uri}/t/train.bin"
    fs = s3_bucket.fs()
    fs.pipe_file(uri.removeprefix("s3://"), np.arange(10, dtype="<u4").tobytes())
    first = cached_copy(uri, tmp_path)
    first.write_bytes(first.read_bytes())  # same size: a second call must reuse, not fetch
    stamp = first.stat().st_mtime_ns
    assert cached_copy(uri, tmp_path) == first and first.stat().st_mtime_ns == stamp
    fs.pipe_file(uri.removeprefix("s3://"), np.arange(12, dtype="<u4").tobytes())
    second = cached_copy(uri, tmp_path)
    assert second != first and np.fromfile(second, "<u4").tolist() == list(range(12))


def test_an_aborted_token_file_leaves_no_object(s3_bucket: S3Bucket) -> None:
    writer = TokenFileWriter(f"{s3_bucket.uri}/tokens/train.bin")
    writer.append(np.arange(100, dtype="<u4"))
    writer.abort()
    assert not s3_bucket.fs().exists(f"{s3_bucket.name}/tokens/train.bin")
