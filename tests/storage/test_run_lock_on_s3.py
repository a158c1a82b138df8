"""The run lock on object storage (conditional writes on the S3 test server)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

import pytest

from tests.storage_fixtures import S3Bucket
from titan_kedro.runs.lock import (
    LOCK_FILE,
    LockHolder,
    RunFolderLockedError,
    RunFolderLockLostError,
    hold_run_folder,
    read_holder,
    verify_writer,
)

TIMEOUT_S = 900


def _elsewhere(token: str) -> bytes:
    holder = LockHolder(
        pid=4242, host="node-elsewhere", process_start=1.0, taken=time.time(), run_id="r2",
        token=token,
    )  # fmt: skip
    return json.dumps(asdict(holder)).encode()


def test_a_second_writer_is_refused_and_a_taken_lock_stops_the_next_save(
    s3_bucket: S3Bucket,
) -> None:
    folder, fs = f"{s3_bucket.uri}/run-1", s3_bucket.fs()
    with hold_run_folder(folder, timeout_s=TIMEOUT_S, run_id="run-1") as me:
        holder, age = read_holder(folder)
        assert holder.token == me.token and age < 60
        with (
            pytest.raises(RunFolderLockedError, match="wait for it to finish"),
            hold_run_folder(folder, timeout_s=TIMEOUT_S),
        ):
            pytest.fail("a second writer got the lock")
        verify_writer(folder)  # still ours
        fs.pipe_file(f"{s3_bucket.name}/run-1/{LOCK_FILE}", _elsewhere("f" * 32))
        with pytest.raises(RunFolderLockLostError, match="node-elsewhere"):
            verify_writer(folder)
    assert read_holder(folder)[0].host == "node-elsewhere"  # not ours to remove


def test_a_lock_is_taken_over_only_by_break_lock_and_released_at_the_end(
    s3_bucket: S3Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    folder, fs = f"{s3_bucket.uri}/run-1", s3_bucket.fs()
    fs.pipe_file(f"{s3_bucket.name}/run-1/{LOCK_FILE}", _elsewhere("e" * 32))
    with pytest.raises(RunFolderLockedError, match="heartbeat is younger"):
        with hold_run_folder(folder, timeout_s=TIMEOUT_S):
            pytest.fail("a live foreign lock was taken")
    with (
        caplog.at_level(logging.WARNING),
        hold_run_folder(folder, timeout_s=TIMEOUT_S, break_lock=True) as me,
    ):
        assert read_holder(folder)[0].token == me.token
    assert "taking over the lock of pid 4242 on host node-elsewhere" in caplog.text
    fs.invalidate_cache()
    assert fs.glob(f"{s3_bucket.name}/run-1/{LOCK_FILE}*") == []  # released, no claim left
