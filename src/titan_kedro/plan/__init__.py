"""Memory and cost plan of a training job, measured on the sharded model without a GPU.

``build_plan(resolved)`` builds the model on the meta device under a fake process group
of the configured world size, applies the spec's own ``parallelize_fn`` and reads the
per-rank bytes from the sharded tensors. It sits above ``models`` and ``train`` (it uses
both); neither imports it.
"""

from titan_kedro.plan.planner import PlanDoesNotFitError, build_plan, check_plan_fits, format_plan

__all__ = ["PlanDoesNotFitError", "build_plan", "check_plan_fits", "format_plan"]
