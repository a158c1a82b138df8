"""The S3 server killed (SIGKILL) in the middle of a checkpoint save, then restarted on its data.

The server is this module's own (``tests/cluster/s3_up.py`` in a temporary folder), so the
kill touches no other test. It dies as DCP starts storing ``.metadata``, after the state's
data file (16 MiB) is stored: ``step-2/`` holds that half of a checkpoint and no completion
marker, and after the restart it is neither resumed from nor kept.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from tests.cluster import s3_up
from tests.storage_fixtures import ENDPOINT_ENV, KEY_ENV, SECRET_ENV
from titan_kedro.runs.resume import latest_checkpoint
from titan_kedro.storage import as_path
from titan_kedro.train.checkpoint import CheckpointManager, ModelState


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A server for this module alone: its state folder and its endpoint and key."""
    state = tmp_path_factory.mktemp("s3-killed")
    env = s3_up.start(state)
    try:
        yield state, env
    finally:
        s3_up.stop(state)


@pytest.fixture
def fresh_s3_clients() -> Iterator[None]:
    """No cached s3fs client of another server: fsspec caches filesystems by their
    arguments, not by the ``AWS_*`` variables this test points at its own server, so a
    client made by an earlier test would keep talking to the shared server."""
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()  # and later tests get none of this server's


def _kill(state: Path) -> None:
    """SIGKILL the server's process group (started by this module) and wait until it is gone."""
    pid = int((state / "weed.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    for _ in range(100):
        try:
            os.waitpid(pid, os.WNOHANG)
            os.kill(pid, 0)
        except (ChildProcessError, ProcessLookupError):
            return
        time.sleep(0.05)
    raise AssertionError(f"weed {pid} survived SIGKILL")


def _manager(folder: str, model: nn.Module) -> CheckpointManager:
    return CheckpointManager(
        folder,
        {"model": ModelState([model])},
        per_rank_state=lambda: {},
        restore_per_rank=lambda entry, same_world=True: None,
        keep_latest_k=2,
    )


@pytest.mark.usefixtures("fresh_s3_clients")
def test_a_save_the_killed_server_cut_off_is_not_resumed_after_its_restart(
    own_server: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, env = own_server
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", env[KEY_ENV])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env[SECRET_ENV])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", env[ENDPOINT_ENV])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # s3fs's own retries suffice against a dead server
    fs = s3fs.S3FileSystem(
        key=env[KEY_ENV], secret=env[SECRET_ENV], endpoint_url=env[ENDPOINT_ENV],
        skip_instance_cache=True,
    )  # fmt: skip
    bucket = f"titan-killed-{secrets.token_hex(4)}"
    fs.mkdir(bucket)
    folder, prefix = f"s3://{bucket}/ckpt", f"{bucket}/ckpt"

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = nn.Linear(2048, 2048)  # 16 MiB of weights
        manager = _manager(folder, model)
        manager.save(1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)

        upload = s3fs.core.S3File._upload_chunk

        def kill_before_dcp_metadata(self: Any, final: bool = False) -> Any:
            if "/step-2/.metadata" in self.path:  # DCP writes .metadata.tmp, then renames
                _kill(state)
            return upload(self, final)

        monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", kill_before_dcp_metadata)
        with pytest.raises(CheckpointException, match=r"(?i)connect"):
            manager.save(2)
        monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", upload)
        s3_up.restart(state)

        fs.invalidate_cache()
        left = fs.ls(f"{prefix}/step-2", detail=False)
        assert f"{prefix}/step-2/__0_0.distcp" in left, left  # half a checkpoint survived
        assert f"{prefix}/step-2/metadata.json" not in left
        assert str(latest_checkpoint(folder)) == f"{folder}/step-1"

        fresh = nn.Linear(2048, 2048)  # a new run, continuing with checkpoint.resume=latest
        resumed = _manager(folder, fresh)
        chosen = resumed.resolve_resume("latest")
        assert str(chosen) == f"{folder}/step-1"
        assert resumed.load(chosen).step == 1
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name]), name
        resumed.save(3)  # the next save sweeps the half-written step-2
        assert sorted(p.name for p in as_path(folder).iterdir()) == ["step-1", "step-3"]
    finally:
        dist.destroy_process_group()
