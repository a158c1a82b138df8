"""The plan's trackers keep torch's per-module and global peaks while updating only the
active modules' stats (``titan_kedro.plan.trackers._PeakWhere``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from titan_kedro.plan.trackers import PlainTracker


def _figures(tracker_type: type) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.Sequential(nn.GELU(), nn.Linear(256, 256), nn.Sequential(nn.Linear(256, 512))),
        nn.Linear(512, 8),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = tracker_type()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):  # the second step runs with the optimizer state allocated
            if step:  # torch's way to track a second iteration: its stats start afresh
                tracker.reset_mod_stats()
            model(torch.randn(32, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    per_module = {
        stats.mod_fqn: (
            dict(stats.local_peak),
            {
                str(state): [{str(d): dict(s) for d, s in snap.items()} for snap in snaps]
                for state, snaps in stats.snapshots.items()
            },
        )
        for stats in tracker.memory_tracking.values()
    }
    return {"peak": tracker.get_tracker_snapshot("peak"), "modules": per_module}


def test_active_module_updates_give_torchs_own_peaks() -> None:
    ours, torchs = _figures(PlainTracker), _figures(MemTracker)
    assert len(torchs["modules"]) == 8  # every module of the model, the root included
    assert ours["modules"] == torchs["modules"]
    assert ours["peak"] == torchs["peak"]
    assert next(iter(ours["peak"].values()))["Total"] > 0
