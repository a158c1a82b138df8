"""Multi-process training through torchrun: FSDP equivalence, two-node rendezvous, restart."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.storage_fixtures import S3Bucket
from titan_kedro.config import dump_job_config
from titan_kedro.launch.appdef import free_port
from titan_kedro.launch.torchrun import torchrun_command
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.faults import CRASH_RANK_ENV, CRASH_STEP_ENV, TEST_HOOKS_ENV
from train.helpers import (
    REPO,
    read_metrics,
    run_ranks,
    run_worker,
    step_losses,
    tiny_job,
    train_each,
    train_here,
    write_token_dir,
)

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
    train_here(single)  # in this process, and FSDP in a 2-rank spawn: no torchrun start-up
    fsdp["launch"] = {**fsdp["launch"], "nproc_per_node": 2}
    run_ranks(train_each, [fsdp], store=root / "store")
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
        extra_env={TEST_HOOKS_ENV: "1", CRASH_STEP_ENV: "5", CRASH_RANK_ENV: "1"},
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


def test_a_one_rank_checkpoint_continues_on_two_fsdp_ranks(runs: dict[str, Path]) -> None:
    """One rank trains an unwrapped model; its checkpoint must load into FSDP2 shards.

    The one-rank run's step-3 checkpoint is what a one-rank run stopped after step 3 leaves
    (same job). Stopping a run and continuing its own folder is checked by
    test_killed_worker_is_restarted_and_resumes_from_checkpoint.
    """
    step_3 = runs["single"] / "ckpt" / "step-3"
    assert (step_3 / "metadata.json").is_file()
    job = tiny_job(runs["root"] / "grown", runs["tokens"], **JOB)
    job["checkpoint"] = {**job["checkpoint"], "resume": str(step_3)}
    continued = run_worker(job, nproc=2)
    assert "written by 1 ranks, now 2" in continued.stdout + continued.stderr
    reference = step_losses(runs["single"] / "job")
    resumed = step_losses(job["job"]["dump_folder"])
    assert sorted(resumed) == [4, 5, 6]  # from the checkpoint, not from step 1
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), step


def test_a_run_stopped_at_step_4_continues_from_s3_like_the_local_run(
    runs: dict[str, Path], s3_bucket: S3Bucket
) -> None:
    """Checkpoints on the S3 test server; a save cut off (no completion marker) is skipped."""
    job = tiny_job(runs["root"] / "s3", runs["tokens"], **JOB)
    job["checkpoint"] = {**job["checkpoint"], "folder": f"{s3_bucket.uri}/checkpoints"}
    stopped = run_worker(
        job, extra_env={TEST_HOOKS_ENV: "1", CRASH_STEP_ENV: "4", CRASH_RANK_ENV: "0"}, check=False
    )
    assert stopped.returncode != 0
    fs, prefix = s3_bucket.fs(), f"{s3_bucket.name}/checkpoints"
    saved = fs.ls(f"{prefix}/step-3")
    assert f"{prefix}/step-3/metadata.json" in saved and f"{prefix}/step-3/.metadata" in saved
    for name in saved:  # a later save cut off before its marker: every file but metadata.json
        if not name.endswith("/metadata.json"):
            fs.copy(name, f"{prefix}/step-5/{name.rsplit('/', 1)[1]}")
    job["checkpoint"] = {**job["checkpoint"], "resume": "latest"}
    continued = run_worker(job)
    output = continued.stdout + continued.stderr
    assert f"resumed from s3://{prefix}/step-3 at step 3" in output
    reference = step_losses(runs["single"] / "job")
    resumed = step_losses(job["job"]["dump_folder"])
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    fs.invalidate_cache()
    left = sorted(name.rsplit("/", 1)[1] for name in fs.ls(prefix))
    assert left == ["step-3", "step-6"], left  # the unmarked step-5 swept, the lock released
    assert fs.isfile(f"{prefix}/step-6/metadata.json")
    secret = s3_bucket.server.secret.encode()  # in no output, file or object the run wrote
    assert secret.decode() not in stopped.stdout + stopped.stderr + output
    written = [p for p in (runs["root"] / "s3").rglob("*") if p.is_file()]
    assert len(written) >= 3 and not [p for p in written if secret in p.read_bytes()]
    assert not [k for k in fs.find(prefix) if fs.isfile(k) and secret in fs.cat_file(k)]


def test_two_nodes_rendezvous_and_train_like_one_node(runs: dict[str, Path]) -> None:
    """Two torchrun agents ("nodes" of one process each) meet at a c10d rendezvous."""
    root = runs["root"] / "two_nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    job = tiny_job(
        root,
        runs["tokens"],
        **JOB,
        launch={"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": endpoint, "rdzv_id": "t2n"},
    )
    config = dump_job_config(resolve_job_config(job).config, root / "job_config.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    cmd = torchrun_command(resolve_job_config(job).config.launch, config)
    assert endpoint in cmd and "--standalone" not in cmd
    agents = [  # every node runs the same command; the rendezvous assigns the ranks
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    two_nodes = step_losses(root / "job")
    reference = step_losses(runs["fsdp"] / "job")
    assert sorted(two_nodes) == sorted(reference)
    for step, loss in reference.items():
        assert two_nodes[step] == pytest.approx(loss, rel=1e-4), step
