"""Training node: thin glue between Kedro and the torchrun workers (``titan_kedro.train``).

``launch.scheduler`` picks how they start (``titan_kedro.launch``): torchrun here, or a
TorchX job (several agents here, Slurm, Kubernetes, …).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from titan_kedro.config import dump_job_config
from titan_kedro.data.vocab import check_vocab_fits
from titan_kedro.launch import TrainingFailedError, launch_job, mlflow_env, prepare_job
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import (
    apply_plan_choices,
    build_plan,
    check_plan_fits,
    format_plan,
    resolve_layout,
)
from titan_kedro.runs.folders import run_folder
from titan_kedro.runs.identity import prepare_run
from titan_kedro.tracking.mlflow_logger import RUN_ID_ENV

logger = logging.getLogger(__name__)

JOB_CONFIG_FILE = "job_config.yaml"


def train_model(
    token_metadata: dict[str, Any],
    model_spec: dict[str, Any],
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """Plan the run, write the resolved job config, run the workers, return their summary.

    The config and the summary live in this run's own folder,
    ``job.dump_folder/runs/<run id>/`` (``runs.folders.run_folder``), so runs sharing
    ``job.dump_folder`` never read each other's; the summary reaches the other stages as
    this node's output.

    A new run (``checkpoint.resume: never``) trains from step 0 into
    ``checkpoint.folder/<MLflow run id>``; otherwise the named run is continued after
    checking that nothing that changes the maths differs (see ``runs.identity``).

    Args:
        token_metadata: ``metadata.json`` of the token files (orders this node after
            ``data_processing``; its ``vocab_size`` is checked against the model).
        model_spec: The model card (orders this node after ``model_spec``). Its plan may
            be stale, so the plan is measured again for this config before launching.
        **sections: The job-config sections by name (``model``, ``training``, …; the
            pipeline passes every one, see ``titan_kedro.pipelines.job_params``).

    Returns:
        ``checkpoint_dir, final_step, final_loss, tokens_seen, wall_time_s``; with
        ``launch.dryrun``: ``dryrun: true``, the scheduler and the files written.

    Raises:
        PlanDoesNotFitError: The job needs more memory per rank than its devices have
            (with ``plan.enforce``); the message holds the numbers and what would help.
            ``NoLayoutFitsError`` (one of them): ``parallelism.layout: auto`` found none.
        TrainingFailedError: A worker failed; the message holds its log tail.
        ResumeMismatchError: The continued checkpoint was trained with other maths.
        LaunchCheckError: A remote job could not see its files or reach MLflow.
    """
    del model_spec
    resolved, _ = resolve_layout(resolve_job_config(sections), table=False)  # layout: auto
    check_vocab_fits(token_metadata, int(resolved.model_args.vocab_size))
    plan = build_plan(resolved)
    logger.info("%s", format_plan(plan))
    check_plan_fits(plan, enforce=resolved.config.plan.enforce)
    apply_plan_choices(resolved.config, plan)
    env = mlflow_env()
    planned = prepare_run(resolved.config, token_metadata, env.get(RUN_ID_ENV))
    cfg = prepare_job(planned, env)
    folder = run_folder(cfg.job.dump_folder, cfg.job.run_id)
    config_path = dump_job_config(cfg, folder / JOB_CONFIG_FILE)
    summary_path = folder / "summary.json"
    if not cfg.launch.dryrun:
        summary_path.unlink(missing_ok=True)
    logger.info("job config written to %s", config_path)
    dryrun = launch_job(cfg, config_path, env)
    if dryrun is not None:
        logger.warning(
            "dry run (launch.dryrun=true): nothing trained or submitted; %s request in %s",
            cfg.launch.scheduler,
            dryrun["request_file"],
        )
        return dryrun
    if not summary_path.is_file():
        raise TrainingFailedError(
            f"the workers finished but wrote no {summary_path}; see {cfg.launch.log_dir}"
        )
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    logger.info(
        "training done: step %s, loss %s, %s tokens, %.1fs",
        summary["final_step"],
        summary["final_loss"],
        summary["tokens_seen"],
        summary["wall_time_s"],
    )
    return summary
