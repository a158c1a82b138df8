"""Where a checkpoint lives on disk and what makes it complete.

``{folder}/step-{n}/`` holds the DCP files and ``metadata.json``, which rank 0 writes
last. Only a folder named exactly ``step-{n}`` with a ``metadata.json`` is a checkpoint;
``step-{n}.tmp`` (a save in progress), ``step-{n}.old.tmp`` (a copy being replaced) and
``step-{n}.deleting`` (a copy being pruned) never are. What ``metadata.json`` holds, and
its one reader and writer: ``metadata.CheckpointMetadata``.
"""

from __future__ import annotations

import re
from pathlib import Path

METADATA = "metadata.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""The name of a published checkpoint folder; group 1 is the step."""


def step_dir(folder: str | Path, step: int) -> Path:
    """The final folder of the checkpoint taken after optimizer step ``step``."""
    return Path(folder) / f"step-{step}"


def is_checkpoint(path: Path) -> bool:
    """True for a published, complete ``step-{n}`` folder."""
    return bool(STEP_DIR.match(path.name)) and (path / METADATA).is_file()
