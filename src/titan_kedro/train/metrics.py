"""Step metrics: throughput and MFU, memory, expert load; printed, written and sent to MLflow.

Only rank 0 builds a ``MetricsLogger``. Each logged step gives one console line, one
``metrics.jsonl`` row (the MLflow keys plus ``step``, ``tokens_seen`` and, for MoE
models, ``expert_load`` as ``[layers][experts]`` fractions) and one MLflow batch.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

from titan_kedro.tracking.mlflow_logger import MlflowMetricsSink

logger = logging.getLogger(__name__)

GPU_PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 125.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
}
"""Dense bf16 (fp16 for V100/T4) tensor-core peak per device, in TFLOP/s."""


def lookup_gpu(table: dict[str, float], device_name: str) -> float | None:
    """The entry of ``table`` whose key is the longest part of ``device_name`` (case-blind)."""
    name = device_name.upper()
    for key in sorted(table, key=len, reverse=True):
        if key in name:
            return table[key]
    return None


def gpu_peak_tflops(device_name: str) -> float | None:
    """Peak dense bf16 TFLOP/s for a CUDA device name (``NVIDIA H100 80GB HBM3`` → 989)."""
    return lookup_gpu(GPU_PEAK_BF16_TFLOPS, device_name)


def measure_matmul_tflops(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    size: int = 1024,
    min_seconds: float = 0.3,
) -> float:
    """Achieved TFLOP/s of a square ``size``×``size`` matmul (the CPU "peak" for MFU)."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up
    reps, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        reps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and reps >= 3:
            break
    return 2.0 * size**3 * reps / elapsed / 1e12


def peak_tflops(device: torch.device, compute_dtype: torch.dtype, override: float | None) -> float:
    """The MFU denominator: the override, else the GPU table, else a measured matmul rate."""
    if override:
        return float(override)
    if device.type == "cuda":
        table = gpu_peak_tflops(torch.cuda.get_device_name(device))
        if table:
            return table
    return measure_matmul_tflops(compute_dtype, device)


def step_counts(spec: Any, model_args: Any, layout: Any, seq_len: int) -> tuple[float, int, int]:
    """``(flops_per_token, tokens_per_step_local, tokens_per_step_global)`` of one rank.

    A pipeline rank computes ``1 / pp`` of the model (its step time includes the bubble),
    and a tensor-parallel group shares its tokens, so MFU stays per rank and honest.
    """
    flops = spec.training_flops_per_token(model_args, seq_len) / layout.pp
    per_group = layout.local_batch_size * seq_len * layout.grad_accum_steps
    return flops, per_group // layout.tp, layout.global_batch_size * seq_len


