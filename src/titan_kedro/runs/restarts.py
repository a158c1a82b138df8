"""Whether this worker group is a later attempt of the same job: restarted by torchrun
(``--max-restarts``) or requeued by Slurm (same job id, ``SLURM_RESTART_COUNT``).

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


def job_restarted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun restarted this group or Slurm requeued its job (a count above 0)."""
    env = os.environ if environ is None else environ
    return any(int(env.get(name) or "0") > 0 for name in RESTART_ENVS)
