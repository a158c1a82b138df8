"""Where one run's own files live: ``<job.dump_folder>/runs/<run id>/``.

``job_config.yaml`` and ``summary.json`` go there, so runs sharing ``job.dump_folder``
never read each other's (the training node writes the config; rank 0 the summary).
"""

from __future__ import annotations

from pathlib import Path

from titan_kedro.runs.checkpoint_metadata import RUN_ID_SHAPE, CheckpointRunIdError

RUNS_FOLDER = "runs"


def run_folder(dump_folder: str | Path, run_id: str | None) -> Path:
    """``<dump_folder>/runs/<run_id>``: the files of one run, apart from concurrent runs'.

    Args:
        dump_folder: ``job.dump_folder``.
        run_id: ``job.run_id`` (the MLflow run id the training node sets); None (a worker
            started by hand with a config that names no run) gives ``dump_folder`` itself.

    Raises:
        CheckpointRunIdError: ``run_id`` is no run id (32 lowercase hex digits), so it
            cannot be a folder name (a path, say).
    """
    if run_id is None:
        return Path(dump_folder)
    if not RUN_ID_SHAPE.match(run_id):
        raise CheckpointRunIdError(
            f"job.run_id={run_id!r} is not a run id (32 lowercase hex digits); leave it unset "
            "(the training node sets it)"
        )
    return Path(dump_folder) / RUNS_FOLDER / run_id