def memory_gib(device: torch.device) -> float:
    """Peak reserved GPU memory, or this process's resident memory on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


def peak_resident_gib() -> float | None:
    """This process's peak resident set so far (``VmHWM`` of ``/proc/self/status``) in GiB;
    ``None`` where there is no such file (not Linux)."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # KiB
    return None


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``memory_gib`` (see ``memory_gib``); on CUDA ``memory_allocated_gib``: the peak of
    ``torch.cuda.max_memory_allocated`` (what the plan's peak is checked against); on CPU
    ``vmhwm_gib``: the peak resident set so far (``peak_resident_gib``), where the current
    one (``memory_gib``) misses the step's peak, which is freed by the time it is read."""
    out = {"memory_gib": memory_gib(device)}
    if device.type == "cuda":
        out["memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = peak_resident_gib()
        if peak is not None:
            out["vmhwm_gib"] = peak
    return out


def expert_load_stats(load: torch.Tensor) -> dict[str, Any]:
    """Balance statistics of a ``[layers, experts]`` token-count tensor.

    Returns:
        ``moe_max_load_ratio`` (the busiest expert over the mean, worst layer),
        ``moe_dead_expert_frac`` (share of (layer, expert) pairs that got no token) and
        ``expert_load`` (per-layer fractions, for the heatmap).
    """
    load = load.detach().double().cpu()
    totals = load.sum(-1, keepdim=True)
    means = load.mean(-1)
    ratios = torch.where(means > 0, load.max(-1).values / means.clamp_min(1e-12), 0.0)
    fractions = torch.where(totals > 0, load / totals.clamp_min(1e-12), 0.0)
    return {
        "moe_max_load_ratio": float(ratios.max()),
        "moe_dead_expert_frac": float((load == 0).double().mean()),
        "expert_load": [[round(v, 6) for v in row] for row in fractions.tolist()],
    }


def format_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """One readable console line for a step."""
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    spec = [
        ("loss", "loss", "{:.4f}"),
        ("grad_norm", "gnorm", "{:.3f}"),
        ("lr", "lr", "{:.2e}"),
        ("tps", "tps", "{:,.0f}"),
        ("tflops", "tflops", "{:.2f}"),
        ("mfu_pct", "mfu", "{:.2f}%"),
        ("memory_gib", "mem", "{:.2f}GiB"),
        ("step_time_s", "step", "{:.2f}s"),
        ("moe_max_load_ratio", "max_load", "{:.2f}"),
        ("val_loss", "val_loss", "{:.4f}"),
    ]
    for key, label, fmt in spec:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return "  ".join(parts)


class MetricsLogger:
    """Rank-0 sink for step metrics: console line + progress bar, ``metrics.jsonl``, MLflow.

    Args:
        dump_folder: Where ``metrics.jsonl`` is appended.
        total_steps: ``training.steps`` (for the progress bar).
        start_step: Steps already done (a resumed run).
        append: Keep the rows already in ``metrics.jsonl`` (a resumed run); otherwise the
            file starts empty.
        run_id: The run the rows belong to, recorded in ``metrics.run_id``; ``append`` to a
            file another run wrote starts it over instead (that run's rows are in MLflow).
        mlflow: A sink, or None for console and file only.
        progress: Show progress: a live tqdm bar when stderr is a terminal; otherwise
            (under torchrun, whose output is line-based) each console line starts with a
            tqdm-formatted bar.
    """

    def __init__(
        self,
        dump_folder: str | Path,
        total_steps: int,
        *,
        start_step: int = 0,
        mlflow: MlflowMetricsSink | None = None,
        progress: bool = True,
        append: bool = False,
        run_id: str | None = None,
    ):
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = self.path.with_suffix(".run_id")
        if append and run_id and owner.is_file() and owner.read_text().strip() != run_id:
            logger.warning(
                "%s holds another run's rows; run %s continues in a fresh file", self.path, run_id
            )
            append = False
        if not append:
            self.path.write_text("", encoding="utf-8")
        if run_id:
            owner.write_text(run_id + "\n", encoding="utf-8")
        self.total_steps = total_steps
        self.mlflow = mlflow
        self._bar = None
        self._start_step = start_step
        self._started = time.perf_counter()
        self._inline_bar = progress and not sys.stderr.isatty()
        if progress and not self._inline_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="training",
                unit="step",
                file=sys.stderr,
                mininterval=1.0,
                dynamic_ncols=True,
            )

    def log_once(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Values logged once (``peak_tflops``): MLflow and the console."""
        self.echo("  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        if self.mlflow is not None:
            self.mlflow.log(metrics, step)

    def echo(self, line: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        sys.stdout.flush()

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar."""
        if self._bar is not None:
            self._bar.update(steps)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write one step's metrics everywhere; non-finite values are kept in the file as null."""
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=_json_default, allow_nan=False) + "\n")
        line = format_line(step, self.total_steps, metrics)
        if self._inline_bar:
            line = f"{self._meter(step)}  {line}"
        self.echo(line)
        if self.mlflow is not None:
            scalars = {k: v for k, v in metrics.items() if _is_finite_number(v)}
            self.mlflow.log(scalars, step)

    def _meter(self, step: int) -> str:
        from tqdm import tqdm

        done = step - self._start_step
        elapsed = time.perf_counter() - self._started
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        return tqdm.format_meter(
            step,
            self.total_steps,
            elapsed,
            ncols=60,
            rate=rate,
            bar_format="{l_bar}{bar}| eta {remaining}",
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
