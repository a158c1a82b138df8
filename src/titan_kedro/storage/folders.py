"""Whole folders to and from object storage: upload with one object last, node-local copies.

``upload_folder`` puts every file of a local folder under a URI prefix and the one named
``last`` after all others (a completion marker). ``download_folder`` copies a prefix into
the node-local cache (``$TITAN_KEDRO_CACHE_DIR``, default ``<tmp>/titan-kedro-cache-<uid>``)
once per node and content: the copy is keyed by the URI and every object's ETag and size,
the ranks of a node take turns on a ``flock``, and a copy appears by one ``rename``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from titan_kedro.storage.objects import filesystem

CACHE_ENV = "TITAN_KEDRO_CACHE_DIR"


def cache_root() -> Path:
    """The node-local cache folder (``$TITAN_KEDRO_CACHE_DIR`` or under the temp folder)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"titan-kedro-cache-{os.getuid()}"


def list_folder(uri: str) -> dict[str, dict[str, Any]]:
    """The objects under ``uri``: relative name → fsspec info (folder entries left out)."""
    fs, root = filesystem(uri)
    fs.invalidate_cache(root)
    root = root.rstrip("/")
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    return {
        key[len(root) + 1 :]: info
        for key, info in found.items()
        if info.get("type") == "file" and key.startswith(root + "/") and not key.endswith("/")
    }


def upload_folder(local: Path, uri: str, *, last: str | None = None) -> list[str]:
    """Put every file under ``local`` below ``uri``; ``last`` (a relative name) goes last.

    Returns:
        The relative names uploaded.
    """
    fs, root = filesystem(uri)
    root = root.rstrip("/")
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    for name in sorted(names, key=lambda n: n == last):
        fs.put_file(str(local / name), f"{root}/{name}")
    fs.invalidate_cache(root)
    return names


def download_folder(uri: str, cache: Path | None = None) -> Path:
    """A local copy of everything under ``uri``, fetched once per node and content.

    Raises:
        FileNotFoundError: Nothing is stored under ``uri``.
    """
    listing = list_folder(uri)
    if not listing:
        raise FileNotFoundError(f"nothing is stored under {uri}")
    version = "".join(
        f"{name}\0{info.get('ETag', '')}\0{info.get('size')}\n"
        for name, info in sorted(listing.items())
    )
    key = hashlib.sha256(f"{uri}\n{version}".encode()).hexdigest()[:24]
    root = cache or cache_root()
    final = root / key / uri.rstrip("/").rsplit("/", 1)[-1]
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fs, prefix = filesystem(uri)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait for this download
        if final.is_dir():
            return final
        part = final.with_name(f"{final.name}.part-{os.getpid()}")
        try:
            for name in listing:
                (part / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{prefix.rstrip('/')}/{name}", str(part / name))
            os.rename(part, final)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return final
