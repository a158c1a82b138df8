"""What the planned device offers: memory and peak FLOP/s."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from titan_kedro.train.metrics import gpu_peak_tflops, lookup_gpu, measure_matmul_tflops

GIB = 1024**3
"""Bytes per GiB (the plan's unit)."""

GPU_MEMORY_GIB: dict[str, float] = {
    "H200": 141.0,
    "H100": 80.0,
    "H800": 80.0,
    "H20": 96.0,
    "B200": 180.0,
    "GB200": 186.0,
    "A100": 80.0,
    "A800": 80.0,
    "A10G": 24.0,
    "A10": 24.0,
    "L40S": 48.0,
    "L40": 48.0,
    "L4": 24.0,
    "RTX 4090": 24.0,
    "RTX 3090": 24.0,
    "V100": 32.0,
    "T4": 16.0,
}
"""Device memory per GPU model, in GiB as the vendors state it (largest variant)."""

GPU_MEMORY_BANDWIDTH_GBS: dict[str, float] = {
    "H200": 4800.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "H20": 4000.0,
    "B200": 8000.0,
    "GB200": 8000.0,
    "A100": 2039.0,
    "A800": 2039.0,
    "A10G": 600.0,
    "A10": 600.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "V100": 900.0,
    "T4": 320.0,
}
"""Memory bandwidth per GPU model in GB/s as the vendors state it (SXM / largest variant),
for the roofline step time."""


@dataclass(frozen=True)
class PlannedDevice:
    """The device one rank runs on."""

    kind: str
    """``cuda`` or ``cpu``."""
    name: str
    """GPU model (``H100``…) or ``cpu``."""
    memory_gib: float
    """Memory one rank may use."""
    peak_tflops: float
    """Dense peak in the compute dtype (the MFU denominator)."""
    bandwidth_gbs: float | None
    """Memory bandwidth in GB/s (table for GPUs, measured for the CPU); None: not in the
    table (the roofline then counts FLOPs only)."""


def planned_kind(job_config: Any) -> str:
    """``cuda`` or ``cpu``: what ``training.device`` means for the plan (``auto``: this machine)."""
    device = job_config.training.device
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def planned_device(job_config: Any, compute_dtype: torch.dtype) -> PlannedDevice:
    """The device of ``training.device`` with ``plan`` overrides applied.

    CUDA: this machine's GPU if it has one, else ``plan.gpu``; memory from
    ``plan.device_memory_gib`` or ``GPU_MEMORY_GIB``, peak from ``metrics.peak_tflops`` or
    the bf16 table. CPU: the host memory shared by ``launch.nproc_per_node`` ranks (or
    ``plan.device_memory_gib``), and a measured matmul rate (or ``metrics.peak_tflops``).

    Raises:
        ValueError: The GPU model is in neither table and no override is set.
    """
    plan = job_config.plan
    override_peak = job_config.metrics.peak_tflops
    if planned_kind(job_config) == "cuda":
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else plan.gpu
        memory = plan.device_memory_gib or lookup_gpu(GPU_MEMORY_GIB, name)
        peak = override_peak or gpu_peak_tflops(name)
        if memory is None or peak is None:
            raise ValueError(
                f"plan: GPU '{name}' is not in the memory/peak tables; set "
                f"plan.device_memory_gib and metrics.peak_tflops (known: {sorted(GPU_MEMORY_GIB)})"
            )
        bandwidth = lookup_gpu(GPU_MEMORY_BANDWIDTH_GBS, name)
        return PlannedDevice("cuda", name, float(memory), float(peak), bandwidth)
    memory = plan.device_memory_gib or (
        psutil.virtual_memory().total / 2**30 / job_config.launch.nproc_per_node
    )
    peak = override_peak or measure_matmul_tflops(compute_dtype, "cpu", min_seconds=0.1)
    return PlannedDevice("cpu", "cpu", float(memory), float(peak), measure_copy_gbs())


def measure_copy_gbs(megabytes: int = 64, repeats: int = 5) -> float:
    """This machine's memory bandwidth in GB/s: the best of a few large copies (read + write)."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best / 1e9
