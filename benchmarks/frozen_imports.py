"""A ``kedro run``-shaped process with and without ``runs.frozen_imports``.

Each child process imports what ``kedro run`` imports before its first node (Kedro, the
project's hooks: torch, DCP, MLflow), plans the ``conf/test`` job (one fake training step
on 2 fake ranks, which makes many Python objects and so full collections) and exits.
``frozen`` children import inside ``frozen_imports()`` and call ``freeze_at_exit()``, as
``settings.py`` does; ``plain`` ones do neither. The pairs run interleaved, one child at a
time, on the same interpreter and threads; the child's own CPU (user + system, from
``wait4``) and wall are compared by their medians.

    PYTHONPATH=src .venv/bin/python benchmarks/frozen_imports.py [--pairs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import contextlib, sys
from titan_kedro.runs.frozen_imports import freeze_at_exit, frozen_imports

frozen = sys.argv[1] == "frozen"
if frozen:
    freeze_at_exit()
with frozen_imports() if frozen else contextlib.nullcontext():
    import kedro.framework.session  # noqa: F401
    import titan_kedro.hooks  # noqa: F401
    from titan_kedro.models.resolve import resolve_job_config
    from titan_kedro.plan import build_plan

job = {
    "model": {"name": "deepseek_v2", "flavor": "debugmodel"},
    "launch": {"nproc_per_node": 2},
    "parallelism": {"expert_parallel_degree": 2},
    "training": {"seq_len": 64, "local_batch_size": 4, "steps": 12},
}
build_plan(resolve_job_config(job))
"""


def child(mode: str) -> tuple[float, float]:
    """One child's CPU seconds (user + system) and wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            log.seek(0)
            raise SystemExit(f"the {mode} child failed:\n{log.read().decode()[-4000:]}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> None:
    """Run the pairs and print each mode's medians and the ratio frozen / plain."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    pairs = parser.parse_args().pairs
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "frozen": []}
    child("plain")  # warm the page cache and the bytecode caches; not counted
    for _ in range(pairs):
        for mode, values in runs.items():
            values.append(child(mode))
    cpu = {mode: statistics.median(c for c, _ in values) for mode, values in runs.items()}
    wall = {mode: statistics.median(w for _, w in values) for mode, values in runs.items()}
    for mode in runs:
        print(f"{mode:>6}: median CPU {cpu[mode]:.2f} s, median wall {wall[mode]:.2f} s")
    print(f"frozen / plain: CPU {cpu['frozen'] / cpu['plain']:.3f}, "
          f"wall {wall['frozen'] / wall['plain']:.3f} ({pairs} pairs)")  # fmt: skip


if __name__ == "__main__":
    main()
