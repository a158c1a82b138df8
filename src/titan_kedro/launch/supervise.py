"""Follow a launched worker group: echo its output, poll its state, stop it when told.

Shared by torchrun on this machine (``torchrun.py``) and TorchX jobs (``scheduler.py``):
each output stream is echoed by a thread of its own (the tail kept for the error report),
the state is polled until it ends or ``launch.timeout_s`` passes, and any interruption
(Ctrl-C, SIGTERM raised as ``KeyboardInterrupt``) stops the group before it propagates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import IO, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

TAIL_KEPT = 400
"""Lines of each stream kept for the error report."""


class OutputFollower:
    """One daemon thread per stream that echoes its lines to ``console`` and keeps the tail.

    Args:
        streams: One callable per stream returning its lines (called in the thread, so a
            stream that must first be opened does not block the caller).
        console: Where lines are echoed.
        prefixes: One prefix per stream (e.g. ``[node 1] ``); none by default.
    """

    def __init__(
        self,
        streams: Sequence[Callable[[], Iterable[str]]],
        console: IO[str],
        prefixes: Sequence[str] | None = None,
    ) -> None:
        self.tails = [deque[str](maxlen=TAIL_KEPT) for _ in streams]
        self._lock = threading.Lock()
        self._console = console
        self._prefixes = list(prefixes or [""] * len(streams))
        self.threads = [
            threading.Thread(target=self._follow, args=(k, lines), daemon=True, name=f"log-{k}")
            for k, lines in enumerate(streams)
        ]
        for thread in self.threads:
            thread.start()

    def _follow(self, k: int, lines: Callable[[], Iterable[str]]) -> None:
        try:
            for line in lines():
                self.tails[k].append(line)
                with self._lock:
                    self._console.write(
                        self._prefixes[k] + (line if line.endswith("\n") else line + "\n")
                    )
                    self._console.flush()
        except Exception as err:  # output is best effort; the group's state decides
            logger.warning("cannot follow output stream %d: %s", k, err)

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the streams to end."""
        end = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))


def wait_until(poll: Callable[[], T], ended: Callable[[T], bool], timeout_s: float) -> T:
    """Poll every half second until ``ended(poll())`` or ``timeout_s``; the last value."""
    end = time.monotonic() + timeout_s
    value = poll()
    while not ended(value) and time.monotonic() < end:
        time.sleep(0.5)
        value = poll()
    return value


def supervise(
    poll: Callable[[], T],
    ended: Callable[[T], bool],
    stop: Callable[[], None],
    *,
    timeout_s: float | None,
    poll_s: float,
) -> tuple[T, bool]:
    """Poll a running group until it ends; stop it past ``timeout_s`` or when interrupted.

    Args:
        poll: Reads the group's state.
        ended: Whether a state is final.
        stop: Ends the group and waits for it (cancel, terminate).
        timeout_s: Stop the group after this many seconds (None: never).
        poll_s: Seconds between polls.

    Returns:
        The last state read, and whether the group was stopped for running past the time.

    Raises:
        BaseException: Whatever interrupted the wait (``KeyboardInterrupt`` …), after
            ``stop``; if ``stop`` fails too, its error is logged and attached as a note,
            and the original error is the one raised.
    """
    deadline = time.monotonic() + timeout_s if timeout_s else None
    try:
        state = poll()
        while not ended(state):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll_s)
            state = poll()
        else:
            return state, False
    except BaseException as err:
        logger.warning("interrupted (%s): stopping the worker group", type(err).__name__)
        try:
            stop()
        except Exception as stop_err:
            logger.error("stopping the worker group failed too: %r", stop_err)
            err.add_note(f"stopping the worker group failed too: {stop_err!r}")
        raise
    stop()
    return poll(), True
