"""Peak resident memory of real FSDP workers: sharded initialisation against a whole build.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_init_memory.py [--baseline SRC]

A DeepSeek-V2 of 24 blocks, 512 wide, 38 routed experts and V2's 102,400-token vocabulary
(489.5M parameters, 1.82 GiB of float32 weights) trains 2 steps on 8 CPU ranks with FSDP 8
(``python -m titan_kedro.train`` under torchrun, one thread a rank:
``plan.real_check.worker_peak_resident``), and so does the same model 64 wide (30M
parameters). Rank 0's peak resident set (VmHWM) of the small run is the process's fixed
cost (interpreter, libraries, process group); the difference is what the large model
costs a rank, reported as a multiple of the large model's whole float32 weights.

Sharded training needs about 0.75 × of them on 8 ranks (params, gradients and AdamW's two
moments of a shard: 4 × 1/8, plus a gathered block or two); a rank that first builds and
initialises the whole model needs more than 1 ×. ``--baseline SRC`` runs the same pair
with the workers importing another checkout's ``src`` (e.g. a worktree of the commit
before sharded initialisation), in the same run.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from titan_kedro.plan.real_check import worker_peak_resident

RANKS = 8
LARGE = {"dim": 512, "n_layers": 24, "n_routed_experts": 38}
SMALL = {**LARGE, "dim": 64}


def job(overrides: dict[str, int]) -> dict[str, Any]:
    """2 steps of DeepSeek-V2 with ``overrides`` on ``RANKS`` CPU ranks, FSDP over all."""
    return {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": overrides},
        "training": {"steps": 2, "seq_len": 64, "local_batch_size": 1, "device": "cpu",
                     "num_threads": 1, "fused_loss": True},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": {"expert_parallel_degree": 1},
        "launch": {"nproc_per_node": RANKS},
        "metrics": {"log_freq": 1, "enable_mlflow": False},
    }  # fmt: skip


def weights_gib(overrides: dict[str, int]) -> float:
    from titan_kedro.models.registry import get_train_spec

    spec = get_train_spec("deepseek_v2")
    with torch.device("meta"):
        model = spec.build_model(spec.resolve_args("debugmodel", overrides))
    return sum(p.numel() for p in model.parameters()) * 4 / 2**30


def measure(src: str | None) -> dict[str, float]:
    env = None if src is None else {"PYTHONPATH": os.path.abspath(src)}
    peaks = {}
    for name, overrides in (("small", SMALL), ("large", LARGE)):
        try:
            row = worker_peak_resident(job(overrides), RANKS, env=env, timeout_s=1500)
            peaks[name] = row["vmhwm_gib"]
        except Exception as err:  # a rank killed for lack of memory, for instance
            print(f"  {name}: failed: {str(err)[-1500:]}")
            peaks[name] = float("nan")
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another checkout's src folder for the workers")
    args = parser.parse_args()
    full = weights_gib(LARGE)
    print(f"large model: {full:.3f} GiB of float32 weights; {RANKS} ranks, FSDP {RANKS}")
    runs = {"this code": None} | ({"baseline": args.baseline} if args.baseline else {})
    for label, src in runs.items():
        peaks = measure(src)
        grown = peaks["large"] - peaks["small"]
        print(
            f"{label}: rank 0 VmHWM small {peaks['small']:.3f} GiB, large {peaks['large']:.3f}"
            f" GiB, large − small {grown:.3f} GiB = {grown / full:.3f} × the full weights"
        )


if __name__ == "__main__":
    main()
