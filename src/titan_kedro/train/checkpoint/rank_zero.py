"""Work only rank 0 does while every rank waits, with its failure reaching every rank.

Rank 0 alone resolves the checkpoint to resume, publishes a save and prunes old ones. If
it failed silently to the others, they would wait in the next collective until the
process group times out. ``on_rank_zero`` broadcasts the outcome instead, so every rank
raises ``RankZeroError`` with rank 0's message at once. An interrupt of rank 0
(``KeyboardInterrupt``, ``SystemExit``: any ``BaseException``) is broadcast the same way
before rank 0 re-raises it, so the others stop at once too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


class RankZeroError(RuntimeError):
    """Rank 0 failed in a step every rank waits on (raised on every rank, same message)."""


def on_rank_zero(what: str, action: Callable[[], str | None]) -> str | None:
    """Run ``action`` on rank 0 and hand its result, or its failure, to every rank.

    Collective: every rank of the default process group must call it.

    Args:
        what: What rank 0 is doing, for the error message ("publishing step-4 in …").
        action: Runs on rank 0 only; returns a string (or None) for every rank.

    Returns:
        ``action``'s result, on every rank.

    Raises:
        RankZeroError: ``action`` raised on rank 0; the message names its type and text.
            On rank 0 an interrupt (not an ``Exception``) is re-raised as it is.
    """
    outcome: list[str | None] = [None, None]  # [error, result]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome[1] = action()
        except BaseException as err:  # an interrupt too: the others must not wait for it
            failure = err
            outcome[0] = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None and not isinstance(failure, Exception):
        raise failure  # rank 0's own interrupt stays what it is
    if outcome[0] is not None:
        raise RankZeroError(f"rank 0 failed while {what}: {outcome[0]}") from failure
    return outcome[1]
