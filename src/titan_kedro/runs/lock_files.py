"""The POSIX file operations the run lock (``runs.lock``) is built on, atomic also on NFS."""

from __future__ import annotations

import os
from pathlib import Path


def link_new(tmp: Path, path: Path) -> bool:
    """Make ``path`` a copy of the complete file ``tmp`` unless ``path`` exists (``link``).

    Returns:
        False when ``path`` already existed.
    """
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # NFS may report a retransmitted link that succeeded as failed: the count tells.
        if os.stat(tmp).st_nlink == 2:
            return True
        return _create_exclusive(path, tmp)  # no hard links here


def _create_exclusive(path: Path, tmp: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as out:
        out.write(tmp.read_bytes())
    return True


def create_empty(path: Path) -> bool:
    """Create the empty file ``path`` unless it exists (``O_EXCL``); False when it did."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True
