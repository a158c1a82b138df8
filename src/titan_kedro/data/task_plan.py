"""Tokenizing shard ranges as separate tasks (on other machines), and merging what they wrote.

The launcher (``launch.tokenize_job``) writes a plan; each task tokenizes its range of the
shards with ``tokenize_sources`` (the same code, tokenizer wrapper and BOS/EOS rules as
the local executor) into the shared ``shards/`` folder, records them in a manifest of its
own and writes a done marker last. ``merge_tasks`` then puts every task's entries into
``manifest.json``, in shard order, so ``split``/``pack`` write exactly the token files
and ``metadata.json`` of the one-machine run. Under ``data.intermediate_dir``::

    shards/<name>-<key>/                token files (shared with the local executor)
    manifest.json                       the merged manifest
    tasks/<plan id>/plan.json           tokenizer, settings, each task's shards
    tasks/<plan id>/task-00001.json     task 1's manifest (a shard per entry, as it finishes)
    tasks/<plan id>/task-00001.done     written last, when all of task 1's shards are recorded

The plan id hashes the tokenizer, the settings and the shard names per task, not the
shards' sizes: a task is finished when its marker names the keys its shards have now
(``shard_key``: name, size, mtime, tokenizer) and their files are there, so replacing a
shard redoes only its task, and a task killed midway (no marker) is redone alone, keeping
the shards it had recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from titan_kedro.data.shard_store import ShardStore, shard_key
from titan_kedro.data.shard_tokenizing import tokenize_sources
from titan_kedro.data.sources import ShardFile, is_shard_name
from titan_kedro.data.token_store import write_json_atomic
from titan_kedro.data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
TASKS_FOLDER = "tasks"
_FORMAT = 1
SETTINGS = ("batch_size", "num_workers", "min_chars", "max_bad_fraction", "max_line_bytes")
"""The ``data`` fields a task tokenizes with (those that change the tokens come first)."""


class TaskPlanError(ValueError):
    """A plan file, or a task's part of it, cannot be used; the message says why and how to fix."""


def shard_ranges(count: int, tasks: int) -> list[range]:
    """``count`` shards in at most ``tasks`` contiguous ranges whose sizes differ by at most one.

    Example:
        >>> shard_ranges(5, 2)
        [range(0, 3), range(3, 5)]
    """
    tasks = max(1, min(tasks, count))
    base, extra = divmod(count, tasks)
    bounds = [0]
    for k in range(tasks):
        bounds.append(bounds[-1] + base + (k < extra))
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """A written plan: its file, and what it says."""

    path: Path
    content: dict[str, Any]

    @property
    def root(self) -> Path:
        """The intermediate folder (the plan lives in ``root/tasks/<id>/``)."""
        return self.path.parents[2]

    @property
    def tasks(self) -> list[list[dict[str, str]]]:
        """Each task's shards (``name`` and ``path``), in shard order."""
        return self.content["tasks"]

    def task_store(self, index: int) -> ShardStore:
        """The store task ``index`` records its shards in (its own manifest, shared folders)."""
        return ShardStore(self.root, manifest=f"{self._folder}/task-{index:05d}.json")

    def done_path(self, index: int) -> Path:
        return self.path.parent / f"task-{index:05d}.done"

    def marked_done(self, index: int) -> bool:
        """Task ``index``'s done marker is there (whatever shards it names)."""
        return self.done_path(index).is_file()

    def clear_done(self, index: int) -> None:
        """Remove task ``index``'s marker (before it is run again)."""
        self.done_path(index).unlink(missing_ok=True)

    @property
    def _folder(self) -> str:
        return self.path.parent.relative_to(self.root).as_posix()


def write_plan(
    root: str | Path,
    sources: Sequence[ShardFile],
    tokenizer: Tokenizer,
    settings: Mapping[str, Any],
    tasks: int,
) -> TaskPlan:
    """Split ``sources`` into at most ``tasks`` ranges and write the plan under ``root/tasks``."""
    content: dict[str, Any] = {
        "format": _FORMAT,
        "tokenizer": {"name_or_path": tokenizer.name, "fingerprint": tokenizer.fingerprint},
        "settings": {key: settings[key] for key in SETTINGS},
        "tasks": [
            [{"name": sources[i].name, "path": str(sources[i].path)} for i in span]
            for span in shard_ranges(len(sources), tasks)
        ],
    }
    plan_id = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(root) / TASKS_FOLDER / plan_id / PLAN_FILE
    write_json_atomic(path, content)
    return TaskPlan(path, content)


def load_plan(path: str | Path) -> TaskPlan:
    """Read a plan written by ``write_plan``, checking its place and every shard entry.

    Raises:
        TaskPlanError: Not a plan file in ``<intermediate>/tasks/<id>/``, an unknown format,
            or a shard entry that is not a C4 shard file named by its path.
    """
    p = Path(path).absolute()
    fix = "relaunch the tokenizing (data_processing) to write a new plan"
    if p.name != PLAN_FILE or p.parent.parent.name != TASKS_FOLDER:
        raise TaskPlanError(f"{p} is not a tokenizing plan (<intermediate>/tasks/<id>/plan.json)")
    try:
        content = _read_json(p)
    except (OSError, ValueError) as err:
        raise TaskPlanError(f"cannot read the plan {p}: {err}; {fix}") from err
    if not isinstance(content, dict) or content.get("format") != _FORMAT:
        raise TaskPlanError(f"{p}: unknown plan format; {fix}")
    for k, task in enumerate(content.get("tasks", [])):
        for shard in task:
            name, shard_path = shard.get("name"), shard.get("path")
            if not (
                isinstance(name, str)
                and isinstance(shard_path, str)
                and is_shard_name(name)
                and shard_path.replace("\\", "/").endswith(name)
            ):
                raise TaskPlanError(
                    f"{p}: task {k} names shard {shard!r}, which is not a C4 shard file named by "
                    f"its path; refusing to read it. The plan was edited or damaged: {fix}"
                )
    return TaskPlan(p, content)


