"""Where a checkpoint lives on disk and what makes it complete.

``{folder}/step-{n}/`` holds the DCP files and ``metadata.json``, which rank 0 writes
last. Only a folder named exactly ``step-{n}`` with a ``metadata.json`` is a checkpoint;
``step-{n}.tmp`` (a save in progress), ``step-{n}.old.tmp`` (a copy being replaced) and
``step-{n}.deleting`` (a copy being pruned) never are. What ``metadata.json`` holds, and
its one reader and writer: ``metadata.CheckpointMetadata``. ``folder`` may be an
object-storage URI (``s3://…``, ``storage.as_path``): there the save is written into
``step-{n}/`` directly and ``metadata.json``, written last, is the completion marker
(``train.checkpoint.object_publish``).
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_kedro.storage import StoragePath, as_path

METADATA = "metadata.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""The name of a published checkpoint folder; group 1 is the step."""


def step_dir(folder: str | Path, step: int) -> StoragePath:
    """The final folder of the checkpoint taken after optimizer step ``step``."""
    return as_path(folder, "checkpoint.folder") / f"step-{step}"


def is_checkpoint(path: StoragePath) -> bool:
    """True for a published, complete ``step-{n}`` folder."""
    return bool(STEP_DIR.match(path.name)) and (path / METADATA).is_file()
