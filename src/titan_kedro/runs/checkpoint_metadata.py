"""``CheckpointMetadata``: a checkpoint's ``metadata.json``, written and parsed in one place.

Rank 0 writes it last into a save (``CheckpointManager.save`` → ``write``), so its
presence marks a complete checkpoint; every reader goes through ``read`` (one parse, the
types checked, the run id's shape checked before anything uses it as a folder name).

Fields: ``step``, ``world_size``, ``saved_at``, ``loss``, ``run_id``, ``config`` (the
resolved job config the workers trained with, ``JobConfig.model_dump(mode="json")``),
``math`` (settings derived from it that a continued run must keep: the effective global
batch, the token fingerprints, and the model and sequence keys that older checkpoints,
saved without ``config``, are compared on) and ``schedule`` (steps and learning-rate
settings, reported when a continued run changes them). ``runs.identity`` decides what
a continued run may change.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from titan_kedro.runs.checkpoint_layout import METADATA
from titan_kedro.storage import as_path

RUN_ID_KEY = "run_id"
"""The key of a checkpoint's ``metadata.json`` that names its run."""
RUN_ID_SHAPE = re.compile(r"^[0-9a-f]{32}$")
"""An MLflow run id, and the ids ``runs.identity.new_run_id`` generates without MLflow."""

logger = logging.getLogger(__name__)


class CheckpointMetadataError(ValueError):
    """A checkpoint's ``metadata.json`` is not what titan_kedro writes (a wrong type, say)."""


class CheckpointRunIdError(CheckpointMetadataError):
    """A checkpoint's ``metadata.json`` names a run id that is no run id (a path, say)."""


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything a checkpoint's ``metadata.json`` holds (validated on construction)."""

    step: int
    """The optimizer step the checkpoint was taken after."""
    world_size: int | None = None
    """Ranks that wrote it (None only in files not written by the trainer)."""
    saved_at: str | None = None
    """Local time of the save (``%Y-%m-%dT%H:%M:%S%z``)."""
    loss: float | None = None
    """The training loss of the last step before the save."""
    run_id: str | None = None
    """The run it belongs to (32 lowercase hex digits), or None for a worker started by
    hand without ``job.run_id``."""
    config: Mapping[str, Any] | None = field(default=None, repr=False)
    """The resolved job config the workers trained with (JSON); None in checkpoints of
    older titan_kedro versions."""
    math: Mapping[str, Any] = field(default_factory=dict)
    """Derived settings a continued run must keep (``runs.identity.math_settings``)."""
    schedule: Mapping[str, Any] = field(default_factory=dict)
    """Settings a continued run may change and that are reported (``schedule_settings``)."""

    def __post_init__(self) -> None:
        _validate(self, "checkpoint metadata")

    @classmethod
    def from_dict(cls, raw: Any, where: str = "checkpoint metadata") -> CheckpointMetadata:
        """Parse a loaded ``metadata.json``.

        Args:
            raw: The loaded JSON.
            where: Names the file in error messages.

        Raises:
            CheckpointMetadataError: A field is missing or of the wrong type.
            CheckpointRunIdError: ``run_id`` is not 32 lowercase hex digits.
        """
        if not isinstance(raw, Mapping):
            raise CheckpointMetadataError(
                f"{where}: expected a JSON object, found {type(raw).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            logger.warning("%s: ignoring unknown keys %s", where, ", ".join(unknown))
        if "step" not in raw:
            raise CheckpointMetadataError(
                f"{where}: no 'step'; this file was not written by titan_kedro's trainer"
            )
        values = {k: v for k, v in raw.items() if k in known}
        if isinstance(values.get("loss"), int) and not isinstance(values["loss"], bool):
            values["loss"] = float(values["loss"])
        _validate_values(values, where)
        return cls(**values)

    @classmethod
    def read(cls, checkpoint: str | Path) -> CheckpointMetadata:
        """The parsed ``metadata.json`` of a checkpoint folder (the one reader).

        Raises:
            FileNotFoundError: ``checkpoint`` is not a complete checkpoint.
            CheckpointMetadataError: The file is not what titan_kedro writes.
        """
        file = as_path(checkpoint) / METADATA
        if not file.is_file():
            raise FileNotFoundError(
                f"'{checkpoint}' is not a complete checkpoint (no {METADATA}); pick a step-<n> "
                "folder written by the trainer, e.g. latest_checkpoint(checkpoint.folder)"
            )
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise CheckpointMetadataError(f"{file}: not valid JSON ({err})") from err
        return cls.from_dict(raw, str(file))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``write`` stores (None fields left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def write(self, checkpoint: str | Path) -> Path:
        """Write ``metadata.json`` into ``checkpoint`` (rank 0, last file of a save; on
        object storage one PUT, which is atomic: the object appears whole or not at all)."""
        path = as_path(checkpoint) / METADATA
        path.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")
        return path


def read_checkpoint_metadata(checkpoint: str | Path) -> CheckpointMetadata:
    """``CheckpointMetadata.read``: a checkpoint folder's parsed ``metadata.json`` (not the
    token folder's, see ``titan_kedro.data.token_store.read_token_metadata``)."""
    return CheckpointMetadata.read(checkpoint)


_OPTIONAL_TYPES: dict[str, tuple[type, ...]] = {
    "world_size": (int,),
    "saved_at": (str,),
    "loss": (float,),
    "config": (Mapping,),
    "math": (Mapping,),
    "schedule": (Mapping,),
}


def _validate(meta: CheckpointMetadata, where: str) -> None:
    _validate_values({f.name: getattr(meta, f.name) for f in fields(meta)}, where)


def _validate_values(values: Mapping[str, Any], where: str) -> None:
    step = values.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointMetadataError(f"{where}: step {step!r} is not a step (an integer >= 0)")
    for name, types in _OPTIONAL_TYPES.items():
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise CheckpointMetadataError(
                f"{where}: {name} {value!r} is a {type(value).__name__}, expected "
                f"{' or '.join(t.__name__ for t in types)}"
            )
    world = values.get("world_size")
    if world is not None and world < 1:
        raise CheckpointMetadataError(f"{where}: world_size {world!r} is below 1")
    run_id = values.get(RUN_ID_KEY)
    if run_id is not None and (not isinstance(run_id, str) or not RUN_ID_SHAPE.match(run_id)):
        raise CheckpointRunIdError(
            f"{where}: run_id {run_id!r} is not a run id (32 lowercase hex digits, an MLflow "
            "run id or one titan_kedro generated), so it cannot name a folder under "
            "checkpoint.folder. This checkpoint was edited or not written by titan_kedro: "
            "set checkpoint.resume to another checkpoint, or restore its run_id"
        )
