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

A stale lock is taken over with a warning. A restarted worker group (torchrun restart or a
Slurm requeue, same run id) takes over its own earlier attempt's lock once that attempt's process
is gone (on this host: its pid no longer runs as recorded; on another host the restart
itself says so). ``checkpoint.break_lock`` takes any lock: for a holder known to be gone
that the checks cannot see as such.

No ``flock`` is needed (NFS has none for folders): the lock file appears complete by
``link`` of a private file, which fails if a lock exists; a stale lock is replaced only by
the one process that creates the take-over claim ``writer.lock.takeover-<token>`` (an
``O_EXCL`` create) for that lock's fencing token, after checking the lock still holds that
token. Each holder writes a fresh random ``token`` and verifies it before every heartbeat
refresh and every checkpoint save (:func:`verify_writer`, called by the checkpoint
manager): a holder whose lock was taken over stops refreshing it, logs an error, and its
next save raises :class:`RunFolderLockLostError`.

What is guaranteed on NFS (v3 or later: atomic ``link``/``rename``, exclusive create, and
close-to-open consistency, which re-reads a file's content at each open): two starts never
both take the lock, and a holder that lost its lock notices at its next heartbeat or save.
Not guaranteed: a holder on another host that stalls (a paused process, a partitioned
node) past ``checkpoint.lock_timeout_s`` is judged gone and its lock taken over; until its
next verify it may still write, so its writes between its last verify and that moment
can overlap the new holder's (a fencing token checked by the storage itself would be
needed). Releasing checks the token and then removes the file: not atomic, harmless
unless the holder was already judged gone. A run folder on object storage (``s3://``)
gets the same lock through conditional writes instead: ``runs.object_lock``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from titan_kedro.runs.lock_files import create_empty, link_new
from titan_kedro.runs.restarts import job_restarted, own_run_ids
from titan_kedro.storage import is_remote

logger = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"
GROUP_ENV = "TORCHELASTIC_RUN_ID"
"""torchrun's run id: the same for every attempt of one worker group."""
HEARTBEATS_PER_TIMEOUT = 4
"""The holder refreshes the lock this many times per ``lock_timeout_s``."""


class RunFolderLockedError(RuntimeError):
    """Another live process trains into this run folder."""


class RunFolderLockLostError(RuntimeError):
    """This writer's run folder lock was taken over or removed: it must stop writing."""


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
    token: str | None = None
    """The fencing token: random, written at take-over, verified by the holder."""

    def fingerprint(self) -> str:
        """The token (a hash of the content for a lock written without one)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return self.token or hashlib.sha256(text.encode()).hexdigest()[:32]

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
        token=secrets.token_hex(16),
    )


def read_holder(folder: str | Path) -> tuple[LockHolder, float] | None:
    """The holder of ``folder``'s lock and its heartbeat's age in seconds (None: no lock).

    Raises:
        RunFolderLockedError: The lock file is unreadable (the message says what to do).
    """
    if is_remote(folder):
        from titan_kedro.runs.object_lock import read_object_holder

        found = read_object_holder(folder)
        return None if found is None else found[:2]
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


def _own_earlier_attempt(holder: LockHolder, heartbeat_age_s: float, timeout_s: float) -> bool:
    """A restart of the holder's own worker group, whose earlier attempt is gone.

    On this host the holder's process is checked (a live one that shares the torchrun run
    id is another group, not an earlier attempt); on another host the restart says so.
    """
    # torchrun's restart, Slurm's requeue, or the launcher's continuation of an ended job
    if not (job_restarted() and holder.group in own_run_ids()):
        return False
    if holder.host == socket.gethostname():
        return not holder_alive(holder, heartbeat_age_s, timeout_s)
    return True


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
    if (
        break_lock
        or _own_earlier_attempt(holder, age, timeout_s)
        or not holder_alive(holder, age, timeout_s)
    ):
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


def _private_copy(path: Path, holder: LockHolder) -> Path:
    tmp = path.with_name(f"{path.name}.{holder.token}.tmp")
    tmp.write_text(json.dumps(asdict(holder)), encoding="utf-8")
    return tmp


def _create(path: Path, holder: LockHolder) -> bool:
    """Make ``path`` hold ``holder`` if no lock exists (``link``: atomic, also on NFS)."""
    tmp = _private_copy(path, holder)
    try:
        return link_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _claim(path: Path, stale: LockHolder) -> Path | None:
    """The take-over claim for ``stale`` (None: another process claimed it first)."""
    claim = path.with_name(f"{path.name}.takeover-{stale.fingerprint()}")
    return claim if create_empty(claim) else None


def _take(folder: Path, me: LockHolder, *, timeout_s: float, break_lock: bool) -> None:
    """Make ``me`` the holder of ``folder``'s lock, or raise ``RunFolderLockedError``."""
    path = folder / LOCK_FILE
    for _ in range(8):  # a lock released or replaced meanwhile: look again
        previous = check_run_folder(folder, timeout_s=timeout_s, break_lock=break_lock)
        if previous is None:
            if _create(path, me):
                return
            continue
        claim = _claim(path, previous)
        if claim is None:
            raise RunFolderLockedError(
                f"run folder {folder}: another process is taking over the lock of "
                f"{previous.describe()} right now"
            )
        try:
            current = read_holder(folder)
            if current is None or current[0] != previous:
                continue  # released or replaced since it was read
            if _own_earlier_attempt(previous, current[1], timeout_s):
                logger.info(
                    "run folder %s: taking over this group's earlier attempt's lock", folder
                )
            else:
                logger.warning(
                    "run folder %s: taking over the lock of %s (%s)",
                    folder,
                    previous.describe(),
                    "checkpoint.break_lock" if break_lock else "the holder is gone",
                )
            os.replace(_private_copy(path, me), path)
            return
        finally:
            claim.unlink(missing_ok=True)  # the lock it names is gone: no claim can match
    raise RunFolderLockedError(f"run folder {folder}: its lock keeps changing; try again")


