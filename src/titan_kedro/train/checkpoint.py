"""Distributed checkpoints that a crash can never leave half-written.

Layout: ``{folder}/step-{n}/`` holds the ``torch.distributed.checkpoint`` (DCP) files and
``metadata.json``. A save goes to ``step-{n}.tmp``; after every rank has written its
shards, rank 0 writes ``metadata.json`` last and renames the folder. Only folders named
``step-{n}`` with a ``metadata.json`` count as checkpoints, so ``latest_checkpoint``
never returns one that cannot load.

Every load path (resume, evaluation, export, ``load_model_weights``) reads DCP's
``.metadata`` through ``SafeFileSystemReader``, whose unpickler admits only DCP's metadata
classes, torch dtypes/sizes and a few builtins, so a crafted checkpoint cannot run code.
A save fsyncs its files and folder before the rename that publishes it; a crash leaves
only a ``*.tmp`` folder, removed at the next save (a ``step-N.old.tmp`` whose replacement
never arrived is first renamed back to ``step-N``).

Saved: the model and optimizer state (sharded, FQN-keyed, so a checkpoint loads under a
different FSDP layout), the LR schedule, the training counters, and per-rank state (the
data loader position and RNG states) gathered into one JSON list indexed by rank.
Under another world size DCP reshards model and optimizer, and rank 0's entry gives the
(global) data position; RNG states are then reseeded.
Every value, tensors included, is read back with ``weights_only=True``; the run id and the
settings that change the maths are in ``metadata.json`` (see ``titan_kedro.train.run_identity``).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)

METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_dcp_load(state: dict[str, Any], path: str | Path, **kwargs: Any) -> None:
    """``dcp.load`` with the safe metadata reader and the ``weights_only`` planner.

    Raises:
        UnsafeCheckpointError: The metadata names a global outside the allow-list (read
            first, so the refusal is not buried in DCP's per-rank error report).
    """
    SafeFileSystemReader(str(path)).read_metadata()
    dcp.load(
        state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), **kwargs
    )


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves (bottom-up)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def fsync_dir(folder: Path) -> None:
    """fsync a folder so the renames inside it survive a power loss (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_folder(tmp: Path, final: Path) -> None:
    """Move a complete ``tmp`` folder to ``final``; at every moment one of them is whole.

    An existing ``final`` is renamed aside first, the new one renamed in, the old deleted.
    """
    fsync_tree(tmp)
    old = final.with_name(final.name + ".old.tmp")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_publish(folder: Path) -> list[Path]:
    """Put back a ``step-N`` that a crash between ``publish_folder``'s two renames left as
    ``step-N.old.tmp`` (a complete, published copy), so cleaning ``*.tmp`` never deletes it.

    Returns:
        The restored folders.
    """
    restored = []
    for old in sorted(folder.glob("step-*.old.tmp")) if folder.is_dir() else []:
        final = old.with_name(old.name.removesuffix(".old.tmp"))
        if _STEP_DIR.match(final.name) and not final.exists() and (old / METADATA).is_file():
            logger.warning("restoring %s from %s (a save was interrupted mid-publish)", final, old)
            old.rename(final)
            restored.append(final)
    return restored


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that unpickles non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def step_dir(folder: str | Path, step: int) -> Path:
    """The final folder of the checkpoint taken after optimizer step ``step``."""
    return Path(folder) / f"step-{step}"


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``folder`` as ``(step, path)``, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / METADATA).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (None if there is none)."""
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def find_checkpoint(root: str | Path, resume: str) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names under the checkpoint root ``root``.

    Args:
        root: ``checkpoint.folder``: run folders ``<run id>/step-<n>`` (or ``step-<n>``
            folders directly, for a worker started by hand).
        resume: ``never``; ``latest`` (the newest checkpoint of the most recently saved
            run); a run id (a folder under ``root``); or a checkpoint (or run) folder.

    Raises:
        FileNotFoundError: ``resume`` names nothing that holds a complete checkpoint.
    """
    root = Path(root)
    if resume in ("never", ""):
        return None
    if resume == "latest":
        own = latest_checkpoint(root)
        if own is not None:
            return own
        runs = [c for c in (latest_checkpoint(d) for d in _subdirs(root)) if c is not None]
        if not runs:
            raise FileNotFoundError(
                f"checkpoint.resume=latest: no run under '{root}' has a complete checkpoint; "
                "start a new run (checkpoint.resume=never) or point checkpoint.folder at the "
                "root the earlier run used"
            )
        return max(runs, key=lambda c: (c / METADATA).stat().st_mtime)
    for candidate in (root / resume, Path(resume)):
        if (candidate / METADATA).is_file():
            return candidate
        if candidate.is_dir():
            found = latest_checkpoint(candidate)
            if found is not None:
                return found
    raise FileNotFoundError(
        f"checkpoint.resume={resume!r} is neither a run id with a checkpoint under '{root}' nor "
        f"a checkpoint folder; use never, latest, a folder name under '{root}' or a "
        "step-<n> path"
    )


def _subdirs(root: Path) -> list[Path]:
    return [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``metadata.json`` of a checkpoint folder."""
    file = Path(path) / METADATA
    if not file.is_file():
        raise FileNotFoundError(
            f"'{path}' is not a complete checkpoint (no {METADATA}); pick a step-<n> folder "
            "written by the trainer, e.g. latest_checkpoint(checkpoint.folder)"
        )
    return json.loads(file.read_text(encoding="utf-8"))


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
    read_metadata(path)
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


class ModelState(Stateful):
    """The model parts as one ``Stateful`` (FQN keys, sharded tensors under FSDP)."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


def encode_state(value: Any) -> Any:
    """Make a nested state JSON-safe: tensors become ``{"__tensor__": base64, dtype, shape}``."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {
            "__tensor__": base64.b64encode(raw).decode("ascii"),
            "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
        }
    if isinstance(value, Mapping):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_state(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    return value


def decode_state(value: Any) -> Any:
    """Invert ``encode_state``."""
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, value["dtype"])
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(value["shape"]).clone()
    if isinstance(value, dict):
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value


def rng_state() -> dict[str, Any]:
    """This rank's torch RNG states (CPU, and CUDA when present)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Saves, prunes and resumes checkpoints for one training run (every rank builds one).

    Args:
        folder: ``checkpoint.folder``.
        states: Name → ``Stateful`` saved by every rank alike (model, optimizer, …).
        per_rank_state: Returns this rank's own state (data position, RNG); gathered
            into a list on save, and this rank's entry is handed to ``restore_per_rank``.
        restore_per_rank: Applies an entry on load as ``restore_per_rank(entry,
            same_world=...)``: this rank's own entry when the checkpoint's world size
            matches, else rank 0's (``same_world=False``: restore only global state).
        keep_latest_k: How many complete checkpoints to keep.
        enable: False makes ``save`` a no-op (``resume`` still works).
    """

    def __init__(
        self,
        folder: str | Path,
        states: dict[str, Any],
        *,
        per_rank_state: Any,
        restore_per_rank: Any,
        keep_latest_k: int = 2,
        enable: bool = True,
    ):
        self.folder = Path(folder)
        self.states = states
        self.per_rank_state = per_rank_state
        self.restore_per_rank = restore_per_rank
        self.keep_latest_k = keep_latest_k
        self.enable = enable
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.last_saved: Path | None = None

    def save(self, step: int, extra_metadata: Mapping[str, Any] | None = None) -> Path | None:
        """Write ``step-{step}`` atomically (collective: every rank calls it)."""
        if not self.enable:
            return None
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".tmp")
        start = time.perf_counter()
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            recover_interrupted_publish(self.folder)
            for stale in self.folder.glob("*.tmp"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, encode_state(self.per_rank_state()))
        dist.barrier()
        dcp.save({**self.states, "per_rank": json.dumps(gathered)}, checkpoint_id=str(tmp))
        dist.barrier()
        if self.rank == 0:
            meta = {
                "step": step,
                "world_size": self.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **dict(extra_metadata or {}),
            }
            (tmp / METADATA).write_text(json.dumps(meta, indent=2), encoding="utf-8")
            publish_folder(tmp, final)
            self._prune()
        dist.barrier()
        self.last_saved = final
        logger.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - start)
        return final

    def _prune(self) -> None:
        for _, path in list_checkpoints(self.folder)[: -self.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    def resolve_resume(self, resume: str, *, restarted: bool = False) -> Path | None:
        """The checkpoint to resume, chosen by rank 0 and broadcast (collective).

        Args:
            resume: ``checkpoint.resume`` (see ``find_checkpoint``; relative to ``folder``).
            restarted: torchrun restarted this group: this job's own latest checkpoint in
                ``folder`` wins over ``resume``.
        """
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                recover_interrupted_publish(self.folder)
                own = latest_checkpoint(self.folder) if restarted else None
                found = own or find_checkpoint(self.folder, resume)
                choice[0] = str(found) if found is not None else None
            except FileNotFoundError as err:
                choice[0] = err
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], Exception):
            raise FileNotFoundError(str(choice[0]))
        return Path(choice[0]) if choice[0] is not None else None

    def load(self, path: Path) -> dict[str, Any]:
        """Restore every state from ``path`` (collective) and return its metadata."""
        meta = read_metadata(path)
        loaded: dict[str, Any] = {**self.states, "per_rank": ""}
        try:
            safe_dcp_load(loaded, path)
        except UnsafeCheckpointError:
            raise
        except Exception as err:
            raise RuntimeError(
                f"cannot resume from checkpoint {path}: it does not match this model and "
                f"optimizer ({type(err).__name__}: {str(err)[:500]}). Point checkpoint.folder "
                "at a fresh folder or set checkpoint.resume: never to start over"
            ) from err
        entries = json.loads(loaded["per_rank"])
        same_world = int(meta["world_size"]) == self.world_size
        # The data position is global (rank 0's entry serves any world size); RNG states
        # are per rank and only apply when the world size matches.
        self.restore_per_rank(
            decode_state(entries[self.rank if same_world else 0]), same_world=same_world
        )
        if not same_world:
            logger.warning(
                "checkpoint %s was written by %s ranks, now %s: model and optimizer are "
                "resharded and the data position continues; RNG states are reseeded from "
                "job.seed and the rank",
                path,
                meta["world_size"],
                self.world_size,
            )
        self.last_saved = path
        return meta
