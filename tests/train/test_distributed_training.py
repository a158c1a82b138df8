"""Multi-process training through torchrun: FSDP equivalence and restart after a killed worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from titan_kedro.train.faults import CRASH_RANK_ENV, CRASH_STEP_ENV
from train.helpers import read_metrics, run_worker, step_losses, tiny_job, write_token_dir

pytestmark = pytest.mark.slow

JOB: dict[str, Any] = {
    "training": {"steps": 6, "local_batch_size": 2, "global_batch_size": 4},
    "checkpoint": {"interval": 3},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same job on 1 process (2 micro-batches per step) and on 2 FSDP processes."""
    root = tmp_path_factory.mktemp("dist")
    tokens = write_token_dir(root / "tokens")
    single = tiny_job(root / "single", tokens, **JOB)
    fsdp = tiny_job(root / "fsdp", tokens, **JOB)
    run_worker(single, nproc=1)
    run_worker(fsdp, nproc=2)
    return {"root": root, "tokens": tokens, "single": root / "single", "fsdp": root / "fsdp"}


def test_fsdp_over_two_ranks_matches_one_rank_with_accumulation(runs: dict[str, Path]) -> None:
    single = step_losses(runs["single"] / "job")
    fsdp = step_losses(runs["fsdp"] / "job")
    assert sorted(single) == sorted(fsdp) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 6):
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4), step
    assert len({round(v, 6) for v in single.values()}) == 6  # the losses really change


def test_killed_worker_is_restarted_and_resumes_from_checkpoint(runs: dict[str, Path]) -> None:
    job = tiny_job(runs["root"] / "killed", runs["tokens"], **JOB)
    proc = run_worker(
        job,
        nproc=2,
        max_restarts=1,
        extra_env={CRASH_STEP_ENV: "5", CRASH_RANK_ENV: "1"},
    )
    output = proc.stdout + proc.stderr
    assert "rank 1 exits at step 5" in output
    assert "resumed from" in output and "step-3" in output
    rows = read_metrics(job["job"]["dump_folder"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5, 6]  # step 4 replayed after the restart
    reference = step_losses(runs["fsdp"] / "job")
    resumed = step_losses(job["job"]["dump_folder"])
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step
