"""``plan.search`` for DeepSeek-V2 236B and DeepSeek-V3 671B on 128 and 512 H200.

Times each search (``titan_kedro.plan.search.search_layouts``: enumerate, prune, validate,
measure the promising layouts with the fake-step planner, rank) on this machine and
prints its table; benchmarks/RESULTS.md ("Layout search") records the figures. No GPU:
the models are sharded on the meta device under a fake process group.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_search.py [--only v2-128]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan.search import search_layouts
from titan_kedro.plan.search_table import choose_layout, format_search

MODELS = {
    "v2": {"name": "deepseek_v2", "flavor": "v2"},
    "v3": {"name": "deepseek_v3", "flavor": "671B"},
}
"""DeepSeek-V2 236B (the ``v2`` flavor) and DeepSeek-V3 671B (MTP as released: depth 1)."""
GLOBAL_BATCH = 1536
"""Samples of 4096 tokens per step, for both models: a multiple of every data-parallel
degree of 128 and 512 ranks (DeepSeek-V2 and V3 trained at 9216 and 15360 sequences per
step at the end of their batch-size ramps; fewer keeps a pipeline's microbatches and the
step time in the range torchtitan's and Megatron's recipes use)."""


def case(model: str, ranks: int) -> dict:
    """The job: seq 4096, micro-batch 1, bf16 on H200, the plan chooses the recompute."""
    return {
        "model": MODELS[model],
        "launch": {"nproc_per_node": 8, "nnodes": ranks // 8},
        "training": {
            "device": "cuda", "seq_len": 4096, "local_batch_size": 1,
            "global_batch_size": GLOBAL_BATCH, "activation_checkpoint": "auto",
            "steps": 1000,
        },
        "parallelism": {"expert_parallel_degree": 8},
        "plan": {"gpu": "H200", "search": True},
    }  # fmt: skip


def main() -> None:
    """Search each case; print its table, the chosen row and the seconds it took."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("titan_kedro.plan.search").setLevel(logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="one case, e.g. v2-128")
    names = [f"{m}-{r}" for m in MODELS for r in (128, 512)]
    only = parser.parse_args().only
    for name in [n for n in names if only in (None, n)]:
        model, ranks = name.split("-")
        start, cpu = time.perf_counter(), time.process_time()
        search = search_layouts(resolve_job_config(case(model, int(ranks))))
        chosen = choose_layout(search, enforce=False)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"## {name}: searched in {seconds:.0f} s wall, {cpu:.0f} s CPU")
        print(format_search(search))
        print(json.dumps({"case": name, "seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "chosen": chosen["layout"],
                          "failed": search["failed"],
                          "refused_examples": search["refused_examples"][:3]}))  # fmt: skip


if __name__ == "__main__":
    main()
