"""One writer per run folder: a live holder is named and refused, a stale lock taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from titan_kedro.runs.lock import (
    LOCK_FILE,
    LockHolder,
    RunFolderLockedError,
    check_run_folder,
    hold_run_folder,
    read_holder,
)

from .helpers import live_holder, run_worker, tiny_job, write_token_dir

TIMEOUT_S = 900


def _foreign_lock(folder: Path, *, age_s: float, group: str | None = None) -> LockHolder:
    """A lock written by a process on another host, last refreshed ``age_s`` ago."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = LockHolder(
        pid=4242, host="node-elsewhere", process_start=1.0, taken=time.time() - age_s,
        run_id="run-1", group=group,
    )  # fmt: skip
    path = folder / LOCK_FILE
    path.write_text(json.dumps(asdict(holder)), encoding="utf-8")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return holder


def test_a_live_writer_on_this_host_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "run-1"
    with live_holder(folder) as holder:
        with pytest.raises(RunFolderLockedError) as err:
            check_run_folder(folder, timeout_s=TIMEOUT_S)
        message = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()} (run run-1" in message
        assert "wait for it to finish or stop it" in message
        with pytest.raises(RunFolderLockedError), hold_run_folder(folder, timeout_s=TIMEOUT_S):
            pytest.fail("a second writer got the lock")
        assert read_holder(folder)[0].pid == holder.pid  # untouched by the refusal


def test_a_dead_holders_lock_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run-1"
    with live_holder(folder) as holder:
        pass  # SIGKILLed: its lock file stays behind
    assert read_holder(folder)[0].pid == holder.pid
    with caplog.at_level(logging.WARNING), hold_run_folder(folder, timeout_s=TIMEOUT_S) as me:
        assert read_holder(folder)[0] == me and me.pid == os.getpid()
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert "the holder is gone" in caplog.text
    assert not (folder / LOCK_FILE).exists()  # released at the end


def test_another_hosts_lock_is_stale_only_after_its_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run-1"
    _foreign_lock(folder, age_s=30)
    with pytest.raises(RunFolderLockedError, match=r"checkpoint\.break_lock=true") as err:
        check_run_folder(folder, timeout_s=60)
    assert "pid 4242 on host node-elsewhere" in str(err.value)
    assert check_run_folder(folder, timeout_s=20) is not None  # heartbeat older than that
    with caplog.at_level(logging.WARNING), hold_run_folder(folder, timeout_s=60, break_lock=True):
        pass
    assert "checkpoint.break_lock" in caplog.text and "pid 4242" in caplog.text


def test_a_restarted_group_takes_over_its_own_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run-1"
    _foreign_lock(folder, age_s=1, group="job-7")  # rank 0 moved host on the restart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(RunFolderLockedError):  # a second group with the same rendezvous id
        check_run_folder(folder, timeout_s=TIMEOUT_S)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with hold_run_folder(folder, timeout_s=TIMEOUT_S) as me:
        assert read_holder(folder)[0] == me and me.group == "job-7"


def test_a_job_slurm_requeued_takes_over_its_own_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run-1"
    _foreign_lock(folder, age_s=1, group="91")  # the job ran on another node before
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "91")  # the rendezvous id: the Slurm job id
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(RunFolderLockedError):
        check_run_folder(folder, timeout_s=TIMEOUT_S)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: the same writer again
    with hold_run_folder(folder, timeout_s=TIMEOUT_S) as me:
        assert read_holder(folder)[0] == me and me.group == "91"


def test_a_new_job_continuing_an_ended_one_takes_over_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run-1"
    _foreign_lock(folder, age_s=1, group="91")  # job 91 reached its time limit elsewhere
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "95")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with pytest.raises(RunFolderLockedError):  # another job's live lock
        check_run_folder(folder, timeout_s=TIMEOUT_S)
    monkeypatch.setenv("TITAN_KEDRO_EARLIER_JOBS", "90,91")  # the launcher continues 91
    with hold_run_folder(folder, timeout_s=TIMEOUT_S) as me:
        assert read_holder(folder)[0] == me and me.group == "95"


def test_the_heartbeat_refreshes_the_lock(tmp_path: Path) -> None:
    folder = tmp_path / "run-1"
    with hold_run_folder(folder, timeout_s=0.4):  # a heartbeat every 0.1 s
        os.utime(folder / LOCK_FILE, (0, 0))  # as if last refreshed in 1970
        deadline = time.monotonic() + 30
        while read_holder(folder)[1] > 3600 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_holder(folder)[1] < 3600


