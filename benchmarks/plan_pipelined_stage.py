"""The plan of V3 671B on 128 H200 at PP 2 (Interleaved1F1B) x shard 64 x EP 64: its breakdown.

PYTHONPATH=src .venv/bin/python benchmarks/plan_pipelined_stage.py
"""

import json
import sys

sys.path.insert(0, "benchmarks")
from plan_search import case

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan
from titan_kedro.plan.report import format_plan

raw = case("v3", 128)
raw["plan"] = {"gpu": "H200"}
raw["parallelism"] = {
    "pipeline_parallel_degree": 2,
    "pipeline_schedule": "Interleaved1F1B",
    "expert_parallel_degree": 64,
}
plan = build_plan(resolve_job_config(raw))
print(format_plan(plan))
print(json.dumps({k: round(v, 2) for k, v in plan["gib_per_rank"].items()}))
print(json.dumps(plan["pipeline"]["held_bytes"]), plan["fits"])
