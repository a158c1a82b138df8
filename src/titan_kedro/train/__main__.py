"""Training worker: ``python -m titan_kedro.train --config job.yaml [--section.key value …]``.

Kedro's ``training`` node writes the resolved job config and starts this module through
torchrun; the same command works by hand on a cluster (no Kedro session is opened).

Single node, 2 processes (CPU: gloo; GPUs: one process per GPU, NCCL)::

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 \\
        --max-restarts 0 --log-dir data/07_model_output/logs --tee 3 --local-ranks-filter 0 \\
        -m titan_kedro.train --config data/07_model_output/job/runs/<run id>/job_config.yaml \\
        --launch.nproc_per_node 2

Two nodes with 8 GPUs each (the same command on every node; the rendezvous assigns the
ranks; ``kedro run`` submits exactly this through TorchX with ``launch.scheduler``)::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint node0.example:29500 --rdzv-id "$RDZV_ID" \\
        --max-restarts 3 --log-dir logs --tee 3 --local-ranks-filter 0 \\
        -m titan_kedro.train --config job_config.yaml \\
        --launch.nproc_per_node 8 --launch.nnodes 2

``$RDZV_ID``: the same on every node and hard to guess (``openssl rand -hex 16``): whoever
knows the endpoint and id can join the rendezvous. ``launch.nproc_per_node ×
launch.nnodes`` must equal the number of workers, since it sets
the batch layout. Metrics go to the MLflow run named by ``MLFLOW_RUN_ID`` (with
``MLFLOW_TRACKING_URI``) when set; a run is never started here. Checkpoints go to
``checkpoint.folder`` as given (the Kedro node passes ``<root>/<run id>``);
``checkpoint.resume`` (``never``, ``latest``, a folder name or a path) is resolved there,
and a worker group that torchrun restarts continues from that folder's latest checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from titan_kedro.runs.frozen_imports import freeze_at_exit, frozen_imports
from titan_kedro.runs.lock import hold_run_folder
from titan_kedro.runs.parent_death import end_with_agent
from titan_kedro.tracking.credentials import adopt_tracking_credentials, install_secret_filter


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``--config FILE`` from the dotted overrides."""
    parser = argparse.ArgumentParser(
        prog="python -m titan_kedro.train",
        description="Titan Kedro training worker (start it with torchrun).",
        epilog="Any other --section.key value pair overrides the config file.",
    )
    parser.add_argument("--config", help="job config file (.yaml, .toml or .json)")
    known, overrides = parser.parse_known_args(list(argv))
    return known.config, overrides


def run_folder_held(cfg: Any, rank: int) -> contextlib.AbstractContextManager[Any]:
    """Rank 0 holds the run folder's lock while it trains (``runs.lock``).

    Fault-tolerant replica groups share one run folder: their launcher holds the lock for
    the whole job (``launch.replica_groups``), so no group's rank 0 takes it.
    """
    ckpt = cfg.checkpoint
    if rank != 0 or not ckpt.enable or cfg.fault_tolerance.enable:
        return contextlib.nullcontext()
    return hold_run_folder(
        ckpt.folder,
        timeout_s=ckpt.lock_timeout_s,
        break_lock=ckpt.break_lock,
        run_id=cfg.job.run_id,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; returns the process exit code."""
    end_with_agent()  # before the slow imports below: a worker ends with its torchrun agent
    freeze_at_exit()
    # No credentials in a URI this worker could print; every log record masked.
    adopt_tracking_credentials()
    install_secret_filter()
    with frozen_imports():  # torch's objects stay out of the step's collections
        from torch.distributed.elastic.multiprocessing.errors import record

    return int(record(run_worker)(argv))


def run_worker(argv: Sequence[str] | None = None) -> int:
    """Load the job config, hold the run folder (rank 0) and train."""
    with frozen_imports():
        from titan_kedro.config import load_raw_config
        from titan_kedro.models.resolve import resolve_job_config
        from titan_kedro.train.device import env_int

    rank = env_int("RANK", 0)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config_file, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    raw = load_raw_config(config_file, overrides)
    resolved = resolve_job_config(raw, source=config_file or "command line")
    with frozen_imports():
        from titan_kedro.tracking.system_metrics import NodeSystemMetrics
        from titan_kedro.train.device import keep_freed_memory_mapped
        from titan_kedro.train.trainer import Trainer

    if resolved.config.training.device != "cuda" and resolved.config.training.cpu_keep_freed_memory:
        keep_freed_memory_mapped()
    metrics_cfg = resolved.config.metrics
    system_metrics = NodeSystemMetrics(
        metrics_cfg.system_metrics_interval_s, enable=metrics_cfg.enable_mlflow
    )
    with run_folder_held(resolved.config, rank):
        system_metrics.start()
        try:
            trainer = Trainer(resolved)
            try:
                summary = trainer.train()
            finally:
                trainer.close()
        finally:
            system_metrics.stop()
    if rank == 0:
        logging.getLogger(__name__).info("training finished: %s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
