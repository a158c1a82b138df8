"""Publishing and pruning checkpoints on object storage, where a rename is no atomic move.

On S3 (and compatibles) a "folder" is a key prefix, and renaming it copies and deletes
object by object, so ``publish``'s write-then-rename cannot make a save appear at once.
Instead the completion marker is ``metadata.json``, one object written last by rank 0
after every rank's DCP files and DCP's ``.metadata`` are stored (a single PUT appears whole
or not at all, and S3 is strongly consistent: whoever lists after the PUT sees it):

- save (``prepare_object_save``): delete ``step-<n>/metadata.json`` first if a copy of
  that step exists (from then on it is no checkpoint), then everything else under
  ``step-<n>/``; the ranks write into ``step-<n>/``; rank 0 writes ``metadata.json`` last.
- a ``step-<n>/`` without the marker (a save cut off, the server gone mid-save) is never a
  checkpoint: ``runs.resume.list_checkpoints`` (and so ``resume=latest``) skips it, and
  the next save deletes it (``sweep_unmarked``, under the run lock, so it is no other
  writer's save in progress).
- prune (``prune_object_checkpoints``): delete the marker first, then the rest, so a prune
  that stops halfway leaves a prefix that is no longer a checkpoint.
"""

from __future__ import annotations

import logging

from titan_kedro.runs.checkpoint_layout import METADATA, STEP_DIR
from titan_kedro.runs.resume import list_checkpoints
from titan_kedro.storage import StoragePath
from titan_kedro.storage.objects import remove, remove_prefix

logger = logging.getLogger(__name__)


def prepare_object_save(final: StoragePath) -> None:
    """Make ``final`` (``step-<n>/``) an empty prefix, unmarking a previous copy first."""
    remove(final / METADATA)
    remove_prefix(final)


def sweep_unmarked(folder: StoragePath) -> list[StoragePath]:
    """Delete the ``step-<n>/`` prefixes under ``folder`` that have no completion marker.

    Call it only while holding the run lock (before a save): an unmarked prefix is then a
    save that will never complete, not one in progress.

    Returns:
        The deleted prefixes.
    """
    swept = []
    for child in folder.iterdir() if folder.is_dir() else []:
        if STEP_DIR.match(child.name) and not (child / METADATA).is_file():
            logger.warning("deleting %s: a save that never completed (no %s)", child, METADATA)
            remove_prefix(child)
            swept.append(child)
    return swept


def prune_object_checkpoints(folder: StoragePath, keep_latest_k: int) -> list[StoragePath]:
    """Delete all but the newest ``keep_latest_k`` checkpoints: each marker, then the rest.

    Returns:
        The deleted checkpoints.
    """
    pruned = []
    for _, path in list_checkpoints(folder)[:-keep_latest_k]:
        remove(path / METADATA)
        remove_prefix(path)
        pruned.append(path)
    return pruned
