"""The plan's check against reality: the same step run for real on CPU ranks over gloo.

``measure_real(raw, world)`` starts ``world`` fresh processes (a clean peak resident set
each), runs ``fake_step.measure_step(..., fake=False)`` in them — real weights, real
tokens, the real process group — and returns rank 0's tracked peak (the same tracker as
the plan, in real mode) and, as an independent witness, the growth of the process's
peak resident memory (``VmHWM``) over the step, from just before the model is built.

``worker_peak_resident(raw, nproc)`` instead trains the job with the real workers
(``python -m titan_kedro.train`` under torchrun) and returns the peak resident set rank 0
logged at its last step (``vmhwm_gib``): a whole process, whose fixed cost (libraries,
the data loader, the process group) only cancels in a difference of two configurations.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
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


def _write_random_tokens(folder: Path, vocab_size: int, count: int) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", count), ("validation", max(count // 10, 4096))):
        rng.integers(0, vocab_size, n, dtype="<u4").tofile(folder / f"{split}.bin")
    (folder / "metadata.json").write_text(
        json.dumps({"vocab_size": vocab_size, "bos_id": 0, "synthetic": True}), encoding="utf-8"
    )


def worker_peak_resident(
    raw: dict[str, Any],
    nproc: int,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Train ``raw`` with the real workers on this machine's CPU; rank 0's last logged row.

    The job runs as a user runs it (``torchrun --standalone -m titan_kedro.train``, one
    thread a rank) in a temporary folder, on random tokens of the model's vocabulary
    whose metadata names a ``bos_id`` (so document masking runs as the plan assumes; the
    trainer turns it off for tokens without one), with validation, checkpoints and MLflow
    off and a metrics row every step.

    Args:
        raw: The raw job config (``training.device: cpu``).
        nproc: Ranks to start.
        env: Variables added to the workers' environment (e.g. glibc malloc settings).
        timeout_s: Wall-clock limit of the run.

    Returns:
        Rank 0's ``metrics.jsonl`` row of the last step (``vmhwm_gib``: its peak resident
        set over the whole run so far) plus ``wall_s``, the run's wall time, and ``rows``, all
        of rank 0's rows.
    """
    import time

    import yaml

    resolved = resolve_job_config(raw)
    cfg = resolved.config
    steps = cfg.training.steps
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tokens = steps * cfg.training.local_batch_size * (cfg.training.seq_len + 1) * nproc
        _write_random_tokens(root / "tokens", resolved.model_args.vocab_size, 4 * tokens + 8192)
        job = {
            **raw,
            "job": {**raw.get("job", {}), "dump_folder": str(root / "job")},
            "data": {**raw.get("data", {}), "token_dir": str(root / "tokens")},
            "training": {"device": "cpu", "num_threads": 1, **raw.get("training", {})},
            "launch": {**raw.get("launch", {}), "nproc_per_node": nproc,
                       "log_dir": str(root / "logs")},
            "checkpoint": {"enable": False, "folder": str(root / "ckpt")},
            "metrics": {**raw.get("metrics", {}), "log_freq": 1, "enable_mlflow": False},
            "validation": {"freq": 0},
        }  # fmt: skip
        config = root / "job.yaml"
        config.write_text(yaml.safe_dump(job), encoding="utf-8")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "--max_restarts=0",
            "-m", "titan_kedro.train", "--config", str(config),
        ]  # fmt: skip
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        run_env.pop("MLFLOW_RUN_ID", None)
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, env=run_env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(
                f"the workers failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                f"{proc.stderr[-5000:]}"
            )
        rows = [
            json.loads(line)
            for line in (root / "job" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
            if line
        ]
        last = [row for row in rows if row.get("step") == steps and "vmhwm_gib" in row]
        if not last:
            raise RuntimeError(f"rank 0 logged no vmhwm_gib at step {steps}: {rows[-1:]}")
        return {**last[-1], "wall_s": wall, "rows": rows}
