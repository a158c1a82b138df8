"""Packed token files on disk: raw little-endian ``uint32`` streams read through ``np.memmap``.

Layout of a token folder (``data.token_dir``): ``train.bin``, ``validation.bin`` (one
packed stream each, ``BOS doc EOS BOS doc EOS …``) and ``metadata.json``. The folder may be
an object-storage URI (``s3://…``): a split is then read from a node-local copy
(``remote_tokens.cached_copy``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from titan_kedro.data.remote_tokens import cached_copy
from titan_kedro.storage import StoragePath, as_path, is_remote

TOKEN_DTYPE = np.dtype("<u4")
METADATA_FILE = "metadata.json"


def split_path(token_dir: str | Path, split: str) -> StoragePath:
    """Path of a split's token file (a ``UPath`` under an object-storage folder)."""
    return as_path(token_dir, "data.token_dir") / f"{split}.bin"


def open_tokens(path: str | Path) -> np.ndarray:
    """Read-only memory map of a ``uint32`` token file (an empty array for an empty file)."""
    p = Path(path)
    size = p.stat().st_size
    if size % TOKEN_DTYPE.itemsize:
        raise ValueError(
            f"{p} is {size} bytes, not a whole number of uint32 tokens; the file is damaged — "
            "re-run `kedro run --pipelines data_processing`"
        )
    if size == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(p, dtype=TOKEN_DTYPE, mode="r")


def open_split(token_dir: str | Path, split: str) -> np.ndarray:
    """Memory-map one split (``train`` or ``validation``) of a token folder.

    Raises:
        FileNotFoundError: The split file is missing; the message says how to create it.
    """
    path = split_path(token_dir, split)
    if not path.is_file():
        folder = as_path(token_dir)
        present = sorted(p.stem for p in folder.glob("*.bin")) if folder.is_dir() else []
        raise FileNotFoundError(
            f"no token file {path} (splits present: {', '.join(present) or 'none'}). Create the "
            "token files with `kedro run --pipelines data_processing`, or set data.token_dir"
        )
    return open_tokens(cached_copy(str(path)) if is_remote(path) else path)


def read_token_metadata(token_dir: str | Path) -> dict[str, Any]:
    """The ``metadata.json`` of a token folder (not a checkpoint's: ``read_checkpoint_metadata``)."""
    path = as_path(token_dir, "data.token_dir") / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {path}; create the token files with `kedro run --pipelines data_processing`"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def token_fingerprints(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer_fingerprint`` and ``data_fingerprint`` of a token folder's metadata.

    The data fingerprint is the top-level ``fingerprint`` (or ``data_fingerprint``); the
    tokenizer's is ``tokenizer.fingerprint`` (or ``tokenizer_fingerprint``). Missing ones
    are left out; values are as stored.
    """
    tokenizer = metadata.get("tokenizer")
    candidates = {
        "tokenizer_fingerprint": metadata.get("tokenizer_fingerprint")
        or (tokenizer.get("fingerprint") if isinstance(tokenizer, Mapping) else None),
        "data_fingerprint": metadata.get("data_fingerprint") or metadata.get("fingerprint"),
    }
    return {key: value for key, value in candidates.items() if value is not None}


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file
    (on object storage one PUT, which is atomic by itself)."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    if is_remote(path):
        as_path(path).write_text(text, encoding="utf-8")
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)


class TokenFileWriter:
    """Append arrays to a raw binary file; it appears under its final name only on ``commit``.

    Counts the items written and hashes the bytes (sha256) as they stream through. On
    object storage it streams to the final name (a multipart upload): the object appears
    whole when the upload completes at ``commit``, and ``abort`` discards it.
    """

    def __init__(self, path: str | Path, dtype: np.dtype | str = TOKEN_DTYPE) -> None:
        self.path = as_path(path, "data.token_dir")
        self.remote = is_remote(self.path)
        self.dtype = np.dtype(dtype)
        if not self.remote:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path if self.remote else self.path.with_name(f".{self.path.name}.partial")
        self._fh = self._tmp.open("wb")
        self._sha = hashlib.sha256()
        self.count = 0

    def append(self, values: np.ndarray) -> None:
        """Write ``values`` (converted to the file's dtype if needed)."""
        array = np.ascontiguousarray(values, dtype=self.dtype)
        data = memoryview(array).cast("B")
        self._fh.write(data)
        self._sha.update(data)
        self.count += int(array.size)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def commit(self) -> Path:
        """Close and move the file into place."""
        self._fh.close()
        if not self.remote:
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Close and delete the partial file."""
        if self.remote and hasattr(self._fh, "discard"):
            self._fh.discard()  # the multipart upload is aborted: no object appears
            self._fh.closed = True  # nothing left to flush when it is collected
            return
        self._fh.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._fh.closed:
            self.commit()
