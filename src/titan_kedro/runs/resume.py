"""Finding checkpoints, and the one resolution of ``checkpoint.resume``.

``resolve_resume(root, resume)`` turns ``never | latest | <run id> | <path>`` into a
``ResumePoint``: a concrete ``step-<n>`` folder and the run id its ``metadata.json``
records (checked: 32 hex digits, a folder inside ``checkpoint.folder``). Whoever first
sees the symbolic value resolves it and hands the concrete path on: under ``kedro run``
the hook ``hooks.continue_run.ContinueRunHook`` (before the MLflow run opens), which the
training node and the workers then receive as a path; a worker started by hand resolves it
itself. A concrete path resolves to itself, so ``latest`` is never looked up twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from titan_kedro.runs.checkpoint_layout import METADATA, STEP_DIR, is_checkpoint
from titan_kedro.runs.checkpoint_metadata import (
    RUN_ID_KEY,
    RUN_ID_SHAPE,
    CheckpointMetadata,
    CheckpointRunIdError,
)
from titan_kedro.storage import StoragePath, as_path, is_remote

__all__ = [
    "RUN_ID_KEY",
    "RUN_ID_SHAPE",
    "CheckpointRunIdError",
    "ResumePoint",
    "checkpoint_run_id",
    "find_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "resolve_resume",
]


@dataclass(frozen=True)
class ResumePoint:
    """What ``checkpoint.resume`` resolved to."""

    checkpoint: StoragePath
    """The complete ``step-<n>`` folder to continue from (a ``UPath`` on object storage)."""
    run_id: str | None
    """The run it belongs to (checked), or None when its metadata records none (a worker
    started by hand without ``job.run_id``)."""
    metadata: CheckpointMetadata = field(compare=False, repr=False)
    """The checkpoint's parsed ``metadata.json``, read once here and handed on (the maths
    and schedule checks read it from here, not from the file again)."""


def list_checkpoints(folder: str | Path) -> list[tuple[int, StoragePath]]:
    """Complete checkpoints under ``folder`` as ``(step, path)``, oldest first (a
    ``step-<n>`` without ``metadata.json``, e.g. a save cut off on object storage, is none)."""
    root = as_path(folder, "checkpoint.folder")
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(folder: str | Path) -> StoragePath | None:
    """The newest complete checkpoint under ``folder`` (None if there is none)."""
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def find_checkpoint(root: str | Path, resume: str) -> StoragePath | None:
    """The checkpoint ``checkpoint.resume`` names under the checkpoint root ``root``.

    Args:
        root: ``checkpoint.folder``: run folders ``<run id>/step-<n>`` (or ``step-<n>``
            folders directly, for a worker started by hand).
        resume: ``never``; ``latest`` (the newest checkpoint of the most recently saved
            run); a run id (a folder under ``root``); or a checkpoint (or run) folder.

    Raises:
        FileNotFoundError: ``resume`` names nothing that holds a complete checkpoint.
    """
    root = as_path(root, "checkpoint.folder")
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
    named = as_path(resume, "checkpoint.resume")
    for candidate in (named,) if is_remote(named) else (root / resume, named):
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


def _subdirs(root: StoragePath) -> list[StoragePath]:
    return [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []


def checkpoint_run_id(
    checkpoint: str | Path, root: str | Path, metadata: CheckpointMetadata | None = None
) -> str | None:
    """The run id a checkpoint's ``metadata.json`` records, checked before any path use.

    Its shape (32 lowercase hex digits) is checked when the file is parsed
    (``CheckpointMetadata.read``); here, that ``root/<run id>`` stays inside ``root``.

    Args:
        checkpoint: A complete ``step-<n>`` folder.
        root: ``checkpoint.folder``, which the run's folder ``root/<run id>`` must stay in.
        metadata: The checkpoint's parsed ``metadata.json`` when already read (else read here).

    Returns:
        The run id, or None when the metadata records none.

    Raises:
        CheckpointRunIdError: The recorded ``run_id`` is not 32 hex digits, or would
            resolve outside ``root`` (e.g. ``../..`` or ``/tmp/x``, or a symbolic link).
    """
    if metadata is None:
        metadata = CheckpointMetadata.read(checkpoint)
    value = metadata.run_id
    if value is None or is_remote(root):  # no links on object storage; the shape is checked
        return value
    root_path = Path(root).resolve()
    if not (root_path / value).resolve().is_relative_to(root_path):
        raise CheckpointRunIdError(
            f"{Path(checkpoint) / METADATA}: run_id {value!r} resolves outside "
            f"checkpoint.folder '{root}' (a symbolic link?); set checkpoint.resume to "
            "another checkpoint"
        )
    return value


def resolve_resume(root: str | Path, resume: str) -> ResumePoint | None:
    """Resolve ``checkpoint.resume`` once into a concrete checkpoint, its run id and its
    parsed ``metadata.json`` (read once, here).

    Args:
        root: ``checkpoint.folder``.
        resume: ``checkpoint.resume`` (see ``find_checkpoint``).

    Returns:
        None for ``never``.

    Raises:
        FileNotFoundError: ``resume`` names no complete checkpoint.
        CheckpointMetadataError: Its ``metadata.json`` is not what titan_kedro writes.
        CheckpointRunIdError: The checkpoint's recorded run id is unsafe to use.
    """
    checkpoint = find_checkpoint(root, resume)
    if checkpoint is None:
        return None
    metadata = CheckpointMetadata.read(checkpoint)
    return ResumePoint(checkpoint, checkpoint_run_id(checkpoint, root, metadata), metadata)
