"""``data.tokenize``: where ``data_processing`` tokenizes the shards (here, or as a TorchX job)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt, field_validator

from titan_kedro.config.sections.base import Section
from titan_kedro.config.sections.launch import LOCAL_CWD_SCHEDULER, LOCAL_SCHEDULER, scheduler_names

LOCAL_EXECUTOR = "local"
"""``data.tokenize.executor`` value for this machine's process pool (``data.num_workers``)."""
TORCHX_EXECUTOR = "torchx"
"""``data.tokenize.executor`` value for a TorchX job of ``tasks`` tasks, one shard range each."""


class TokenizeSection(Section):
    executor: Literal["local", "torchx"] = LOCAL_EXECUTOR
    """``local``: this process and its pool tokenize every shard; ``torchx``: a TorchX job on
    ``scheduler`` with ``tasks`` tasks, each tokenizing one contiguous range of the shards,
    then this process merges their results (``data.task_plan``)."""
    scheduler: str = LOCAL_CWD_SCHEDULER
    """TorchX scheduler of the ``torchx`` executor: ``local_cwd`` (tasks on this machine),
    ``slurm`` (one node per task; ``data.intermediate_dir`` and the shards on shared storage)."""
    tasks: StrictInt = Field(2, ge=1)
    """How many tasks (TorchX replicas) share the shards; more tasks than shards are not started."""
    scheduler_args: dict[str, Any] = Field(default_factory=dict)
    """TorchX run options of ``scheduler`` (slurm ``partition``/``time``, …), plus ``image``
    for schedulers that run a container."""
    cpus: StrictInt = Field(2, ge=1)
    """CPU cores each task asks the scheduler for (its lanes: ``data.num_workers``, 0 = all)."""
    memory_mb: StrictInt = Field(4096, ge=1)
    """Host memory each task asks the scheduler for, in MB."""
    log_dir: str = "data/07_model_output/logs/tokenize"
    """Where ``local_cwd`` keeps the tasks' output (Slurm writes ``slurm-*.out`` in the
    working directory)."""
    timeout_s: StrictInt | None = Field(None, gt=0)
    """Cancel the tokenizing job after this many seconds (None: no limit); finished tasks stay
    done for the relaunch."""

    @field_validator("scheduler")
    @classmethod
    def _torchx_scheduler(cls, value: str) -> str:
        names = [n for n in scheduler_names() if n != LOCAL_SCHEDULER]
        if value not in names:
            hint = (
                " (`local` is data.tokenize.executor: local, not a TorchX scheduler)"
                if value == LOCAL_SCHEDULER
                else ""
            )
            raise ValueError(
                f"unknown TorchX scheduler {value!r}{hint}; set data.tokenize.scheduler to one "
                f"of: {', '.join(names)}"
            )
        return value
