"""The plan's check against reality: the same step run for real on CPU ranks over gloo.

``measure_real(raw, world)`` starts ``world`` fresh processes (a clean peak resident set
each), runs ``fake_step.measure_step(..., fake=False)`` in them — real weights, real
tokens, the real process group — and returns rank 0's tracked peak (the same tracker as
the plan, in real mode) and, as an independent witness, the growth of the process's
peak resident memory (``VmHWM``) over the step, from just before the model is built.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan.fake_step import measure_step
from titan_kedro.train.parallel_dims import ParallelDims


def resident_kib(field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process in KiB (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (this check needs Linux)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank(rank: int, world: int, raw: dict[str, Any], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        resolved = resolve_job_config(raw)
        dims = ParallelDims.from_config(resolved.config, world, torch.device("cpu"))
        dims.build_mesh()
        rss_before = resident_kib("VmRSS")
        measured = measure_step(resolved, dims, peak_flops=1.0, bandwidth=1.0, fake=False)
        hwm = resident_kib("VmHWM")
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "tracker_peak": measured.peak_bytes,
                        "parts": measured.parts,
                        "peak_at": measured.peak_at,
                        "rss_growth": (hwm - rss_before) * 1024,
                        "step_s": measured.real_step_s,
                    }
                ),
                encoding="utf-8",
            )
    finally:
        dist.destroy_process_group()


def measure_real(raw: dict[str, Any], world: int) -> dict[str, Any]:
    """Run the job's step for real on ``world`` CPU ranks; rank 0's figures.

    Args:
        raw: The raw job config (``training.device: cpu``; ``launch.nproc_per_node`` =
            ``world``).
        world: Ranks to start (gloo, on this machine).

    Returns:
        ``tracker_peak`` (bytes), ``parts`` (bytes by category at it), ``peak_at``,
        ``rss_growth`` (bytes the peak resident set grew by from before the model was
        built) and ``step_s`` (the same step untracked, in seconds).
    """
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "real.json")
        mp.start_processes(
            _rank, args=(world, raw, _free_port(), out), nprocs=world, start_method="spawn"
        )
        return json.loads(Path(out).read_text(encoding="utf-8"))
