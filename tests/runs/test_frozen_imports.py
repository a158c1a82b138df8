"""``runs.frozen_imports``: what a process imports stays out of the collector's walks.

Each check runs in its own interpreter: freezing is for the life of a process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    """The JSON lines a fresh interpreter prints for ``code``, merged in order."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen: dict = {}
    for line in proc.stdout.splitlines():
        seen.update(json.loads(line))
    return seen


def test_objects_made_inside_the_block_are_frozen_and_later_ones_are_collected() -> None:
    seen = _run(
        """
        import gc, json, weakref
        from titan_kedro.runs.frozen_imports import frozen_imports

        class Node:
            pass

        def cycle():
            node = Node()
            node.self = node  # garbage only the cyclic collector can free
            return weakref.ref(node)

        with frozen_imports():
            paused = not gc.isenabled()
            import decimal  # noqa: F401  (an import inside the block, as its callers do)
            before = cycle()
        enabled_after = gc.isenabled()
        after = cycle()
        gc.collect()
        gc.disable()
        with frozen_imports():
            pass
        print(json.dumps({
            "paused": paused, "enabled_after": enabled_after,
            "inside_kept": before() is not None, "after_freed": after() is None,
            "left_disabled": not gc.isenabled(), "frozen": gc.get_freeze_count(),
        }))
        """
    )
    assert seen["paused"] and seen["enabled_after"]
    # The cycle made inside the block is in the permanent generation: never walked again.
    assert seen["inside_kept"] and seen["after_freed"]
    assert seen["left_disabled"]  # a collector the caller had turned off stays off
    assert seen["frozen"] > 1000


def test_freeze_at_exit_runs_once_after_every_later_exit_handler() -> None:
    seen = _run(
        """
        import atexit, gc, json
        from titan_kedro.runs.frozen_imports import freeze_at_exit

        def report():  # registered first, so it runs last: after the freeze
            print(json.dumps({"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}))

        atexit.register(report)
        freeze_at_exit()
        freeze_at_exit()
        print(json.dumps({"handlers": atexit._ncallbacks(), "tracked_before": len(gc.get_objects())}))
        atexit.register(lambda: [[] for _ in range(1000)])  # an exit handler that allocates
        """
    )
    # gc.get_objects() lists the three generations the collector walks; frozen ones are not.
    assert seen["tracked"] < 100 < seen["frozen"]
    assert seen["tracked_before"] > 1000  # what the freeze took out of the walks
    assert seen["handlers"] == 2  # report and a single freeze
