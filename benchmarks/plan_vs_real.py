"""The plan's fake step against the same step run for real on this machine's CPU.

For each configuration: the planned peak per rank (``build_plan``: one fake step under
``FSDPMemTracker``), the real tracker's peak on rank 0 of a real CPU run (world 1, or
world 2 over gloo with EP 2), the growth of the real process's peak resident memory
(``VmHWM``, the independent witness), and the plan's roofline step time against the
real step's wall time. Prints a Markdown table (the one in benchmarks/RESULTS.md).

    PYTHONPATH=src .venv/bin/python benchmarks/plan_vs_real.py [--only NAME]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan
from titan_kedro.plan.real_check import measure_real

MIB = 2**20
LLAMA_200M_SHAPE = {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 8192}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-debug seq256 b4 (1 rank)": {
        "model": {"name": "llama3", "flavor": "debugmodel", "overrides": {"vocab_size": 2048}},
        "training": {"seq_len": 256, "local_batch_size": 4},
    },
    "dsv2-debug seq512 b2 (2 ranks, EP 2)": {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": {"vocab_size": 2048}},
        "launch": {"nproc_per_node": 2},
        "parallelism": {"expert_parallel_degree": 2},
        "training": {"seq_len": 512, "local_batch_size": 2},
    },
    "llama-8L-512d seq1024 b4 (1 rank)": {
        "model": {"name": "llama3", "flavor": "debugmodel", "overrides": LLAMA_200M_SHAPE},
        "training": {"seq_len": 1024, "local_batch_size": 4},
    },
    "llama-8L-512d seq1024 b4 AC full (1 rank)": {
        "model": {"name": "llama3", "flavor": "debugmodel", "overrides": LLAMA_200M_SHAPE},
        "training": {"seq_len": 1024, "local_batch_size": 4, "activation_checkpoint": "full"},
    },
}


def compare(raw: dict[str, Any]) -> dict[str, Any]:
    """Plan and real figures of one configuration."""
    raw = {**raw, "training": {"device": "cpu", **raw["training"]}}
    world = raw.get("launch", {}).get("nproc_per_node", 1)
    start = time.perf_counter()
    plan = build_plan(resolve_job_config(raw))
    planned_s = time.perf_counter() - start
    real = measure_real(raw, world)
    planned = plan["bytes_per_rank"]
    states = planned["params"] + planned["grads"] + planned["optimizer"]
    return {
        "planned_mib": planned["total"] / MIB,
        "activations_mib": (planned["activations"] + planned["temporaries"]) / MIB,
        "states_mib": states / MIB,
        "real_mib": real["tracker_peak"] / MIB,
        "ratio": planned["total"] / real["tracker_peak"],
        "rss_mib": real["rss_growth"] / MIB,
        "peak_at": f"{plan['peak_at']['phase']} {plan['peak_at']['module']}",
        "roofline_s": plan["cost"]["roofline_step_time_s"],
        "real_step_s": real["step_s"],
        "step_ratio": real["step_s"] / plan["cost"]["roofline_step_time_s"],
        "planned_in_s": planned_s,
    }


def main() -> None:
    """Run every configuration (or ``--only``) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the configurations whose name contains this")
    args = parser.parse_args()
    print(
        "| configuration | planned peak MiB (acts+temps / states) | real tracker peak MiB | "
        "planned / real | real VmHWM growth MiB | peak at | roofline s | real step s | "
        "real / roofline | plan s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, raw in CONFIGS.items():
        if args.only and args.only not in name:
            continue
        r = compare(raw)
        print(
            f"| {name} | {r['planned_mib']:.1f} ({r['activations_mib']:.1f} / "
            f"{r['states_mib']:.1f}) | {r['real_mib']:.1f} | {r['ratio']:.3f} | "
            f"{r['rss_mib']:.1f} | {r['peak_at']} | {r['roofline_s']:.3g} | "
            f"{r['real_step_s']:.3g} | {r['step_ratio']:.2f} | {r['planned_in_s']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
