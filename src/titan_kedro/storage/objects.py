"""What object storage offers instead of POSIX's atomic ``link``, ``O_EXCL`` and ``rename``.

S3 (and SeaweedFS, MinIO) are strongly consistent per object and support conditional
writes: ``PUT`` with ``If-None-Match: *`` creates an object only if none exists
(:func:`create_exclusive`), ``If-Match: <etag>`` replaces it only if it is still the
version read (:func:`replace_if_unchanged`). There is no rename of a "folder": a prefix is
many objects, so publishing marks completion with an object written last instead.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import fsspec

_PRECONDITION = ("precondition", "pre-condition", "412")


def filesystem(location: str | os.PathLike[str]) -> tuple[Any, str]:
    """The fsspec file system serving ``location`` and the path within it."""
    return fsspec.core.url_to_fs(str(location))


def _precondition_failed(err: BaseException) -> bool:
    text = f"{err} {err.__cause__ or ''}".lower()
    return isinstance(err, FileExistsError) or any(word in text for word in _PRECONDITION)


def create_exclusive(location: str | os.PathLike[str], data: bytes) -> bool:
    """Create the object ``location`` holding ``data`` unless it exists (atomic).

    Returns:
        False when an object was already there (nothing written).
    """
    fs, path = filesystem(location)
    try:
        fs.pipe_file(path, data, mode="create")
    except OSError as err:
        if _precondition_failed(err):
            return False
        raise
    return True


def etag_and_modified(location: str | os.PathLike[str]) -> tuple[str, float] | None:
    """The object's version tag and last-modified time (seconds since the epoch), or None
    when it does not exist."""
    fs, path = filesystem(location)
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    modified = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if isinstance(modified, datetime):
        modified = modified.timestamp()
    return str(info.get("ETag") or info.get("etag") or ""), float(modified or 0.0)


def replace_if_unchanged(location: str | os.PathLike[str], data: bytes, etag: str) -> bool:
    """Overwrite the object with ``data`` only if its version is still ``etag`` (atomic
    on S3: ``If-Match``).

    Returns:
        False when the object changed or vanished since ``etag`` was read.

    Raises:
        NotImplementedError: Not an S3 file system.
    """
    fs, path = filesystem(location)
    if not hasattr(fs, "call_s3"):
        raise NotImplementedError(
            f"{location}: a compare-and-swap write (the run lock's take-over and heartbeat) "
            "is implemented for S3 and S3-compatible servers (s3://) only"
        )
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag)
    except (OSError, FileNotFoundError) as err:
        if _precondition_failed(err) or isinstance(err, FileNotFoundError):
            return False
        raise
    fs.invalidate_cache(path)
    return True


def read_bytes(location: str | os.PathLike[str]) -> bytes:
    """The whole object (raises ``FileNotFoundError`` when missing)."""
    fs, path = filesystem(location)
    return fs.cat_file(path)


def remove_prefix(location: str | os.PathLike[str]) -> None:
    """Delete every object under ``location`` (a "folder"); nothing there is fine."""
    fs, path = filesystem(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    if hasattr(fs, "call_s3"):  # a folder entry some servers keep (SeaweedFS: "<prefix>/")
        bucket, key, _ = fs.split_path(path)
        if key:
            fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
    fs.invalidate_cache(path)


def remove(location: str | os.PathLike[str]) -> None:
    """Delete one object; a missing one is fine."""
    fs, path = filesystem(location)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)
