"""Tokenize the shards as a TorchX job: one task per shard range, then merge (``executor: torchx``).

The engine is TorchX, over the schedulers training uses (``local_cwd``, ``slurm``, …;
docs/ARCHITECTURE.md says why not datatrove). ``tokenize_with_torchx`` writes the plan
(``data.task_plan``), submits one replica per unfinished task running
``python -m titan_kedro.data.tokenize_task``, echoes each task's output prefixed
``[task i]``, shows ``tokenize: k/n tasks done`` as done markers appear, and merges when
all are done. A failed job raises ``TokenizeFailedError`` with the failing task's log tail;
finished tasks stay done, so the same command redoes only the rest.

Nothing secret enters the request: the tasks need no tracking, their environment in the
request is fixed here, and echoed lines and errors are redacted (``secrets.redact``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from torchx import specs
from torchx.specs import AppState, AppStatus, macros

from titan_kedro.config.sections.launch import LOCAL_CWD_SCHEDULER
from titan_kedro.data.sources import ShardFile
from titan_kedro.data.task_plan import (
    SETTINGS,
    TaskPlan,
    is_finished,
    merge_tasks,
    record_finished,
    write_plan,
)
from titan_kedro.data.tokenizer import Tokenizer
from titan_kedro.launch.appdef import HOST_SCHEDULERS
from titan_kedro.launch.runner import get_runner
from titan_kedro.launch.scheduler import (
    _install_interrupt_handlers,
    dryrun_info,
    render_request,
    signals_restored,
)
from titan_kedro.launch.secrets import redact, tracking_secrets
from titan_kedro.launch.supervise import OutputFollower, supervise, wait_until

ROLE = "tokenize"
TAIL_LINES = 60
TASK_MODULE = "titan_kedro.data.tokenize_task"


class TokenizeFailedError(RuntimeError):
    """The tokenizing job did not finish every task; the message holds a failing task's log."""


def tokenize_appdef(tokenize: Any, plan: TaskPlan, pending: Sequence[int]) -> specs.AppDef:
    """The TorchX job running tasks ``pending`` of ``plan``: one replica each.

    Args:
        tokenize: The ``data.tokenize`` section (scheduler, cpus, memory, image).
        plan: The written plan (an absolute path: the tasks may run elsewhere).
        pending: The tasks to run; replica ``r`` runs ``pending[r]``.
    """
    host = tokenize.scheduler in HOST_SCHEDULERS
    args = ["-m", TASK_MODULE, "--plan", str(plan.path), "--tasks", ",".join(map(str, pending))]
    return specs.AppDef(
        name="tokenize",
        roles=[
            specs.Role(
                name=ROLE,
                image=str(tokenize.scheduler_args.get("image", Path.cwd())),
                entrypoint=sys.executable if host else "python",
                args=[*args, "--replica", macros.replica_id],
                env={"PYTHONUNBUFFERED": "1"},
                num_replicas=len(pending),
                resource=specs.Resource(cpu=tokenize.cpus, gpu=0, memMB=tokenize.memory_mb),
                max_retries=0,
            )
        ],
    )


def _launch_options(tokenize: Any) -> Any:
    """``data.tokenize`` as the launch options ``scheduler.dryrun_info`` reads (no ``image``)."""
    args = {k: v for k, v in tokenize.scheduler_args.items() if k != "image"}
    return tokenize.model_copy(update={"scheduler_args": args})


def plan_tasks(
    data: Any, sources: Sequence[ShardFile], tokenizer: Tokenizer
) -> tuple[TaskPlan, list[int]]:
    """Write the plan of ``data.tokenize.tasks`` shard ranges; it and its unfinished tasks."""
    settings = {key: getattr(data, key) for key in SETTINGS}
    root = Path(data.intermediate_dir).absolute()
    plan = write_plan(root, sources, tokenizer, settings, data.tokenize.tasks)
    return plan, [k for k in range(len(plan.tasks)) if not is_finished(plan, k)]


def tokenize_request(data: Any, sources: Sequence[ShardFile], tokenizer: Tokenizer) -> str:
    """What the scheduler would be sent for the unfinished tasks (the sbatch script, …),
    credentials masked; the plan is written, nothing is submitted."""
    plan, pending = plan_tasks(data, sources, tokenizer)
    app = tokenize_appdef(data.tokenize, plan, pending)
    with signals_restored(), get_runner() as runner:
        return render_request(dryrun_info(runner, app, _launch_options(data.tokenize)), os.environ)


