"""``activation_checkpoint: auto``: which blocks to recompute so the step fits, at least cost.

The fake step measures, per block, the bytes it keeps from forward to backward
(``saved``), its input (what a checkpointed block keeps instead) and the roofline
seconds of its forward (what recomputing it costs). Recomputing block ``b`` frees
``saved[b] - input[b]``; while one recomputed block is rebuilt in backward its
activations are held again, so the choice must free the excess plus the largest
rebuilt block. The solver is greedy: cheapest recompute per freed byte first. Its result
is then checked by another fake step (``step_planner``), not trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """What checkpointing one block frees and costs."""

    name: str
    saved: int
    """Bytes kept for backward without checkpointing."""
    kept: int
    """Bytes kept when checkpointed (the block's input)."""
    seconds: float
    """Roofline seconds to recompute its forward."""

    @property
    def freed(self) -> int:
        """Bytes checkpointing it frees."""
        return max(self.saved - self.kept, 0)


def choose_recompute(blocks: list[BlockCost], excess: int, chosen: Sequence[str] = ()) -> list[str]:
    """Blocks to recompute (in model order) freeing at least ``excess`` bytes beyond ``chosen``.

    Args:
        blocks: Every block's cost, in model order.
        excess: Bytes the measured peak exceeds the budget by (with ``chosen`` applied).
        chosen: Blocks already recomputed (kept in the result; their rebuild is already in
            the measured peak).

    Returns:
        ``chosen`` plus the cheapest blocks per freed byte (ties: later blocks first, whose
        activations backward frees soonest) until the freed bytes, less any growth of the
        largest rebuilt block, cover ``excess``; every block when even that is not enough.
    """
    picked = set(chosen)
    order = sorted(
        (i for i, b in enumerate(blocks) if b.name not in picked and b.freed > 0),
        key=lambda i: (blocks[i].seconds / blocks[i].freed, -i),
    )
    paid = max((b.saved for b in blocks if b.name in picked), default=0)
    freed, rebuilt = 0, paid
    for index in order:
        if freed - (rebuilt - paid) >= excess:
            break
        picked.add(blocks[index].name)
        freed += blocks[index].freed
        rebuilt = max(rebuilt, blocks[index].saved)
    return [b.name for b in blocks if b.name in picked]
