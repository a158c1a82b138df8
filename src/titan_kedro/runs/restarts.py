"""Whether this worker group is a later attempt of the same job: restarted by torchrun
(``--max-restarts``), requeued by Slurm (same job id, ``SLURM_RESTART_COUNT``), or a new
Slurm job the launcher submitted to continue one that ended at its time limit, by
preemption or with its node (``TITAN_KEDRO_EARLIER_JOBS``: the ended jobs' ids, which are
their torchrun run ids).

A later attempt continues its own run: it takes over its earlier attempt's run folder
lock (``runs.lock``) and resumes from the run's latest complete checkpoint, whatever
``checkpoint.resume`` said for the first attempt (``train.checkpoint.manager``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TORCHRUN_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
SLURM_RESTART_ENV = "SLURM_RESTART_COUNT"
RESTART_ENVS = (TORCHRUN_RESTART_ENV, SLURM_RESTART_ENV)
EARLIER_JOBS_ENV = "TITAN_KEDRO_EARLIER_JOBS"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def job_restarted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun restarted this group, Slurm requeued its job (a count above 0), or
    the launcher continues ended jobs of the run."""
    env = os.environ if environ is None else environ
    counted = any(int(env.get(name) or "0") > 0 for name in RESTART_ENVS)
    return counted or bool(env.get(EARLIER_JOBS_ENV))


def own_run_ids(environ: Mapping[str, str] | None = None) -> set[str]:
    """The torchrun run ids of this job's attempts: its own and the ended jobs it continues."""
    env = os.environ if environ is None else environ
    ids = {env.get(RUN_ID_ENV) or "", *(env.get(EARLIER_JOBS_ENV) or "").split(",")}
    return ids - {""}
