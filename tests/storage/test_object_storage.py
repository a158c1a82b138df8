"""The storage room against the real S3 test server (SeaweedFS): paths, conditional writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.storage_fixtures import S3Bucket
from titan_kedro.storage import as_path, is_remote, local_path
from titan_kedro.storage.objects import (
    create_exclusive,
    etag_and_modified,
    read_bytes,
    remove_prefix,
    replace_if_unchanged,
)
from titan_kedro.storage.paths import CredentialsInUriError


def test_the_test_server_gives_each_test_a_fresh_bucket_and_refuses_other_keys(
    s3_bucket: S3Bucket,
) -> None:
    import s3fs

    fs = s3_bucket.fs()
    assert fs.ls(s3_bucket.name) == []
    fs.pipe_file(f"{s3_bucket.name}/a.txt", b"x")
    stranger = s3fs.S3FileSystem(
        key=s3_bucket.server.key,
        secret="not-the-secret",
        endpoint_url=s3_bucket.server.endpoint,
        skip_instance_cache=True,
    )
    with pytest.raises(PermissionError):
        stranger.ls(s3_bucket.name)
    assert s3_bucket.server.endpoint.startswith("http://127.0.0.1:")


def test_locations_become_paths_local_or_remote(tmp_path: Path) -> None:
    assert as_path(str(tmp_path)) == tmp_path and not is_remote(tmp_path)
    assert as_path(f"file://{tmp_path}") == tmp_path
    assert local_path("s3://bucket/x") is None and local_path(str(tmp_path)) == tmp_path
    remote = as_path("s3://bucket/ckpt") / "step-3"
    assert is_remote(remote) and str(remote) == "s3://bucket/ckpt/step-3"
    assert remote.name == "step-3" and str(remote.with_name("step-4")) == "s3://bucket/ckpt/step-4"


def test_a_uri_with_credentials_is_refused_without_showing_them() -> None:
    with pytest.raises(CredentialsInUriError, match=r"checkpoint\.folder") as caught:
        as_path("s3://AKIAXX:very-secret@bucket/ckpt", "checkpoint.folder")
    assert "very-secret" not in str(caught.value) and "AKIAXX" not in str(caught.value)


def test_exclusive_create_and_compare_and_swap_on_the_server(s3_bucket: S3Bucket) -> None:
    lock = f"{s3_bucket.uri}/run/writer.lock"
    assert create_exclusive(lock, b"first")
    assert not create_exclusive(lock, b"second")
    assert read_bytes(lock) == b"first"
    found = etag_and_modified(lock)
    assert found is not None
    etag, _modified = found
    assert replace_if_unchanged(lock, b"third", etag)
    assert not replace_if_unchanged(lock, b"fourth", etag)  # the version moved on
    assert read_bytes(lock) == b"third"
    assert etag_and_modified(f"{s3_bucket.uri}/run/none") is None
    remove_prefix(f"{s3_bucket.uri}/run")
    assert etag_and_modified(lock) is None


def test_compare_and_swap_outside_s3_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match=r"S3-compatible servers \(s3://\) only"):
        replace_if_unchanged("memory://bucket/run/writer.lock", b"x", '"etag"')
