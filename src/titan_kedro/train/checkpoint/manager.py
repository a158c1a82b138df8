"""Saving and resuming a training run's full state (every rank builds one manager).

Saved: the model and optimizer state (sharded, FQN-keyed, so a checkpoint loads under a
different FSDP layout), the LR schedule, the training counters, and per-rank state (the
data loader position and RNG states) gathered into one JSON list indexed by rank
(``encode_state``: tensors as base64, read back without unpickling). Under another world
size DCP reshards model and optimizer, and rank 0's entry gives the (global) data
position; RNG states are then reseeded. ``metadata.json`` (``metadata.CheckpointMetadata``:
the step, the world size, the loss, the run id and the resolved job config) is written here
alone; what a continued run may change is decided in ``titan_kedro.runs.identity``.

Rank 0 alone resolves the resume checkpoint, writes ``metadata.json``, publishes and
prunes (``publish``; on object storage, ``checkpoint.folder`` an ``s3://`` URI, DCP writes
through fsspec and ``object_publish`` marks completion instead of renaming); its failures
reach every rank (``rank_zero.on_rank_zero``).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_kedro.runs.checkpoint_layout import step_dir
from titan_kedro.runs.checkpoint_metadata import CheckpointMetadata, CheckpointMetadataError
from titan_kedro.runs.lock import verify_writer
from titan_kedro.runs.resume import find_checkpoint, latest_checkpoint
from titan_kedro.storage import StoragePath, as_path, is_remote
from titan_kedro.train.checkpoint.object_publish import (
    prepare_object_save,
    prune_object_checkpoints,
    sweep_unmarked,
)
from titan_kedro.train.checkpoint.publish import (
    prune_checkpoints,
    publish_folder,
    recover_interrupted_publish,
    sweep_unfinished,
)
from titan_kedro.train.checkpoint.rank_zero import on_rank_zero
from titan_kedro.train.checkpoint.safe_load import UnsafeCheckpointError, safe_dcp_load
from titan_kedro.train.save_signal import SaveSignal

logger = logging.getLogger(__name__)


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
        self.folder = as_path(folder, "checkpoint.folder")
        self.remote = is_remote(self.folder)
        self.states = states
        self.per_rank_state = per_rank_state
        self.restore_per_rank = restore_per_rank
        self.keep_latest_k = keep_latest_k
        self.enable = enable
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.last_saved: StoragePath | None = None
        self.save_signal = SaveSignal()

    def due(self, step: int, interval: int, final: bool) -> bool:
        """Whether step ``step`` saves: every ``interval`` steps, the last step, or the step
        after the scheduler's warning that the job ends soon (collective: every rank of the
        group calls it at every step)."""
        warned = self.save_signal.due()
        return step % interval == 0 or final or warned

    def save(self, step: int, metadata: CheckpointMetadata | None = None) -> StoragePath | None:
        """Write ``step-{step}`` atomically (collective: every rank calls it).

        Args:
            step: The optimizer step just taken.
            metadata: What the run records in ``metadata.json`` (run id, loss, job config,
                …; ``runs.identity.checkpoint_metadata``); ``step``, ``world_size`` and
                ``saved_at`` are set here.

        Raises:
            RankZeroError: On every rank, when rank 0 failed to prepare the folder,
                publish the save or prune old ones (e.g. a ``PermissionError``).
        """
        if not self.enable:
            return None
        final = step_dir(self.folder, step)
        # Object storage has no atomic rename: the save goes into final, marked complete last.
        tmp = final if self.remote else final.with_name(final.name + ".tmp")
        start = time.perf_counter()
        on_rank_zero(f"preparing {self.folder} for a save", lambda: self._prepare_folder(final))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, encode_state(self.per_rank_state()))
        state = {**self.states, "per_rank": json.dumps(gathered)}
        if self.remote:
            dcp.save(state, storage_writer=FsspecWriter(str(tmp), sync_files=False))
        else:
            dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        meta = replace(
            metadata or CheckpointMetadata(step=step),
            step=step,
            world_size=self.world_size,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        on_rank_zero(f"publishing {final}", lambda: self._publish(tmp, final, meta))
        on_rank_zero(f"pruning old checkpoints in {self.folder}", self._prune)
        self.last_saved = final
        logger.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - start)
        return final

    def _prepare_folder(self, final: StoragePath) -> None:
        verify_writer(self.folder)  # a writer whose run folder lock was taken over stops
        if self.remote:
            sweep_unmarked(self.folder)
            prepare_object_save(final)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        recover_interrupted_publish(self.folder)
        sweep_unfinished(self.folder)

    def _publish(self, tmp: StoragePath, final: StoragePath, meta: CheckpointMetadata) -> None:
        verify_writer(self.folder)
        meta.write(tmp)  # last: a folder with metadata.json is a complete checkpoint
        if not self.remote:
            publish_folder(tmp, final)

    def _prune(self) -> None:
        prune = prune_object_checkpoints if self.remote else prune_checkpoints
        pruned = prune(self.folder, self.keep_latest_k)
        if pruned:
            logger.info("pruned %s", ", ".join(p.name for p in pruned))

    def resolve_resume(self, resume: str, *, restarted: bool = False) -> StoragePath | None:
        """The checkpoint to resume, chosen by rank 0 and broadcast (collective).

        Args:
            resume: ``checkpoint.resume``: the concrete checkpoint the training node
                resolved (see ``resume.resolve_resume``), or, for a worker started by
                hand, anything ``find_checkpoint`` takes (relative to ``folder``).
            restarted: torchrun restarted this group: this job's own latest checkpoint in
                ``folder`` wins over ``resume``.

        Raises:
            RankZeroError: On every rank, when rank 0 could not resolve it (any error).
        """

        def choose() -> str | None:
            if not self.remote:
                recover_interrupted_publish(self.folder)
            own = latest_checkpoint(self.folder) if restarted else None
            found = own or find_checkpoint(self.folder, resume)
            return str(found) if found is not None else None

        choice = on_rank_zero(f"resolving checkpoint.resume={resume!r}", choose)
        return as_path(choice) if choice is not None else None

    def load(self, path: StoragePath) -> CheckpointMetadata:
        """Restore every state from ``path`` (collective) and return its metadata.

        Raises:
            CheckpointMetadataError: Its ``metadata.json`` records no ``world_size`` (not
                written by the trainer) or is otherwise not what titan_kedro writes.
        """
        meta = CheckpointMetadata.read(path)
        if meta.world_size is None:
            raise CheckpointMetadataError(
                f"{path}: metadata.json records no world_size, so it was not written by "
                "titan_kedro's trainer; set checkpoint.resume to another checkpoint"
            )
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
        same_world = meta.world_size == self.world_size
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
                meta.world_size,
                self.world_size,
            )
        self.last_saved = path
        return meta
