"""Publishing a finished export folder to object storage (``export.folder`` an ``s3://`` URI).

There is no atomic rename of a prefix, so completion is the marker object
(``export_folder.MARKER``, ``complete: true``) written last, as for checkpoints: the old
marker is deleted first (from then on the prefix is visibly no complete export), the new
files are uploaded, files of the old export that the new one lacks are deleted, and the
new marker goes last. A prefix that holds anything but a previous export (no marker, or
objects its marker does not list) is refused and left untouched, as a local folder is.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_kedro.models.export_folder import MARKER, ExportFolderError, mark_complete
from titan_kedro.storage import StoragePath, as_path
from titan_kedro.storage.folders import list_folder, upload_folder
from titan_kedro.storage.objects import read_bytes, remove


def _previous_files(target: str, existing: set[str]) -> set[str] | None:
    """The files a previous export's marker lists (None: no readable marker)."""
    if MARKER not in existing:
        return None
    try:
        data = json.loads(read_bytes(f"{target}/{MARKER}"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return None
    return {str(name) for name in data["files"]}


def publish_export(staging: Path, target: str) -> list[StoragePath]:
    """Upload the finished export in ``staging`` to ``target``, replacing only a previous
    export there.

    Returns:
        The objects of the new export.

    Raises:
        ExportFolderError: ``target`` holds objects that are not a previous export.
    """
    target = target.rstrip("/")
    existing = set(list_folder(target))
    if existing:
        listed = _previous_files(target, existing)
        strangers = sorted(existing - {MARKER} - (listed or set()))
        if listed is None or strangers:
            shown = ", ".join((strangers or sorted(existing))[:5])
            raise ExportFolderError(
                f"export.folder {target} holds objects that are not a previous export "
                f"({shown}); nothing was deleted. Point export.folder at an empty prefix or "
                "remove them"
            )
    names = mark_complete(staging)
    remove(f"{target}/{MARKER}")
    upload_folder(staging, target, last=MARKER)
    for stale in sorted(existing - set(names) - {MARKER}):
        remove(f"{target}/{stale}")
    root = as_path(target, "export.folder")
    return [root / name for name in names]
