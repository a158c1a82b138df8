"""Memory and cost plan of a training job, measured with one fake training step, no GPU.

``build_plan(resolved)`` shards the model with the spec's own ``parallelize_fn`` in a
fake process group of the configured world size and runs one training step on fake
tensors under ``FSDPMemTracker`` (``fake_step``): the peak per rank, its parts and where
it occurs are measured. It sits above ``models`` and ``train`` (it uses both); neither
imports it.
"""

from titan_kedro.plan.planner import (
    PlanDoesNotFitError,
    apply_plan_choices,
    build_plan,
    check_plan_fits,
    format_plan,
)
from titan_kedro.plan.search import resolve_layout, search_layouts
from titan_kedro.plan.search_table import NoLayoutFitsError, choose_layout, format_search

__all__ = [
    "NoLayoutFitsError",
    "PlanDoesNotFitError",
    "apply_plan_choices",
    "build_plan",
    "check_plan_fits",
    "choose_layout",
    "format_plan",
    "format_search",
    "resolve_layout",
    "search_layouts",
]