def tokenize_with_torchx(
    data: Any,
    sources: Sequence[ShardFile],
    tokenizer: Tokenizer,
    *,
    console: IO[str] | None = None,
    poll_s: float | None = None,
) -> list[dict[str, Any]]:
    """Tokenize ``sources`` as ``data.tokenize.tasks`` TorchX tasks; their entries, merged.

    Args:
        data: The ``data`` section (``intermediate_dir``, the tokenizing settings, ``tokenize``).
        sources: The local shards, in order.
        tokenizer: The tokenizer every task must resolve (same fingerprint).
        console: Where progress and the tasks' output go (default ``sys.stdout``).
        poll_s: Seconds between status checks (default 0.5 for ``local_cwd``, else 2).

    Returns:
        One manifest entry per source, in order, as ``tokenize_sources`` returns them.

    Raises:
        TokenizeFailedError: A task failed, or the job was cancelled or timed out.
    """
    console = console or sys.stdout
    plan, pending = plan_tasks(data, sources, tokenizer)
    total = len(plan.tasks)
    console.write(
        f"tokenize: {total} task(s) over {len(sources)} shard(s) ({plan.path.parent}); "
        f"{total - len(pending)} finished before, running {pending or 'none'}\n"
    )
    for k in pending:  # a stale marker (a shard replaced since) must not count as done
        plan.clear_done(k)
    if pending:
        _run(data.tokenize, plan, pending, console, poll_s)
    return merge_tasks(plan)


def _run(
    tokenize: Any, plan: TaskPlan, pending: list[int], console: IO[str], poll_s: float | None
) -> None:
    secrets = tracking_secrets(os.environ)
    launch = _launch_options(tokenize)
    poll_s = poll_s or (0.5 if tokenize.scheduler == LOCAL_CWD_SCHEDULER else 2.0)
    progress = _Progress(plan, console)
    with signals_restored(), get_runner() as runner:
        info = dryrun_info(runner, tokenize_appdef(tokenize, plan, pending), launch)
        _install_interrupt_handlers()
        handle = runner.schedule(info)
        console.write(f"tokenize: submitted {handle}\n")
        follower = OutputFollower(
            [_lines(runner, handle, r, secrets) for r in range(len(pending))],
            console,
            [f"[task {k}] " for k in pending],
        )

        def cancel() -> None:
            runner.cancel(handle)
            wait_until(lambda: runner.status(handle), _ended, 60)

        status, timed_out = supervise(
            lambda: progress.poll(runner.status(handle)), _ended, cancel,
            timeout_s=tokenize.timeout_s, poll_s=poll_s,
        )  # fmt: skip
        follower.join(10)
        progress.poll(status)
    failed = [r for r, k in enumerate(pending) if not plan.marked_done(k)]
    if status is not None and status.state == AppState.SUCCEEDED and not timed_out and not failed:
        return
    record_finished(plan)
    reason = (
        f"ran past data.tokenize.timeout_s={tokenize.timeout_s}s and was cancelled"
        if timed_out
        else f"ended {'gone from the scheduler' if status is None else status.state.name}"
    )
    r = failed[0] if failed else 0
    shards = [s["name"] for s in plan.tasks[pending[r]]]
    tail = "".join(list(follower.tails[r])[-TAIL_LINES:])
    raise TokenizeFailedError(
        redact(
            f"tokenizing job {handle} {reason}; unfinished tasks: {[pending[f] for f in failed]} "
            f"of {len(plan.tasks)}. Finished tasks are kept (their shards are recorded in "
            "manifest.json): run the same command again to redo only the others.\n"
            f"--- task {pending[r]} ({shards[0]} … {shards[-1]}) output "
            f"(last {TAIL_LINES} lines) ---\n{tail}",
            secrets,
        )
    )


def _lines(runner: Any, handle: str, replica: int, secrets: list[str]) -> Callable[[], Any]:
    def lines() -> Any:
        for line in runner.log_lines(handle, ROLE, replica, should_tail=True):
            yield redact(line, secrets)

    return lines


def _ended(status: AppStatus | None) -> bool:
    return status is None or status.is_terminal()


class _Progress:
    """Writes ``tokenize: k/n tasks done`` whenever the count of done markers changes."""

    def __init__(self, plan: TaskPlan, console: IO[str]) -> None:
        self.plan, self.console, self.shown = plan, console, -1

    def poll(self, status: AppStatus | None) -> AppStatus | None:
        total = len(self.plan.tasks)
        done = sum(self.plan.marked_done(k) for k in range(total))
        if done != self.shown:
            self.shown = done
            self.console.write(f"tokenize: {done}/{total} tasks done\n")
            self.console.flush()
        return status
