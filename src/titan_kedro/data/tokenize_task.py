"""One tokenizing task of a TorchX job: ``python -m titan_kedro.data.tokenize_task``.

``--plan`` is the plan file (``task_plan.write_plan``), ``--tasks`` the tasks this job
runs (comma-separated; a relaunch runs only the unfinished ones) and ``--replica`` this
replica's place among them (TorchX's ``${replica_id}``): replica ``r`` runs task
``tasks[r]``. A failure exits non-zero with the error last in the output, which the
launcher shows.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from titan_kedro.data.task_plan import load_plan, run_task


def main(argv: Sequence[str] | None = None) -> int:
    """Run this replica's task; 0 when its done marker is written."""
    parser = argparse.ArgumentParser(prog="python -m titan_kedro.data.tokenize_task")
    parser.add_argument("--plan", required=True, help="the plan.json the launcher wrote")
    parser.add_argument("--tasks", required=True, help="comma-separated task indices of this job")
    parser.add_argument(
        "--replica", required=True, type=int, help="this replica's place in --tasks"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tasks = [int(t) for t in args.tasks.split(",")]
    if not 0 <= args.replica < len(tasks):
        parser.error(f"--replica {args.replica} is outside --tasks {args.tasks}")
    run_task(load_plan(args.plan), tasks[args.replica])
    return 0


if __name__ == "__main__":
    sys.exit(main())
