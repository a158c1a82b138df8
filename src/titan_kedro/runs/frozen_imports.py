"""Keep the cyclic garbage collector off the objects that imports leave behind.

A process that imports torch (with ``torch._dynamo``, which FSDP2 and DCP pull in), MLflow
and Kedro holds about 420,000 objects that live as long as it does: modules, functions,
classes, op tables. Python's cyclic collector walks them again and again while they are
imported (about 0.6 s of CPU), in every later full collection (about 0.2 s each on one
core; a ``kedro run`` of ``conf/test`` makes about ten, a worker about eight) and once more
while the interpreter shuts down (about 1 s). Objects in the permanent generation
(``gc.freeze``) are skipped by all of these. They are still freed by reference counting;
only a cycle among them would never be collected, which costs nothing for objects that
live until exit anyway. ``benchmarks/frozen_imports.py`` measures the difference.

The processes this project starts use both helpers: the training worker, the loopback
torchrun agent and ``kedro run`` (through ``settings.py`` and the pipeline registry).
"""

from __future__ import annotations

import atexit
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_imports() -> Iterator[None]:
    """Import inside this block: the collector pauses meanwhile (imports make few cycles)
    and every object alive at its end is frozen, so later collections skip it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@functools.cache  # registered once per process, however many entry points call it
def freeze_at_exit() -> None:
    """Leave every object out of the interpreter's collections at exit.

    Registered early, so it runs after the exit handlers registered later (``atexit`` runs
    them in reverse order): MLflow's run end and logging's flush still run first.
    """
    atexit.register(gc.freeze)
