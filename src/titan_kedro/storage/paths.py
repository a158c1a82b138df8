"""A location as a path object: ``pathlib.Path`` locally, ``UPath`` (fsspec) for a URI.

``as_path("s3://bucket/ckpt")`` gives a ``UPath`` with pathlib's API (``/``, ``name``,
``parent``, ``with_name``, ``is_file``, ``iterdir``, ``read_text``, ``write_text``,
``stat``), so code written against ``Path`` reads and writes object storage unchanged
where the operation means the same there. Renames do not (object storage copies and
deletes: not atomic), so code that publishes by rename asks :func:`is_remote` first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeAlias
from urllib.parse import urlsplit

from upath import UPath

StoragePath: TypeAlias = Path | UPath
"""What :func:`as_path` returns."""

_LOCAL_PROTOCOLS = frozenset({"", "file", "local"})


class CredentialsInUriError(ValueError):
    """A URI carries credentials (``s3://KEY:SECRET@bucket``); they would reach logs."""


def protocol(location: str | os.PathLike[str]) -> str:
    """The URI scheme of ``location`` (``""`` for a plain path)."""
    if isinstance(location, UPath):
        return location.protocol
    if isinstance(location, Path):
        return ""
    text = str(location)
    if "://" not in text:
        return ""
    return text.split("://", 1)[0].lower()


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a URI fsspec serves other than the local file system (``s3://``, ``gs://``)."""
    return protocol(location) not in _LOCAL_PROTOCOLS


def check_uri(location: str, where: str = "a storage location") -> None:
    """Refuse a URI with credentials in it, naming where it came from but not the secret.

    Raises:
        CredentialsInUriError: ``scheme://user:secret@…`` (or ``user@``).
    """
    if not is_remote(location):
        return
    parts = urlsplit(location)
    if "@" in (parts.netloc or ""):
        shown = f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}{parts.path}"
        raise CredentialsInUriError(
            f"{where} ({shown}) carries credentials in the URI; remove them and give them "
            "the usual way instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
            "or conf/local/credentials.yml)"
        )


def as_path(location: str | os.PathLike[str], where: str = "a storage location") -> StoragePath:
    """``location`` as a path object: ``Path`` for a local path or ``file://`` URI, else a
    ``UPath`` (fsspec; ``s3://`` needs ``s3fs``).

    Raises:
        CredentialsInUriError: The URI carries credentials.
    """
    if isinstance(location, (Path, UPath)):
        return location
    text = os.fspath(location)
    if not is_remote(text):
        return Path(text.removeprefix("file://"))
    check_uri(text, where)
    return UPath(text)


def local_path(location: str | os.PathLike[str]) -> Path | None:
    """``location`` as a ``Path`` when it is local, else None."""
    return None if is_remote(location) else Path(os.fspath(as_path(location)))
