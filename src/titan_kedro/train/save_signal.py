"""Save a checkpoint when the scheduler warns that the job is about to end.

On Slurm the launcher asks for a signal some time before the job's time limit
(``sbatch --signal=USR1@<launch.save_before_limit_s>``) and names it to the workers in
``TITAN_KEDRO_SAVE_SIGNAL``; the torchrun agent ignores it (``trap '' USR1``), every worker
notes it. At the next step's checkpoint decision the ranks agree (one all-reduce of a flag,
only when the variable is set), and the leader saves that step, so the job the launcher
submits to continue it (``launch/slurm_jobs.py``) loses at most a step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SAVE_SIGNAL_ENV = "TITAN_KEDRO_SAVE_SIGNAL"
"""The signal's name (``USR1``) the scheduler sends before the time limit; unset: none."""


class SaveSignal:
    """Notes the scheduler's warning signal; :meth:`due` says when to save (collective).

    Args:
        environ: The environment (default ``os.environ``); ``TITAN_KEDRO_SAVE_SIGNAL`` unset
            leaves it off (no handler, no collective).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        name = env.get(SAVE_SIGNAL_ENV) or ""
        self.signal = getattr(signal, f"SIG{name.upper()}", None) if name else None
        if name and self.signal is None:
            raise ValueError(f"{SAVE_SIGNAL_ENV}={name!r} is no signal name (e.g. USR1)")
        self._seen = threading.Event()
        if self.signal is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self.signal, lambda signum, frame: self._seen.set())

    @property
    def enabled(self) -> bool:
        return self.signal is not None

    def due(self) -> bool:
        """Whether any rank got the signal since the last save it caused (every rank of the
        process group calls this at the same step)."""
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self._seen.is_set() else 0.0])
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return False
        self._seen.clear()
        logger.warning("the scheduler warned that the job ends soon: saving a checkpoint")
        return True
