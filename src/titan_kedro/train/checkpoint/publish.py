"""Publishing and deleting checkpoints so that a crash never leaves a half one that counts.

A save is written to ``step-{n}.tmp``, fsync'd (files and folders) and renamed to
``step-{n}`` (``publish_folder``). Pruning renames ``step-{n}`` to ``step-{n}.deleting``
before deleting it, so a deletion that stops halfway leaves a folder that is no longer a
checkpoint. Leftovers of either (``step-{n}.tmp``, ``step-{n}.old.tmp``,
``step-{n}.deleting`` folders) are removed before the next save (``sweep_unfinished``),
after ``recover_interrupted_publish`` has put back a copy that a crash between the two
publishing renames left as ``step-{n}.old.tmp``. Nothing else is removed: another
``*.tmp`` entry (the run lock's ``writer.lock.<pid>.tmp`` after a kill, a user's file)
is left alone and logged.
Deletion errors are raised, never ignored.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from titan_kedro.runs.checkpoint_layout import METADATA, STEP_DIR
from titan_kedro.runs.resume import list_checkpoints

logger = logging.getLogger(__name__)

_OLD_SUFFIX = ".old.tmp"
_DELETING_SUFFIX = ".deleting"
_LEFTOVER = re.compile(r"^step-\d+(\.tmp|\.old\.tmp|\.deleting)$")
"""The folders a save, publish or prune makes and may leave behind: the only ones swept."""


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

    Raises:
        OSError: A rename or the deletion of the old copy failed.
    """
    fsync_tree(tmp)
    old = final.with_name(final.name + _OLD_SUFFIX)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def recover_interrupted_publish(folder: Path) -> list[Path]:
    """Put back a ``step-N`` that a crash between ``publish_folder``'s two renames left as
    ``step-N.old.tmp`` (a complete, published copy), so cleaning ``*.tmp`` never deletes it.

    Returns:
        The restored folders.
    """
    restored = []
    for old in sorted(folder.glob(f"step-*{_OLD_SUFFIX}")) if folder.is_dir() else []:
        final = old.with_name(old.name.removesuffix(_OLD_SUFFIX))
        if STEP_DIR.match(final.name) and not final.exists() and (old / METADATA).is_file():
            logger.warning("restoring %s from %s (a save was interrupted mid-publish)", final, old)
            old.rename(final)
            restored.append(final)
    return restored


def sweep_unfinished(folder: Path) -> list[Path]:
    """Delete the folders an interrupted save (``step-N.tmp``, ``step-N.old.tmp``) or prune
    (``step-N.deleting``) left.

    Call ``recover_interrupted_publish`` first: a ``step-N.old.tmp`` may be the only copy.
    Other ``*.tmp`` / ``*.deleting`` entries, and files or links with those names, were not
    made here: they are left alone and logged.

    Returns:
        The deleted folders.

    Raises:
        OSError: A leftover could not be deleted.
    """
    candidates = sorted({*folder.glob("*.tmp"), *folder.glob(f"*{_DELETING_SUFFIX}")})
    swept = []
    for path in candidates:
        if _LEFTOVER.match(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            swept.append(path)
        else:
            logger.info("not sweeping %s: not a checkpoint folder this code leaves behind", path)
    return swept


def prune_checkpoints(folder: Path, keep_latest_k: int) -> list[Path]:
    """Delete all but the newest ``keep_latest_k`` complete checkpoints under ``folder``.

    Each is first renamed to ``step-N.deleting`` (no longer a checkpoint, so a deletion
    that stops halfway can never be resumed from), then deleted.

    Returns:
        The deleted checkpoints (their former paths).

    Raises:
        OSError: A rename or a deletion failed.
    """
    pruned = []
    for _, path in list_checkpoints(folder)[:-keep_latest_k]:
        doomed = path.with_name(path.name + _DELETING_SUFFIX)
        if doomed.exists():
            shutil.rmtree(doomed)
        path.rename(doomed)
        fsync_dir(folder)
        shutil.rmtree(doomed)
        pruned.append(path)
    return pruned
