"""Memory and cost plans of DeepSeek-V3 16B on 8 × H200 and 671B on 256 × H200 with EP.

Prints ``format_plan`` (today's planner, ``titan_kedro.plan``) for the two layouts recorded
in benchmarks/RESULTS.md ("DeepSeek-V3 plans"). No GPU needed: the model is sharded on
the meta device under a fake process group.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_deepseek_v3.py
"""

from __future__ import annotations

import json
import time

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan.planner import build_plan, format_plan

CASES = {
    "DSV3-16B (MTP 1), 8 x H200, EP 8": {
        "model": {"name": "deepseek_v3", "flavor": "16B", "mtp_depth": 1},
        "launch": {"nproc_per_node": 8, "nnodes": 1},
        "training": {
            "device": "cuda", "seq_len": 4096, "local_batch_size": 2, "global_batch_size": 64,
            "activation_checkpoint": "full", "steps": 10000,
        },
        "parallelism": {"expert_parallel_degree": 8},
        "plan": {"gpu": "H200"},
    },
    "DSV3-671B (MTP 1), 256 x H200, EP 64": {
        "model": {"name": "deepseek_v3", "flavor": "671B"},
        "launch": {"nproc_per_node": 8, "nnodes": 32},
        "training": {
            "device": "cuda", "seq_len": 4096, "local_batch_size": 1, "global_batch_size": 1024,
            "activation_checkpoint": "full", "steps": 10000,
        },
        "parallelism": {"expert_parallel_degree": 64},
        "plan": {"gpu": "H200"},
    },
}  # fmt: skip


def main() -> None:
    """Plan each case and print the readable plan plus the per-rank GiB as JSON."""
    for name, raw in CASES.items():
        start = time.perf_counter()
        plan = build_plan(resolve_job_config(raw))
        print(f"## {name}  (planned in {time.perf_counter() - start:.0f} s)")
        print(format_plan(plan))
        print(json.dumps({k: plan[k] for k in ("layout", "gib_per_rank", "fits", "headroom_gib")}))


if __name__ == "__main__":
    main()
