"""One writer per run folder: a lock file naming the process that trains into it.

Rank 0 of the worker group takes ``<run folder>/writer.lock`` before training and removes
it at the end (fault-tolerant replica groups: their launcher, for the whole job); the training node checks it before launching, so a continue
(``checkpoint.resume``) or a restart by hand while the run still trains fails at once,
naming the holder. The file holds the holder's pid, host, process start time, run id and
torchrun run id, and rank 0 refreshes its modification time as a heartbeat.

Whether the holder is alive:

- on the same host: its pid runs and started when the lock says (a reused pid does not
  count);
- on another host (a remote job, a node that crashed): only its heartbeat can tell; the
  lock is stale once it is older than ``checkpoint.lock_timeout_s``.

A stale lock is taken over with a warning. A restarted worker group (torchrun restart,
same torchrun run id) takes over its own earlier attempt's lock. ``checkpoint.break_lock``
takes any lock: for a holder known to be gone that the checks cannot see as such.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"
GROUP_ENV = "TORCHELASTIC_RUN_ID"
"""torchrun's run id: the same for every attempt of one worker group."""
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
HEARTBEATS_PER_TIMEOUT = 4
"""The holder refreshes the lock this many times per ``lock_timeout_s``."""


class RunFolderLockedError(RuntimeError):
    """Another live process trains into this run folder."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run folder (the lock file's content)."""

    pid: int
    host: str
    process_start: float
    """The holder's process creation time (seconds since the epoch)."""
    taken: float
    """When the lock was taken (seconds since the epoch)."""
    run_id: str | None = None
    group: str | None = None
    """torchrun's run id of the holder's worker group (None outside torchrun)."""

    def describe(self, heartbeat_age_s: float | None = None) -> str:
        """``pid 123 on host h (run r, since 2026-…Z, heartbeat 4 s ago)``."""
        since = datetime.fromtimestamp(self.taken, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        details = [f"run {self.run_id}"] if self.run_id else []
        details.append(f"since {since}")
        if heartbeat_age_s is not None:
            details.append(f"heartbeat {heartbeat_age_s:.0f} s ago")
        return f"pid {self.pid} on host {self.host} ({', '.join(details)})"


def this_process(run_id: str | None = None) -> LockHolder:
    """The lock this process would write."""
    return LockHolder(
        pid=os.getpid(),
        host=socket.gethostname(),
        process_start=psutil.Process().create_time(),
        taken=time.time(),
        run_id=run_id,
        group=os.environ.get(GROUP_ENV),
    )


def read_holder(folder: str | Path) -> tuple[LockHolder, float] | None:
    """The holder of ``folder``'s lock and its heartbeat's age in seconds (None: no lock).

    Raises:
        RunFolderLockedError: The lock file is unreadable (the message says what to do).
    """
    path = Path(folder) / LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8")
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        data: Mapping[str, Any] = json.loads(text)
        holder = LockHolder(**data)
    except (ValueError, TypeError) as err:
        raise RunFolderLockedError(
            f"{path} is not a readable lock ({err}); if no run trains into {folder}, delete "
            "it or set checkpoint.break_lock=true"
        ) from err
    return holder, age


def holder_alive(holder: LockHolder, heartbeat_age_s: float, timeout_s: float) -> bool:
    """Whether the holder may still be training (see the module docstring)."""
    if holder.host != socket.gethostname():
        return heartbeat_age_s < timeout_s
    try:
        started = psutil.Process(holder.pid).create_time()
    except psutil.NoSuchProcess:
        return False
    return abs(started - holder.process_start) < 1.0


def _own_earlier_attempt(holder: LockHolder) -> bool:
    group = os.environ.get(GROUP_ENV)
    restarted = int(os.environ.get(RESTART_ENV, "0") or 0) > 0
    return restarted and group is not None and holder.group == group


def check_run_folder(
    folder: str | Path, *, timeout_s: float, break_lock: bool = False
) -> LockHolder | None:
    """Refuse a run folder that a live process trains into.

    Args:
        folder: The run folder (``checkpoint.folder`` as the workers get it).
        timeout_s: ``checkpoint.lock_timeout_s``.
        break_lock: ``checkpoint.break_lock``: never refuse.

    Returns:
        The holder of a lock that may be taken over (stale, own earlier attempt, or
        ``break_lock``), else None (no lock).

    Raises:
        RunFolderLockedError: A live holder; the message names it and how to proceed.
    """
    found = read_holder(folder)
    if found is None:
        return None
    holder, age = found
    if break_lock or _own_earlier_attempt(holder) or not holder_alive(holder, age, timeout_s):
        return holder
    other_host = holder.host != socket.gethostname()
    hint = (
        f"its heartbeat is younger than checkpoint.lock_timeout_s={timeout_s:g}s; if that "
        "host's job is gone, wait for the timeout or set checkpoint.break_lock=true"
        if other_host
        else "wait for it to finish or stop it"
    )
    raise RunFolderLockedError(
        f"run folder {folder} is being trained by {holder.describe(age)}: {hint}. Starting "
        "a second writer there (a continue, a restart by hand) would mix two runs' "
        "checkpoints and metrics"
    )


@contextlib.contextmanager
def _folder_mutex(folder: Path) -> Iterator[None]:
    """Serialise lock changes on this host (``flock`` on the folder itself).

    Best effort: a filesystem that cannot ``flock`` a folder (NFS turns it into a POSIX
    lock, which needs a writable file) leaves only two starts within the same instant
    unserialised.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            logger.debug("cannot flock %s (%s): lock changes not serialised", folder, err)
        yield
    finally:
        os.close(fd)


def _write_lock(path: Path, holder: LockHolder) -> None:
    tmp = path.with_name(f"{path.name}.{holder.pid}.tmp")
    tmp.write_text(json.dumps(asdict(holder)), encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def hold_run_folder(
    folder: str | Path,
    *,
    timeout_s: float,
    break_lock: bool = False,
    run_id: str | None = None,
) -> Iterator[LockHolder]:
    """Hold ``folder``'s lock while the block runs, refreshing its heartbeat.

    Args:
        folder: The run folder (created if missing).
        timeout_s: ``checkpoint.lock_timeout_s`` (the heartbeat runs four times as often).
        break_lock: ``checkpoint.break_lock``.
        run_id: Recorded in the lock, for the message a second writer gets.

    Raises:
        RunFolderLockedError: A live process holds it (nothing was changed).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    me = this_process(run_id)
    with _folder_mutex(folder):
        previous = check_run_folder(folder, timeout_s=timeout_s, break_lock=break_lock)
        if previous is not None and _own_earlier_attempt(previous):
            logger.info("run folder %s: taking over this group's earlier attempt's lock", folder)
        elif previous is not None:
            logger.warning(
                "run folder %s: taking over the lock of %s (%s)",
                folder,
                previous.describe(),
                "checkpoint.break_lock" if break_lock else "the holder is gone",
            )
        _write_lock(path, me)
    stop = threading.Event()
    heartbeat = threading.Thread(
        target=_heartbeat, args=(path, stop, timeout_s / HEARTBEATS_PER_TIMEOUT),
        daemon=True, name="run-lock-heartbeat",
    )  # fmt: skip
    heartbeat.start()
    try:
        yield me
    finally:
        stop.set()
        heartbeat.join()
        with _folder_mutex(folder), contextlib.suppress(RunFolderLockedError):
            found = read_holder(folder)
            if found is not None and found[0] == me:  # not taken over meanwhile
                path.unlink()


def _heartbeat(path: Path, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            os.utime(path)
        except OSError as err:  # taken over or removed by hand: say so, keep training
            logger.warning("cannot refresh the run folder lock %s: %s", path, err)
