"""Replace an export folder atomically, and only when it is an export this code wrote.

An export is written into a fresh sibling folder (``.<name>.staging-<random>``) that holds
the marker file ``MARKER`` from its creation on; when the marker lists the finished
files, the old export (if any) is renamed aside to ``.<name>.previous``, the new one is
renamed in, and the old one deleted. A crash at any point leaves either the old or the new
export under the target's name, or (between the two renames) the old one as
``.<name>.previous``, which the next export puts back before doing anything else.

A target that holds anything but a previous export (no marker, or entries the marker does
not list) is refused: it is never deleted, whatever ``export.folder`` names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = ".titan_kedro_export.json"
"""Written into every export folder: ``{"format": 1, "complete": bool, "files": [names]}``."""
_FORMAT = 1


class ExportFolderError(ValueError):
    """The export target is not a previous export (or cannot be replaced); nothing was deleted."""


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.previous")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's export marker, or None when it has none (or an unreadable one)."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return None
    return data


def _is_own_leftover(path: Path) -> bool:
    """A real folder holding our marker, or an empty one (an empty target renamed aside)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return read_marker(path) is not None or not any(path.iterdir())


def recover(target: Path) -> None:
    """Undo what a crash in an earlier ``swap_in`` left beside ``target``.

    Puts back ``.<name>.previous`` when the target is missing (a crash between the two
    renames), else deletes it; deletes unfinished staging folders. Only folders carrying
    the marker (or empty) are touched; anything else is left alone with a warning.
    """
    aside = _aside(target)
    if aside.exists() or aside.is_symlink():
        if not _is_own_leftover(aside):
            logger.warning("leaving %s alone: it is not an export this code wrote", aside)
        elif not target.exists() and not target.is_symlink():
            logger.warning("restoring %s from %s (an export was interrupted)", target, aside)
            os.rename(aside, target)
        else:
            shutil.rmtree(aside)
    prefix = f".{target.name}.staging-"
    leftovers = [p for p in target.parent.iterdir() if p.name.startswith(prefix)]
    for staging in leftovers:
        if _is_own_leftover(staging):
            logger.warning("deleting %s, left by an interrupted export", staging)
            shutil.rmtree(staging)


def check_replaceable(target: Path) -> None:
    """Refuse a ``target`` that exists and is not (only) a previous export.

    Raises:
        ExportFolderError: It is a symlink or a file, or a folder with entries that no
            export marker in it lists; the message names them and how to go on.
    """
    if target.is_symlink():
        raise ExportFolderError(
            f"refusing to replace {target}: it is a symbolic link; set export.folder to the "
            "real folder, or to a new one"
        )
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportFolderError(
            f"refusing to replace {target}: it is a file, not an export folder; set "
            "export.folder to a new folder"
        )
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return
    marker = read_marker(target)
    if marker is None:
        raise ExportFolderError(
            f"refusing to replace {target} (export.folder): it holds {len(entries)} entries "
            f"({_some(entries)}) and no {MARKER}, so it is not a folder this export wrote, and "
            "replacing it would delete them. Set export.folder to a new or empty folder (e.g. "
            f"{target / 'hf'}); if it is an export written before markers existed, delete it "
            "yourself. Nothing was deleted"
        )
    listed = {MARKER, *marker.get("files", [])}
    foreign = [name for name in entries if name not in listed]
    if foreign:
        raise ExportFolderError(
            f"refusing to replace {target} (export.folder): besides a previous export it "
            f"holds {len(foreign)} entries the export did not write ({_some(foreign)}). Move "
            "them away or set export.folder to a new folder. Nothing was deleted"
        )


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (", …" if len(names) > limit else "")


def new_staging(target: Path) -> Path:
    """A fresh, marked staging folder beside ``target`` (after ``recover`` and the check)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    check_replaceable(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    _write_marker(staging, [], complete=False)
    return staging


def _write_marker(folder: Path, files: Iterable[str], *, complete: bool) -> None:
    data = {"format": _FORMAT, "complete": complete, "files": sorted(files)}
    (folder / MARKER).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def mark_complete(staging: Path) -> list[str]:
    """Write ``staging``'s marker as complete, listing its files; returns every file name
    (the marker included), as an object-storage publish uploads them."""
    files = [p.name for p in staging.iterdir() if p.name != MARKER]
    _write_marker(staging, files, complete=True)
    return sorted([*files, MARKER])


def swap_in(staging: Path, target: Path) -> None:
    """Mark ``staging`` complete and make it ``target``; the old export goes aside, then away.

    Raises:
        ExportFolderError: The target changed since ``new_staging`` into something that is
            not a previous export (checked again right before the renames).
    """
    mark_complete(staging)
    check_replaceable(target)
    aside = _aside(target)
    if target.exists():
        os.rename(target, aside)
    os.rename(staging, target)
    if aside.exists():
        shutil.rmtree(aside)


def discard(staging: Path) -> None:
    """Delete a staging folder after a failed export (the target is untouched)."""
    shutil.rmtree(staging, ignore_errors=True)
