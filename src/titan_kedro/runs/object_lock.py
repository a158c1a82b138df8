"""The run lock (``runs.lock``) for a run folder on object storage (``s3://…``).

The same lock object ``<run folder>/writer.lock`` with the same content (``LockHolder``)
and the same rules for who may take over, built on S3's conditional writes instead of
``link`` and ``O_EXCL``:

- take: ``PUT`` with ``If-None-Match: *`` (``storage.objects.create_exclusive``): of two
  starts, exactly one creates it;
- take over a stale lock: the claim ``writer.lock.takeover-<token>`` is created the same
  way (one claimant per stale lock), then the lock is replaced with ``If-Match: <etag>`` of
  the stale version (``replace_if_unchanged``): a lock refreshed or replaced meanwhile is
  not overwritten;
- heartbeat: the holder rewrites the same content with ``If-Match`` of the version it
  wrote, which moves the object's ``LastModified`` (the heartbeat age other hosts read);
  a lock replaced by another holder fails the match and is never refreshed;
- verify (before every checkpoint save) and release read the token, as ``runs.lock``.

Guarantee, on a store with strong read-after-write consistency and conditional writes
(AWS S3 since 2024, SeaweedFS, MinIO): two starts never both hold the lock, and a holder
whose lock was taken over notices at its next heartbeat or save. As on NFS, a holder that
stalls past ``checkpoint.lock_timeout_s`` is judged gone and may still write until its next
verify. A store without conditional writes fails the take with the server's error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from titan_kedro.runs import lock as run_lock
from titan_kedro.storage import as_path
from titan_kedro.storage.objects import (
    create_exclusive,
    etag_and_modified,
    read_bytes,
    remove,
    replace_if_unchanged,
)

logger = logging.getLogger(__name__)


@dataclass
class _HeldObject:
    uri: str
    me: run_lock.LockHolder
    etag: str
    lost: str | None = None


_HELD: dict[str, _HeldObject] = {}
"""The object-storage locks this process holds, by run folder URI."""


def _lock_uri(folder: Any) -> str:
    return str(as_path(folder, "checkpoint.folder") / run_lock.LOCK_FILE)


def _encode(holder: run_lock.LockHolder) -> bytes:
    return json.dumps(asdict(holder)).encode()


def read_object_holder(folder: Any) -> tuple[run_lock.LockHolder, float, str] | None:
    """The holder, its heartbeat age in seconds and the lock's version (None: no lock).

    Raises:
        RunFolderLockedError: The lock object is unreadable.
    """
    uri = _lock_uri(folder)
    found = etag_and_modified(uri)
    if found is None:
        return None
    etag, modified = found
    try:
        data: Mapping[str, Any] = json.loads(read_bytes(uri))
        holder = run_lock.LockHolder(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as err:
        raise run_lock.RunFolderLockedError(
            f"{uri} is not a readable lock ({err}); if no run trains into {folder}, delete "
            "it or set checkpoint.break_lock=true"
        ) from err
    return holder, max(0.0, time.time() - modified), etag


def _take(folder: Any, me: run_lock.LockHolder, *, timeout_s: float, break_lock: bool) -> str:
    """Make ``me`` the holder; returns the lock's version (raises when held)."""
    uri = _lock_uri(folder)
    for _ in range(8):
        previous = run_lock.check_run_folder(folder, timeout_s=timeout_s, break_lock=break_lock)
        if previous is None:
            if create_exclusive(uri, _encode(me)):
                return _version(uri)
            continue
        claim = f"{uri}.takeover-{previous.fingerprint()}"
        if not create_exclusive(claim, b""):
            raise run_lock.RunFolderLockedError(
                f"run folder {folder}: another process is taking over the lock of "
                f"{previous.describe()} right now"
            )
        try:
            current = read_object_holder(folder)
            if current is None or current[0] != previous:
                continue
            logger.warning(
                "run folder %s: taking over the lock of %s (%s)",
                folder,
                previous.describe(),
                "checkpoint.break_lock" if break_lock else "the holder is gone",
            )
            if replace_if_unchanged(uri, _encode(me), current[2]):
                return _version(uri)
        finally:
            remove(claim)
    raise run_lock.RunFolderLockedError(f"run folder {folder}: its lock keeps changing; try again")


def _version(uri: str) -> str:
    found = etag_and_modified(uri)
    return found[0] if found else ""


def _verify(held: _HeldObject, folder: Any) -> None:
    try:
        found = read_object_holder(folder)
    except run_lock.RunFolderLockedError as err:
        found, detail = None, str(err)
    else:
        detail = "it was removed" if found is None else f"it now names {found[0].describe()}"
    if found is not None and found[0].token == held.me.token:
        return
    raise run_lock.RunFolderLockLostError(
        f"this writer ({held.me.describe()}) lost the lock of run folder {folder}: {detail}. "
        "Another run may be writing there; this one stops instead of mixing checkpoints"
    )


def verify_object_writer(folder: Any, *, fresh: bool = True) -> None:
    """``runs.lock.verify_writer`` for a run folder on object storage."""
    held = _HELD.get(str(as_path(folder)))
    if held is None:
        return
    if held.lost is not None:
        raise run_lock.RunFolderLockLostError(held.lost)
    if fresh:
        try:
            _verify(held, folder)
        except run_lock.RunFolderLockLostError as err:
            held.lost = str(err)
            raise


@contextlib.contextmanager
def hold_object_run_folder(
    folder: Any, *, timeout_s: float, break_lock: bool = False, run_id: str | None = None
) -> Iterator[run_lock.LockHolder]:
    """``runs.lock.hold_run_folder`` for a run folder on object storage."""
    key = str(as_path(folder, "checkpoint.folder"))
    me = run_lock.this_process(run_id)
    etag = _take(key, me, timeout_s=timeout_s, break_lock=break_lock)
    held = _HELD[key] = _HeldObject(_lock_uri(key), me, etag)
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(held, key, stop, timeout_s / run_lock.HEARTBEATS_PER_TIMEOUT),
        daemon=True, name="run-lock-heartbeat",
    )  # fmt: skip
    beat.start()
    try:
        yield me
    finally:
        stop.set()
        beat.join()
        _HELD.pop(key, None)
        with contextlib.suppress(run_lock.RunFolderLockedError):
            found = read_object_holder(key)
            if found is not None and found[0].token == me.token:
                remove(held.uri)


def _heartbeat(held: _HeldObject, folder: str, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        if not replace_if_unchanged(held.uri, _encode(held.me), held.etag):
            try:
                _verify(held, folder)
            except run_lock.RunFolderLockLostError as err:
                held.lost = str(err)
                logger.error("%s (at its next checkpoint save)", err)
                return
        held.etag = _version(held.uri) or held.etag