def task_sources(plan: TaskPlan, index: int) -> list[ShardFile]:
    """Task ``index``'s shards as they are on disk now."""
    max_line_bytes = plan.content["settings"]["max_line_bytes"]
    return [
        dataclasses.replace(
            ShardFile.from_path(shard["path"], shard["name"]), max_line_bytes=max_line_bytes
        )
        for shard in plan.tasks[index]
    ]


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _keys(sources: Sequence[ShardFile], fingerprint: str) -> list[str]:
    return [shard_key(source.cache_identity(), fingerprint) for source in sources]


def _entry(plan: TaskPlan, index: int, key: str) -> dict[str, Any] | None:
    """The shard's entry in the task's manifest, else in ``manifest.json``, with its files."""
    return plan.task_store(index).lookup(key) or ShardStore(plan.root).lookup(key)


def is_finished(plan: TaskPlan, index: int) -> bool:
    """Task ``index`` wrote its marker for the shards as they are now, and their files are there."""
    if not plan.marked_done(index):
        return False
    try:
        recorded = _read_json(plan.done_path(index)).get("keys")
    except (OSError, ValueError, AttributeError):
        return False
    keys = _keys(task_sources(plan, index), plan.content["tokenizer"]["fingerprint"])
    return recorded == keys and all(_entry(plan, index, key) is not None for key in keys)


def run_task(plan: TaskPlan, index: int) -> list[dict[str, Any]]:
    """Tokenize task ``index``'s shards not recorded yet, then write its done marker (last).

    Raises:
        TaskPlanError: No such task, or this machine's tokenizer is not the plan's.
        BadInputError: A shard had too many bad records (the shards before it stay recorded).
    """
    if not 0 <= index < len(plan.tasks):
        raise TaskPlanError(f"{plan.path} has tasks 0..{len(plan.tasks) - 1}, not task {index}")
    expected = plan.content["tokenizer"]
    tokenizer = build_tokenizer(expected["name_or_path"])
    if tokenizer.fingerprint != expected["fingerprint"]:
        raise TaskPlanError(
            f"task {index}: tokenizer {expected['name_or_path']!r} on this machine has "
            f"fingerprint {tokenizer.fingerprint}, the plan's is {expected['fingerprint']}; "
            "make every node resolve the same tokenizer files (a folder on shared storage)"
        )
    sources = task_sources(plan, index)
    keys = _keys(sources, tokenizer.fingerprint)
    done = {key: entry for key in keys if (entry := ShardStore(plan.root).lookup(key))}
    settings = plan.content["settings"]
    new = tokenize_sources(
        [s for s, key in zip(sources, keys) if key not in done],
        tokenizer,
        plan.task_store(index),
        batch_size=settings["batch_size"],
        num_workers=settings["num_workers"],
        min_chars=settings["min_chars"],
        max_bad_fraction=settings["max_bad_fraction"],
    )
    entries = {**done, **{entry["key"]: entry for entry in new}}
    write_json_atomic(plan.done_path(index), {"task": index, "keys": keys})
    logger.info(
        "task %d done on %s: %d shard(s), %d tokens",
        index,
        os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        len(keys),
        sum(entries[key]["tokens"] for key in keys),
    )
    return [entries[key] for key in keys]


def record_finished(plan: TaskPlan) -> list[int]:
    """Record the finished tasks' shards in ``manifest.json``; those tasks, in order.

    After a failed job this keeps their work for any later run, a plan with another
    ``tasks`` count or the local executor included (both reuse ``manifest.json``).
    """
    fingerprint = plan.content["tokenizer"]["fingerprint"]
    finished, entries = [], []
    for index in range(len(plan.tasks)):
        if not is_finished(plan, index):
            continue
        found = [_entry(plan, index, k) for k in _keys(task_sources(plan, index), fingerprint)]
        if all(entry is not None for entry in found):  # none went away since is_finished
            finished.append(index)
            entries.extend(entry for entry in found if entry is not None)
    ShardStore(plan.root).record(entries)
    return finished


def merge_tasks(plan: TaskPlan) -> list[dict[str, Any]]:
    """Every shard's entry in shard order, recorded in ``manifest.json`` (all tasks finished).

    Raises:
        TaskPlanError: A task has not finished; the finished ones are recorded all the same.
    """
    finished = record_finished(plan)
    unfinished = sorted(set(range(len(plan.tasks))) - set(finished))
    if unfinished:
        raise TaskPlanError(
            f"tasks {unfinished} of {plan.path} have not finished; relaunch to redo them"
        )
    fingerprint = plan.content["tokenizer"]["fingerprint"]
    keys = [k for i in range(len(plan.tasks)) for k in _keys(task_sources(plan, i), fingerprint)]
    shards = ShardStore(plan.root).manifest()
    return [shards[key] for key in keys]
