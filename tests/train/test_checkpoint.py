"""Checkpoint discovery never returns a half-written save; per-rank state round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_kedro.runs.checkpoint_layout import METADATA
from titan_kedro.runs.checkpoint_metadata import read_checkpoint_metadata
from titan_kedro.runs.resume import latest_checkpoint, list_checkpoints
from titan_kedro.train.checkpoint.manager import decode_state, encode_state
from titan_kedro.train.checkpoint.safe_load import load_model_weights


def _complete(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / METADATA).write_text(json.dumps({"step": step, "world_size": 1}))
    return path


def test_only_complete_step_folders_count(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    _complete(tmp_path, 5)
    newest = _complete(tmp_path, 10)
    (tmp_path / "step-20.tmp").mkdir()  # a save that crashed before the rename
    (tmp_path / "step-15").mkdir()  # no metadata.json: never finished
    (tmp_path / "notes").mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10]
    assert latest_checkpoint(tmp_path) == newest


def test_incomplete_checkpoint_is_refused_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "step-3").mkdir()
    with pytest.raises(FileNotFoundError, match="latest_checkpoint"):
        read_checkpoint_metadata(tmp_path / "step-3")
    with pytest.raises(FileNotFoundError):
        load_model_weights(tmp_path / "step-3", torch.nn.Linear(2, 2))


def test_per_rank_state_survives_json() -> None:
    torch.manual_seed(3)
    state = {
        "dataloader": {"epoch": 1, "batch": 7},
        "rng": {"cpu": torch.get_rng_state(), "empty": torch.zeros(0, dtype=torch.int64)},
        "values": [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), 3, "x"],
    }
    back = decode_state(json.loads(json.dumps(encode_state(state))))
    assert back["dataloader"] == {"epoch": 1, "batch": 7}
    assert torch.equal(back["rng"]["cpu"], state["rng"]["cpu"])
    assert back["rng"]["empty"].shape == (0,) and back["rng"]["empty"].dtype == torch.int64
    assert torch.equal(back["values"][0], state["values"][0]) and back["values"][1:] == [3, "x"]
    torch.set_rng_state(back["rng"]["cpu"])
    first = torch.rand(3)
    torch.set_rng_state(state["rng"]["cpu"])
    assert torch.equal(first, torch.rand(3))
