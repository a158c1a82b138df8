"""The plan against the real training workers: planned ΔPeak against measured ΔVmHWM.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_vs_vmhwm.py [--only FAMILY]

For each model family, two configurations of the same model (A and B: sequence length
and batch size differ) are planned (``build_plan``, rank 0) and then trained for real by
``python -m titan_kedro.train`` under torchrun (``plan.real_check.worker_peak_resident``:
one CPU rank, one thread, 3 steps, validation, checkpoints and MLflow off), and rank 0's
peak resident set at the last step (``vmhwm_gib``, logged by the trainer on CPU) is read
from its ``metrics.jsonl``. The process's fixed cost (interpreter, libraries, the
process group, the data loader) and the model's states are the same in A and B, so they
cancel in B − A; what remains is the step's activations and temporaries, which the
plan's B − A should match.

Each pair runs under two allocator settings, the same for A and B:

- ``heap`` — the worker as users run it: ``training.cpu_keep_freed_memory`` true, which
  serves every tensor from glibc's heap and never trims it (``M_MMAP_MAX=0``), so the
  resident set is the heap's high-water mark, holes between live blocks included.
- ``mmap`` — ``training.cpu_keep_freed_memory`` false and ``MALLOC_MMAP_THRESHOLD_=65536``:
  every block of 64 KiB or more is its own mapping, unmapped when freed, so the resident
  set follows the live tensors. The threshold is fixed because glibc's default one is
  dynamic (it rises to the size of the largest block freed, up to 32 MiB, and blocks
  below it then come from the heap again), which would make the two configurations'
  allocators behave differently.
"""

from __future__ import annotations

import argparse
from typing import Any

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan
from titan_kedro.plan.real_check import worker_peak_resident

MIB = 2**20
VOCAB = 2048
STEPS = 3
A = {"seq_len": 256, "local_batch_size": 2}
B = {"seq_len": 512, "local_batch_size": 4}

FAMILIES: dict[str, dict[str, Any]] = {
    "Llama 3 (debugmodel)": {"name": "llama3", "flavor": "debugmodel"},
    "DeepSeek-V2 (debugmodel)": {"name": "deepseek_v2", "flavor": "debugmodel"},
    "DeepSeek-V3 (debugmodel, MTP 1)": {
        "name": "deepseek_v3",
        "flavor": "debugmodel",
        "mtp_depth": 1,
    },
}

ALLOCATORS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "heap": ({"cpu_keep_freed_memory": True}, {}),
    "mmap": ({"cpu_keep_freed_memory": False}, {"MALLOC_MMAP_THRESHOLD_": "65536"}),
}


def job(model: dict[str, Any], shape: dict[str, int], **training: Any) -> dict[str, Any]:
    """The raw job: ``model`` with a small vocabulary, ``shape``, one CPU rank."""
    model = {**model, "overrides": {"vocab_size": VOCAB, **model.get("overrides", {})}}
    return {
        "model": model,
        "metrics": {"peak_tflops": 1.0},
        "plan": {"device_memory_gib": 16.0},
        "training": {"device": "cpu", "steps": STEPS, "num_threads": 1, **shape, **training},
        "lr_scheduler": {"warmup_steps": 1},  # a warm-up within the run's few steps
    }


def planned_peak(raw: dict[str, Any]) -> int:
    """Rank 0's planned peak bytes."""
    return int(build_plan(resolve_job_config(raw))["bytes_per_rank"]["total"])


def measured_peak(raw: dict[str, Any], allocator: str) -> dict[str, Any]:
    """Rank 0's last logged row of a real run under ``allocator`` (``ALLOCATORS``)."""
    training, env = ALLOCATORS[allocator]
    raw = {**raw, "training": {**raw["training"], **training}}
    return worker_peak_resident(raw, 1, env=env)


def compare(model: dict[str, Any], allocators: tuple[str, ...] = tuple(ALLOCATORS)) -> dict:
    """Planned B − A and, per allocator, measured B − A of VmHWM (MiB) for one family."""
    raw_a, raw_b = job(model, A), job(model, B)
    plan_a, plan_b = planned_peak(raw_a), planned_peak(raw_b)
    out: dict[str, Any] = {
        "plan_a_mib": plan_a / MIB,
        "plan_b_mib": plan_b / MIB,
        "planned_delta_mib": (plan_b - plan_a) / MIB,
    }
    for allocator in allocators:
        real_a, real_b = measured_peak(raw_a, allocator), measured_peak(raw_b, allocator)
        delta = (real_b["vmhwm_gib"] - real_a["vmhwm_gib"]) * 1024
        out[allocator] = {
            "vmhwm_a_mib": real_a["vmhwm_gib"] * 1024,
            "vmhwm_b_mib": real_b["vmhwm_gib"] * 1024,
            "rss_a_mib": real_a["memory_gib"] * 1024,
            "rss_b_mib": real_b["memory_gib"] * 1024,
            "delta_mib": delta,
            "ratio": delta / out["planned_delta_mib"],
            "wall_s": real_a["wall_s"] + real_b["wall_s"],
        }
    return out


def shape_name(shape: dict[str, int]) -> str:
    return f"seq {shape['seq_len']} × b {shape['local_batch_size']}"


def main() -> None:
    """Run every family (or ``--only``) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the families whose name contains this")
    args = parser.parse_args()
    print(
        "| family | config A | config B | planned A / B MiB | planned ΔPeak MiB | "
        "allocator | measured VmHWM A / B MiB | measured ΔVmHWM MiB | measured / planned | "
        "workers s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, model in FAMILIES.items():
        if args.only and args.only not in name:
            continue
        r = compare(model)
        for allocator in ALLOCATORS:
            m = r[allocator]
            print(
                f"| {name} | {shape_name(A)} | {shape_name(B)} | {r['plan_a_mib']:.1f} / "
                f"{r['plan_b_mib']:.1f} | {r['planned_delta_mib']:.1f} | {allocator} | "
                f"{m['vmhwm_a_mib']:.1f} / {m['vmhwm_b_mib']:.1f} | {m['delta_mib']:.1f} | "
                f"{m['ratio']:.3f} | {m['wall_s']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
