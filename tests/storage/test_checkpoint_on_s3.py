"""A checkpoint save on S3 cut off before its completion marker is never taken, then swept."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from tests.storage_fixtures import S3Bucket
from titan_kedro.runs.checkpoint_metadata import CheckpointMetadata
from titan_kedro.runs.resume import latest_checkpoint
from titan_kedro.storage import as_path


def _save_cut_off_before_the_marker(folder: str) -> None:
    from torch import nn

    from titan_kedro.train.checkpoint import CheckpointManager, ModelState, RankZeroError

    manager = CheckpointManager(
        folder,
        {"model": ModelState([nn.Linear(4, 4)])},
        per_rank_state=lambda: {},
        restore_per_rank=lambda entry, same_world=True: None,
        keep_latest_k=2,
    )
    manager.save(1)
    gone = ConnectionError("the server went away")
    with mock.patch.object(CheckpointMetadata, "write", side_effect=gone):
        with pytest.raises(RankZeroError, match="the server went away"):
            manager.save(2)
    root = as_path(folder)
    assert (root / "step-2" / ".metadata").is_file()  # DCP's files are there, the marker not
    assert str(latest_checkpoint(folder)) == f"{folder}/step-1"
    manager.save(3)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-3"]


def test_a_save_cut_off_before_its_marker_is_skipped_and_swept(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    dist.init_process_group(  # one gloo rank in this process
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        _save_cut_off_before_the_marker(f"{s3_bucket.uri}/ckpt")
    finally:
        dist.destroy_process_group()