def test_continuing_a_run_a_live_writer_holds_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from titan_kedro.pipelines.training.nodes import train_model

    tokens = write_token_dir(tmp_path / "tokens", n_train=4000)
    run_id = "0123456789abcdef0123456789abcdef"  # MLflow's id shape, checked on resume
    checkpoint = tmp_path / "ckpt" / run_id / "step-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "metadata.json").write_text(json.dumps({"step": 3, "math": {}, "run_id": run_id}))
    job = tiny_job(tmp_path, tokens, checkpoint={"resume": "latest"})
    with live_holder(checkpoint.parent) as holder, pytest.raises(RunFolderLockedError) as err:
        train_model({"vocab_size": 512}, {}, **job)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
    assert not list((tmp_path / "job").rglob("job_config.yaml"))
    assert not (tmp_path / "logs").exists()  # no worker started


@pytest.mark.slow
def test_a_worker_started_by_hand_in_a_held_folder_refuses(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4000)
    folder = tmp_path / "ckpt" / "run-1"
    job = tiny_job(tmp_path, tokens, checkpoint={"folder": str(folder)})
    with live_holder(folder) as holder:
        done = run_worker(job, check=False)
    assert done.returncode != 0
    assert f"run folder {folder} is being trained by pid {holder.pid}" in done.stderr
    assert not (tmp_path / "job" / "metrics.jsonl").exists()


def _race_two_writers(folder: Path, timeout_s: float) -> list[str]:
    """Two threads take ``folder``'s lock at once; each holds it (if it got it) until the
    other has tried. Returns their outcomes, sorted: ``held`` / ``refused``."""
    import threading

    tried = threading.Barrier(2, timeout=10)
    outcome: dict[str, str] = {}

    def writer(name: str) -> None:
        try:
            with hold_run_folder(folder, timeout_s=timeout_s):
                outcome[name] = "held"
                tried.wait()  # still holding while the other one tries
        except RunFolderLockedError:
            outcome[name] = "refused"
            tried.wait()

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return sorted(outcome.values())


def test_two_writers_without_flock_never_both_hold_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without ``flock`` (NFS) both starts read "no lock" before either
    writes: only one may come out holding it."""
    import fcntl
    import threading

    from titan_kedro.runs import lock as run_lock

    monkeypatch.setattr(fcntl, "flock", lambda *_a, **_k: None)  # serialises nothing
    both_read = threading.Barrier(2, timeout=10)
    local = threading.local()
    read = run_lock.read_holder

    def read_then_wait(folder: str | Path) -> tuple[LockHolder, float] | None:
        found = read(folder)
        if not getattr(local, "waited", False):  # each writer's first look: at once
            local.waited = True
            both_read.wait()
        return found

    monkeypatch.setattr(run_lock, "read_holder", read_then_wait)
    folder = tmp_path / "run-1"
    folder.mkdir()
    assert _race_two_writers(folder, TIMEOUT_S) == ["held", "refused"]


def test_two_writers_taking_over_one_stale_lock_never_both_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import threading

    from titan_kedro.runs import lock as run_lock

    monkeypatch.setattr(fcntl, "flock", lambda *_a, **_k: None)  # NFS: serialises nothing
    folder = tmp_path / "run-1"
    _foreign_lock(folder, age_s=3600)  # stale for both
    both_read = threading.Barrier(2, timeout=10)
    local = threading.local()
    read = run_lock.read_holder

    def read_then_wait(folder: str | Path) -> tuple[LockHolder, float] | None:
        found = read(folder)
        if not getattr(local, "waited", False):
            local.waited = True
            both_read.wait()
        return found

    monkeypatch.setattr(run_lock, "read_holder", read_then_wait)
    assert _race_two_writers(folder, 60) == ["held", "refused"]


def test_a_holder_whose_lock_was_taken_over_notices_and_stops_refreshing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from titan_kedro.runs.lock import RunFolderLockLostError, verify_writer

    folder = tmp_path / "run-1"
    with caplog.at_level(logging.ERROR), hold_run_folder(folder, timeout_s=0.4):
        verify_writer(folder)  # held: fine
        thief = _foreign_lock(folder, age_s=0)  # taken over (a break_lock elsewhere)
        os.utime(folder / LOCK_FILE, (0, 0))
        deadline = time.monotonic() + 10
        while "lost the lock" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # three more heartbeats
        assert read_holder(folder)[1] > 3600  # the new holder's lock is not refreshed
        with pytest.raises(RunFolderLockLostError, match="pid 4242 on host node-elsewhere"):
            verify_writer(folder)  # what the next checkpoint save calls
    assert "lost the lock of run folder" in caplog.text
    assert read_holder(folder)[0] == thief  # the new holder's lock is left alone


def test_a_restart_never_takes_the_lock_of_a_live_holder_with_its_rendezvous_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run-1"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # the holder below has it too
    with live_holder(folder) as holder:
        assert read_holder(folder)[0].group == "job-7"
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        with pytest.raises(RunFolderLockedError), hold_run_folder(folder, timeout_s=TIMEOUT_S):
            pytest.fail("a restart took a live holder's lock")
        assert read_holder(folder)[0].pid == holder.pid