def _verify(path: Path, me: LockHolder) -> None:
    try:
        found = read_holder(path.parent)
    except RunFolderLockedError as err:
        found, detail = None, str(err)
    else:
        detail = "it was removed" if found is None else f"it now names {found[0].describe()}"
    if found is not None and found[0].token == me.token:
        return
    raise RunFolderLockLostError(
        f"this writer ({me.describe()}) lost the lock of run folder {path.parent}: {detail}. "
        "Another run may be writing there; this one stops instead of mixing checkpoints"
    )


@dataclass
class _Held:
    path: Path
    me: LockHolder
    lost: str | None = None
    """Why the heartbeat found the lock lost (None: still held)."""


_HELD: dict[Path, _Held] = {}
"""The locks this process holds, by resolved run folder."""


def verify_writer(folder: str | Path, *, fresh: bool = True) -> None:
    """Raise if this process held ``folder``'s lock and lost it (no-op for a folder whose
    lock another process holds, e.g. a replica-group launcher).

    Args:
        folder: The run folder.
        fresh: Read the lock file now (before a checkpoint save); else only what the
            heartbeat found.

    Raises:
        RunFolderLockLostError: The lock was taken over or removed.
    """
    if is_remote(folder):
        from titan_kedro.runs.object_lock import verify_object_writer

        return verify_object_writer(folder, fresh=fresh)
    held = _HELD.get(Path(folder).resolve())
    if held is None:
        return
    if held.lost is not None:
        raise RunFolderLockLostError(held.lost)
    if fresh:
        try:
            _verify(held.path, held.me)
        except RunFolderLockLostError as err:
            held.lost = str(err)
            raise


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
    if is_remote(folder):
        from titan_kedro.runs.object_lock import hold_object_run_folder

        with hold_object_run_folder(folder, timeout_s=timeout_s, break_lock=break_lock,
                                    run_id=run_id) as me:  # fmt: skip
            yield me
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    me = this_process(run_id)
    _take(folder, me, timeout_s=timeout_s, break_lock=break_lock)
    held = _HELD[folder.resolve()] = _Held(path, me)
    stop = threading.Event()
    heartbeat = threading.Thread(
        target=_heartbeat, args=(held, stop, timeout_s / HEARTBEATS_PER_TIMEOUT),
        daemon=True, name="run-lock-heartbeat",
    )  # fmt: skip
    heartbeat.start()
    try:
        yield me
    finally:
        stop.set()
        heartbeat.join()
        _HELD.pop(folder.resolve(), None)
        with contextlib.suppress(RunFolderLockedError):
            found = read_holder(folder)
            if found is not None and found[0].token == me.token:  # not taken over meanwhile
                path.unlink(missing_ok=True)


def _heartbeat(held: _Held, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            _verify(held.path, held.me)
        except RunFolderLockLostError as err:
            held.lost = str(err)
            logger.error("%s (at its next checkpoint save)", err)
            return  # never refresh another holder's lock
        try:
            os.utime(held.path)
        except OSError as err:  # removed meanwhile: the next check says so
            logger.warning("cannot refresh the run folder lock %s: %s", held.path, err)
