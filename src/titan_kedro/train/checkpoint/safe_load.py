"""Loading checkpoints without running code hidden in them.

Every load path (resume, evaluation, export, ``load_model_weights``) reads DCP's
``.metadata`` through ``SafeFileSystemReader``, whose unpickler admits only DCP's metadata
classes, torch dtypes/sizes and a few builtins, so a crafted checkpoint cannot run code,
and whose storage entries must each name a file inside the checkpoint folder, so a crafted
checkpoint cannot make a load read another file; the other non-tensor values are read with ``torch.load(weights_only=True)``
(``SafeLoadPlanner``). A checkpoint on object storage (an ``s3://`` URI) is read through
``SafeFsspecReader``, the same checks over fsspec.
"""

from __future__ import annotations

import io
import pickle
import posixpath
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from titan_kedro.runs.checkpoint_metadata import CheckpointMetadata
from titan_kedro.storage import is_remote

_SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        *(("builtins", name) for name in ("set", "frozenset", "slice", "list", "dict", "tuple")),
    }
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's ``.metadata`` names a global outside the allow-list (it was not run)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: DCP's metadata classes, torch dtypes and sizes, builtins."""

    def __init__(self, file: Any, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint metadata {self.source}: it references {module}.{name}, "
            "which is not a DCP metadata type (unpickling it could run code). Only load "
            "checkpoints this project wrote; delete or re-create this one"
        )


def check_storage_paths(metadata: dcp_metadata.Metadata, folder: str | Path) -> None:
    """Refuse metadata whose storage entries name a file outside ``folder``.

    DCP's reader joins each entry's ``relative_path`` to the checkpoint folder, so an
    absolute path or a ``..`` would read another checkpoint's (or any) file.

    Raises:
        UnsafeCheckpointError: An entry resolves outside ``folder`` (symlinks followed).
    """
    remote = is_remote(folder)
    root = Path() if remote else Path(folder).resolve()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not _inside(root, relative, remote=remote):
            fqn = getattr(index, "fqn", index)
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint {folder}: its .metadata stores '{fqn}' in "
                f"{relative!r}, which is not a file inside the checkpoint folder. Only load "
                "checkpoints this project wrote; delete or re-create this one"
            )


def _inside(root: Path, relative: str, *, remote: bool) -> bool:
    if remote:  # no links on object storage: a plain, relative name without ".." stays in
        normal = posixpath.normpath(relative)
        return not (relative.startswith("/") or "://" in relative or normal.startswith(".."))
    return (root / relative).resolve().is_relative_to(root)


class _SafeMetadata:
    """``read_metadata`` with the allow-list unpickler and checked storage paths."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds {type(metadata).__name__}, not DCP Metadata")
        check_storage_paths(metadata, getattr(self, "uri", self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """``FileSystemReader`` with the allow-list unpickler and checked storage paths."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """``FsspecReader`` (object storage) with the same checks as ``SafeFileSystemReader``."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.uri = str(path)


def safe_reader(path: str | Path) -> FileSystemReader:
    """The safe DCP reader for a checkpoint folder: local or on object storage."""
    return SafeFsspecReader(str(path)) if is_remote(path) else SafeFileSystemReader(str(path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that unpickles non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_dcp_load(state: dict[str, Any], path: str | Path, **kwargs: Any) -> None:
    """``dcp.load`` with the safe metadata reader and the ``weights_only`` planner.

    Raises:
        UnsafeCheckpointError: The metadata names a global outside the allow-list or a
            storage file outside ``path`` (read first, so the refusal is not buried in
            DCP's per-rank error report).
    """
    safe_reader(path).read_metadata()
    dcp.load(state, storage_reader=safe_reader(path), planner=SafeLoadPlanner(), **kwargs)


def load_model_weights(path: str | Path, model: nn.Module) -> nn.Module:
    """Load a checkpoint's model weights into a plain, unsharded model (no process group).

    Args:
        path: A ``step-<n>`` checkpoint folder.
        model: A model with the same parameter names (e.g. ``spec.build_model(args)``),
            on CPU or any device; its tensors are overwritten in place.

    Returns:
        ``model``, for chaining.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        RuntimeError: The checkpoint lacks some of the model's weights.
    """
    CheckpointMetadata.read(path)  # fails early, with advice, on an incomplete folder
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single"
            )
            safe_dcp_load(state, path, no_dist=True)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise RuntimeError(
            f"cannot load model weights from '{path}' into {type(model).__name__}: {err}"
        ) from err
    model.load_state_dict(state["model"])
    return model
