"""Token files on object storage (``data.token_dir`` an ``s3://`` URI), two ways to read them.

- ``cached_copy`` (what training uses): each split file is copied once per node into a
  node-local cache (``$TITAN_KEDRO_CACHE_DIR``, default ``<tmp>/titan-kedro-cache-<uid>``),
  keyed by the URI and the object's version (ETag and size), so a changed file is fetched
  again and an unchanged one never; the ranks of a node take turns on a ``flock`` and only
  the first downloads. Then it is memory-mapped like a local file: the loader runs at
  local-disk speed after one sequential download (``benchmarks/storage.py`` measures both).
- ``RangedTokens``: an array-like over the object that fetches the loader's windows with
  ranged GETs (``fs.cat_ranges``, concurrent), for files too large for a node's disk.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from titan_kedro.storage.folders import CACHE_ENV, cache_root
from titan_kedro.storage.objects import filesystem

__all__ = ["CACHE_ENV", "RangedTokens", "cache_root", "cached_copy"]

_DTYPE = np.dtype("<u4")


def _version(fs: Any, path: str) -> tuple[str, int]:
    fs.invalidate_cache(path)
    info = fs.info(path)
    return str(info.get("ETag") or info.get("mtime") or ""), int(info["size"])


def cached_copy(uri: str, cache: Path | None = None) -> Path:
    """A local copy of the object ``uri``, downloaded once per node and version.

    Raises:
        FileNotFoundError: No object at ``uri``.
        OSError: The download was cut short (its size differs from the object's).
    """
    fs, path = filesystem(uri)
    etag, size = _version(fs, path)
    key = hashlib.sha256(f"{uri}\0{etag}\0{size}".encode()).hexdigest()[:24]
    folder = (cache or cache_root()) / key
    final = folder / path.rsplit("/", 1)[-1]
    if final.is_file() and final.stat().st_size == size:
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait for this download
        if final.is_file() and final.stat().st_size == size:
            return final
        part = folder / f"{final.name}.part-{os.getpid()}"
        try:
            fs.get_file(path, str(part))
            if part.stat().st_size != size:
                raise OSError(f"{uri}: downloaded {part.stat().st_size} of {size} bytes")
            os.replace(part, final)
        finally:
            part.unlink(missing_ok=True)
    return final


class RangedTokens:
    """A ``uint32`` token file on object storage read by ranged GETs, shaped like the
    1-D array ``TokenLoader`` indexes: ``tokens[windows]`` with ``windows`` a 2-D array of
    consecutive positions (one row per window) fetches one range per row, concurrently."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.path = filesystem(uri)
        _, size = _version(self.fs, self.path)
        if size % _DTYPE.itemsize:
            raise ValueError(f"{uri} is {size} bytes, not a whole number of uint32 tokens")
        self.shape = (size // _DTYPE.itemsize,)
        self.ndim = 1
        self.dtype = _DTYPE

    def __len__(self) -> int:
        return self.shape[0]

    def _read(self, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        size = _DTYPE.itemsize
        blobs = self.fs.cat_ranges(
            [self.path] * len(starts), (starts * size).tolist(), (stops * size).tolist()
        )
        return [np.frombuffer(blob, dtype=_DTYPE) for blob in blobs]

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("RangedTokens reads contiguous slices only")
            return self._read(np.array([start]), np.array([max(start, stop)]))[0]
        rows = np.asarray(index)
        if rows.ndim != 2 or not (np.diff(rows, axis=1) == 1).all():
            raise IndexError("RangedTokens reads rows of consecutive positions (windows) only")
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"window outside the {len(self)} tokens of {self.uri}")
        return np.stack(self._read(rows[:, 0], rows[:, -1] + 1))
