"""``TokenFilesDataset``: packed ``uint32`` token files plus ``metadata.json`` in one folder."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from kedro.io import AbstractDataset, DatasetError

from titan_kedro.data.packing import data_fingerprint
from titan_kedro.data.remote_tokens import cached_copy
from titan_kedro.data.token_store import (
    METADATA_FILE,
    TokenFileWriter,
    open_tokens,
    read_token_metadata,
    split_path,
    write_json_atomic,
)
from titan_kedro.storage import as_path, is_remote


class TokenFilesDataset(AbstractDataset[Mapping[str, Any], dict[str, Any]]):
    """Saves token streams as little-endian ``uint32`` files and loads them memory-mapped.

    ``save`` takes ``{"splits": {name: array or iterable of arrays}, "metadata": dict}``. Each
    split is streamed chunk by chunk to ``<name>.bin`` (so it never has to fit in memory),
    and ``metadata.json`` is written last, completed with each split's token count, byte
    size and sha256, plus a top-level ``fingerprint`` of the data. A split whose metadata
    already states ``tokens`` must match what was written. ``load`` returns
    ``{name: np.memmap, …, "metadata": dict}``.

    Example:
        >>> import numpy as np
        >>> from titan_kedro.datasets.token_files_dataset import TokenFilesDataset
        >>> dataset = TokenFilesDataset(path=str(tmp_path / "tokens"))
        >>> dataset.save({"splits": {"train": np.array([0, 7, 1], dtype=np.uint32)},
        ...               "metadata": {"tokenizer": {"fingerprint": "abc"}}})
        >>> loaded = dataset.load()
        >>> loaded["train"].tolist(), loaded["metadata"]["splits"]["train"]["tokens"]
        ([0, 7, 1], 3)
    """

    def __init__(self, *, path: str, metadata: dict[str, Any] | None = None) -> None:
        """Create the dataset.

        Args:
            path: Folder for ``<split>.bin`` and ``metadata.json`` (``data.token_dir``); a
                local path or an object-storage URI (``s3://…``).
            metadata: Free-form metadata (kedro-viz layer, …), ignored by Kedro.
        """
        self._path = as_path(path, "token_files.path")
        self.metadata = metadata

    def load(self) -> dict[str, Any]:
        try:
            meta = read_token_metadata(self._path)
        except FileNotFoundError as err:
            raise DatasetError(str(err)) from err
        loaded: dict[str, Any] = {"metadata": meta}
        for name, info in meta.get("splits", {}).items():
            file = self._path / info.get("file", f"{name}.bin")
            tokens = open_tokens(cached_copy(str(file)) if is_remote(file) else file)
            if len(tokens) != info["tokens"]:
                raise DatasetError(
                    f"{self._path}/{name}.bin holds {len(tokens)} tokens but metadata.json says "
                    f"{info['tokens']}; the folder is inconsistent — re-run data_processing"
                )
            loaded[name] = tokens
        return loaded

    def save(self, data: Mapping[str, Any]) -> None:
        if "splits" not in data:
            raise DatasetError(
                "TokenFilesDataset.save expects {'splits': {...}, 'metadata': {...}}"
            )
        meta: dict[str, Any] = dict(data.get("metadata") or {})
        split_meta: dict[str, Any] = {k: dict(v) for k, v in (meta.get("splits") or {}).items()}
        if not is_remote(self._path):
            self._path.mkdir(parents=True, exist_ok=True)
        # A folder without metadata.json is visibly incomplete while the splits are rewritten.
        (self._path / METADATA_FILE).unlink(missing_ok=True)
        writers: list[TokenFileWriter] = []
        try:
            for name, content in data["splits"].items():
                writer = TokenFileWriter(split_path(self._path, name))
                writers.append(writer)
                chunks: Iterable[np.ndarray] = (
                    [content] if isinstance(content, np.ndarray) else content
                )
                for chunk in chunks:
                    writer.append(chunk)
                expected = split_meta.get(name, {}).get("tokens")
                if expected is not None and expected != writer.count:
                    raise DatasetError(
                        f"split {name!r}: wrote {writer.count} tokens but its metadata says {expected}"
                    )
                split_meta[name] = {
                    **split_meta.get(name, {}),
                    "file": f"{name}.bin",
                    "tokens": writer.count,
                    "bytes": writer.count * writer.dtype.itemsize,
                    "sha256": writer.sha256,
                }
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
        for writer in writers:
            writer.commit()
        meta["splits"] = split_meta
        meta["dtype"] = "uint32"
        meta["byte_order"] = "little"
        tokenizer_fp = str((meta.get("tokenizer") or {}).get("fingerprint", ""))
        meta["fingerprint"] = data_fingerprint(
            tokenizer_fp, {name: info["sha256"] for name, info in split_meta.items()}
        )
        meta["data_fingerprint"] = meta["fingerprint"]  # the key MLflow tagging looks for
        write_json_atomic(self._path / METADATA_FILE, meta)

    def _exists(self) -> bool:
        return (self._path / METADATA_FILE).is_file()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}
