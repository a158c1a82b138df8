"""Checkpoint safety: metadata unpickled through an allow-list, atomic publishing, run identity."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from titan_kedro.train.checkpoint import (
    METADATA,
    UnsafeCheckpointError,
    find_checkpoint,
    latest_checkpoint,
    load_model_weights,
    publish_folder,
    recover_interrupted_publish,
)
from titan_kedro.train.run_identity import (
    ResumeMismatchError,
    check_resume_compatible,
    plan_run,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))


def _save(folder: Path, model: nn.Module, **meta: object) -> Path:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / METADATA).write_text(json.dumps({"step": 1, **meta}), encoding="utf-8")
    return folder


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    source = _model()
    path = _save(tmp_path / "step-1", source)
    target = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    load_model_weights(path, target)
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "step-1", _model())
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        load_model_weights(path, _model())
    assert not marker.exists()
    # The same bytes through plain pickle would have run the command: the test can fail.
    pickle.loads((path / ".metadata").read_bytes())
    assert marker.exists()


def test_publish_replaces_a_folder_without_a_gap(tmp_path: Path) -> None:
    final = tmp_path / "step-3"
    final.mkdir()
    (final / "old").write_text("old")
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    (tmp / "new").write_text("new")
    publish_folder(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def _fake_checkpoint(folder: Path, **meta: object) -> Path:
    folder.mkdir(parents=True)
    (folder / METADATA).write_text(json.dumps({"step": 1, **meta}), encoding="utf-8")
    return folder


def test_a_crash_between_the_publishing_renames_loses_no_checkpoint(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "step-3")
    # publish_folder renamed step-6 aside, then died before renaming the new copy in.
    _fake_checkpoint(tmp_path / "step-6.old.tmp", step=6)
    (tmp_path / "step-9.old.tmp").mkdir()  # never completed: not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert recover_interrupted_publish(tmp_path) == [tmp_path / "step-6"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-6"
    assert json.loads((tmp_path / "step-6" / METADATA).read_text())["step"] == 6
    assert (tmp_path / "step-9.old.tmp").is_dir()  # left for the *.tmp sweep


def test_resume_resolves_never_latest_run_id_and_path(tmp_path: Path) -> None:
    old = _fake_checkpoint(tmp_path / "run-a" / "step-2", run_id="run-a")
    newer = _fake_checkpoint(tmp_path / "run-b" / "step-6", run_id="run-b")
    os.utime(old / METADATA, (1, 1))
    assert find_checkpoint(tmp_path, "never") is None
    assert find_checkpoint(tmp_path, "latest") == newer
    assert find_checkpoint(tmp_path, "run-a") == old
    assert find_checkpoint(tmp_path, str(old)) == old
    with pytest.raises(FileNotFoundError, match="run-c"):
        find_checkpoint(tmp_path, "run-c")
    with pytest.raises(FileNotFoundError, match="no run under"):
        find_checkpoint(tmp_path / "empty", "latest")

    new_plan = plan_run(tmp_path, "never", "mlflow-run")
    assert (new_plan.run_id, new_plan.resume_from) == ("mlflow-run", None)
    assert new_plan.checkpoint_dir == tmp_path / "mlflow-run"
    assert len(plan_run(tmp_path, "never", None).run_id) == 32  # generated without MLflow
    continued = plan_run(tmp_path, "run-a", "ignored")
    assert (continued.run_id, continued.resume_from) == ("run-a", old)


def test_maths_changes_are_refused_listing_the_keys(tmp_path: Path) -> None:
    saved = {"training.seq_len": 64, "model.flavor": "debugmodel", "data_fingerprint": "abc"}
    path = _fake_checkpoint(tmp_path / "r" / "step-1", math=saved)
    check_resume_compatible(path, dict(saved))
    changed = {**saved, "training.seq_len": 128, "data_fingerprint": "xyz"}
    with pytest.raises(ResumeMismatchError) as err:
        check_resume_compatible(path, changed)
    assert "data_fingerprint" in str(err.value) and "training.seq_len" in str(err.value)
    assert "model.flavor" not in str(err.value)
