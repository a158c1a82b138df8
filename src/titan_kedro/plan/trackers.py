"""The plan's memory trackers: torch's ``FSDPMemTracker`` / ``MemTracker`` plus where the
peak happened, the peak reset, and each block's saved bytes.

Everything here that reaches into the trackers' private state (``_peak_mem``,
``_peak_mem_snap``, ``_mod_tracker``, ``_in_opt``, ``_update_peak_stats``, the stats'
``mod_fqn``) is in this module only; ``tests/plan/test_fake_step.py`` and
``tests/plan/test_trackers.py`` fail if torch renames those attributes or changes what
its peak update does.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker


class _PeakWhere:
    """Mixin for the trackers: remember the module and phase of each new global peak, and
    update the per-module peaks of the active modules only.

    torch's ``_update_peak_stats`` runs after every op and walks every tracked module's
    stats (a weak-keyed dictionary, slow to iterate) to find the few active ones: about a
    third of a fake step's time. Here it sees a plain dictionary of the active modules'
    stats (those whose fqn is in ``_mod_tracker.parents``, exactly the ones it would update).
    """

    peak_at: dict[str, str]
    _stats_by_fqn: dict[str, list[Any]]
    _stats_seen: int = -1

    def _update_peak_stats(self, peak_state: Any) -> None:
        before = dict(self._peak_mem)  # type: ignore[attr-defined]
        tracking = self.memory_tracking  # type: ignore[attr-defined]
        if len(tracking) != self._stats_seen:  # a module's first forward adds its stats
            self._stats_by_fqn = {}
            for module, stats in tracking.items():
                self._stats_by_fqn.setdefault(stats.mod_fqn, []).append((module, stats))
            self._stats_seen = len(tracking)
        parents = self._mod_tracker.parents  # type: ignore[attr-defined]
        self.memory_tracking = {  # type: ignore[attr-defined]
            module: stats for fqn in parents for module, stats in self._stats_by_fqn.get(fqn, ())
        }
        try:
            super()._update_peak_stats(peak_state)  # type: ignore[misc]
        finally:
            self.memory_tracking = tracking  # type: ignore[attr-defined]
        if self._peak_mem != before:  # type: ignore[attr-defined]
            tracker = self._mod_tracker  # type: ignore[attr-defined]
            parents = [p for p in tracker.parents if p != "Global"]
            phase = "optimizer" if self._in_opt else ("backward" if tracker.is_bw else "forward")  # type: ignore[attr-defined]
            self.peak_at = {
                "module": max(parents, key=len, default="(outside modules: loss, hooks)"),
                "phase": phase,
            }


class FSDPTracker(_PeakWhere, FSDPMemTracker):
    """``FSDPMemTracker`` that also records where its peak happened."""


class PlainTracker(_PeakWhere, MemTracker):
    """``MemTracker`` (unsharded models) that also records where its peak happened."""


def reset_tracker_peak(tracker: Any) -> None:
    """Start the tracker's peak afresh from what is allocated now (the optimizer state).

    torch's ``MemTracker`` has no public way to reset its peak (only ``reset_mod_stats``
    for the per-module figures), so this writes the two private attributes its own
    ``__enter__`` initialises, ``_peak_mem`` and ``_peak_mem_snap``, the same way. This
    is the only code that writes them (``tests/plan/test_fake_step.py`` fails if torch
    renames them).
    """
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}
    tracker.peak_at = {"module": "(none)", "phase": "(none)"}


def block_saved_bytes(tracker: Any, model: nn.Module) -> dict[str, int]:
    """Per block: tracked bytes after its forward minus before it (what backward keeps)."""
    by_module = {module: name for name, module in model.layers.items()}
    out: dict[str, int] = {}
    for module, stats in tracker.memory_tracking.items():
        name = by_module.get(module)
        if name is None:
            continue
        snaps = {
            getattr(state, "value", str(state)): snap for state, snap in stats.snapshots.items()
        }
        pre = snaps.get("Before Pre-Forward") or snaps.get("Pre-Forward")
        post = snaps.get("After Post-Forward") or snaps.get("Post-Forward")
        if not pre or not post:
            continue
        before = next(iter(pre[-1].values()))
        after = next(iter(post[-1].values()))
        out[name] = int(_activations(after) - _activations(before))
    return out


def _activations(snapshot: dict[Any, int]) -> int:
    return sum(
        value
        for kind, value in snapshot.items()
        if kind != "Total" and getattr(kind, "value", "") == "Activation"
    )
