"""Reusable helpers for training tests: run a tiny job through torchrun, read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TINY_MODEL = Path(__file__).with_name("tiny_model.py")
REPO = Path(__file__).resolve().parents[2]


def tiny_job(tmp_path: Path, token_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A raw job config for the tiny dense model writing everything under ``tmp_path``.

    Sections given as keyword arguments are merged over the defaults key by key.
    """
    raw: dict[str, Any] = {
        "job": {"name": "test", "seed": 7, "dump_folder": str(tmp_path / "job")},
        "data": {"token_dir": str(token_dir)},
        "model": {
            "name": "tiny_dense",
            "flavor": "debugmodel",
            "custom_model_path": str(TINY_MODEL),
        },
        "training": {
            "steps": 4,
            "seq_len": 32,
            "local_batch_size": 2,
            "device": "cpu",
            "num_threads": 1,
        },
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "launch": {"nproc_per_node": 1, "log_dir": str(tmp_path / "logs")},
        "checkpoint": {"folder": str(tmp_path / "ckpt"), "interval": 100},
        "metrics": {"log_freq": 1, "enable_mlflow": False, "peak_tflops": 1.0},
        "validation": {"freq": 0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def run_worker(
    raw: dict[str, Any],
    *,
    nproc: int = 1,
    extra_env: dict[str, str] | None = None,
    max_restarts: int = 0,
    timeout_s: int = 180,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Write ``raw`` as a config file and run ``python -m titan_kedro.train`` under torchrun.

    Returns:
        The finished process (stdout and stderr captured as text).
    """
    dump = Path(raw["job"]["dump_folder"])
    dump.mkdir(parents=True, exist_ok=True)
    config = dump / "input_config.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max_restarts={max_restarts}",
        "-m",
        "titan_kedro.train",
        "--config",
        str(config),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    env.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"worker failed (rc {proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\n"
            f"STDERR:\n{proc.stderr[-6000:]}"
        )
    return proc


def read_metrics(dump_folder: str | Path) -> list[dict[str, Any]]:
    """The rows of ``{dump_folder}/metrics.jsonl``."""
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def step_losses(dump_folder: str | Path) -> dict[int, float]:
    """``{step: loss}`` from ``metrics.jsonl`` (a resumed run appends; later rows win)."""
    return {row["step"]: row["loss"] for row in read_metrics(dump_folder) if "loss" in row}
