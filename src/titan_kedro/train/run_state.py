"""The trainer's state plumbing: restored counters, the batch source, what a checkpoint's
per-rank file and a healing replica group carry, and the run folder's ``summary.json``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from titan_kedro.train.checkpoint.manager import rng_state, set_rng_state

"""``job.dump_folder/runs/<run id>/`` holds one run's ``job_config.yaml`` and ``summary.json``."""


@dataclass
class TrainState(Stateful):
    """Counters that a checkpoint restores."""

    step: int = 0
    tokens_seen: int = 0
    last_loss: float = float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "last_loss": self.last_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.last_loss = float(state_dict["last_loss"])


class TrainBatches:
    """The training batch source: ``batches()`` is the next ``(inputs, labels)`` on ``device``.

    Its position is the loader's (a global position, restored under any layout); loading
    one restarts the iterator there.
    """

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self._iter: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(loader)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = next(self._iter)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._iter = iter(self.loader)

    def mark(self) -> Callable[[], None]:
        """Record the position now; the returned function rewinds to it."""
        position = self.state_dict()
        return lambda: self.load_state_dict(position)


def live_state(stateful: Mapping[str, Stateful], batches: TrainBatches) -> dict[str, Any]:
    """What a restarted replica group receives from a live one (no RNG: it is per rank)."""
    state = {name: obj.state_dict() for name, obj in stateful.items()}
    return {**state, "dataloader": batches.state_dict()}


def load_live_state(
    stateful: Mapping[str, Stateful], batches: TrainBatches, state: dict[str, Any]
) -> None:
    for name, obj in stateful.items():
        obj.load_state_dict(state[name])
    batches.load_state_dict(state["dataloader"])


def per_rank_state(batches: TrainBatches) -> dict[str, Any]:
    """A checkpoint's per-rank part: the data position and this rank's RNG."""
    return {"dataloader": batches.state_dict(), "rng": rng_state()}


def restore_per_rank(
    batches: TrainBatches, state: dict[str, Any], *, same_world: bool, reseed: int
) -> None:
    """Restore ``per_rank_state``; under another world the RNG is re-seeded with ``reseed``."""
    batches.load_state_dict(state["dataloader"])  # a global position
    if same_world:
        set_rng_state(state["rng"])
    else:
        torch.manual_seed(reseed)


def write_summary(folder: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``folder/summary.json`` atomically (NaN becomes null); ``folder`` is ``run_folder``."""
    path = Path(folder) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in summary.items()
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
