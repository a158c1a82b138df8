"""Reusable helpers for training tests: run a tiny job through torchrun, read its metrics."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import yaml

TINY_MODEL = Path(__file__).with_name("tiny_model.py")
REPO = Path(__file__).resolve().parents[2]

TINY_DEEPSEEK = {
    "vocab_size": 512,
    "dim": 64,
    "n_layers": 3,
    "n_heads": 4,
    "max_seq_len": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "load_balance_bias_update_speed": 0.01,
}
"""The debugmodel shrunk to a few hundred thousand parameters (2 MoE layers, 8 experts)."""


def write_token_dir(
    folder: Path, *, vocab_size: int = 512, n_train: int = 40_000, seed: int = 0
) -> Path:
    """Write learnable ``train.bin`` / ``validation.bin`` token files (mostly ``t → 7t+3``)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("validation", n_train // 10)):
        tokens = np.empty(count, dtype="<u4")
        tokens[0] = 1
        noise = rng.random(count) < 0.2
        random_tokens = rng.integers(0, vocab_size, count)
        for i in range(1, count):
            tokens[i] = random_tokens[i] if noise[i] else (7 * int(tokens[i - 1]) + 3) % vocab_size
        tokens.tofile(folder / f"{split}.bin")
    (folder / "metadata.json").write_text(
        json.dumps({"vocab_size": vocab_size, "synthetic": True}), encoding="utf-8"
    )
    return folder


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
    raw = {**raw, "launch": {**raw.get("launch", {}), "nproc_per_node": nproc}}
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


def node_job_config(dump_folder: Path, run_id: str | None = None) -> Path:
    """The ``job_config.yaml`` the training node wrote for ``run_id`` (None: its newest)."""
    runs = Path(dump_folder) / "runs"
    if run_id is not None:
        return runs / run_id / "job_config.yaml"
    return max(runs.glob("*/job_config.yaml"), key=lambda path: path.stat().st_mtime)


def rerun_here(
    job_config: Path,
    root: Path,
    *,
    nproc: int,
    env: dict[str, str] | None = None,
    **sections: dict[str, Any],
) -> dict[int, float]:
    """Train the resolved job a node wrote (its ``job_config.yaml``) again on this machine
    with ``sections`` merged over it, writing only under ``root`` and logging nowhere;
    returns its ``{step: loss}``. It trains in this process (``nproc`` 1) or on ``nproc``
    forked gloo ranks (``train_on_ranks``), or, given ``env`` (merged over this process's
    environment), by plain torchrun."""
    raw = yaml.safe_load(job_config.read_text(encoding="utf-8"))
    raw["job"].update(dump_folder=str(root / "job"), run_id=None)
    raw["launch"].update(scheduler="local", nnodes=1, log_dir=str(root / "logs"))
    raw["checkpoint"].update(folder=str(root / "ckpt"), resume="never")
    raw["metrics"]["enable_mlflow"] = False
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    if env is not None:
        run_worker(raw, nproc=nproc, extra_env=env, timeout_s=600)
    elif nproc == 1:
        train_here(raw)
    else:
        train_on_ranks(raw, nproc)
    return step_losses(root / "job")


def train_on_ranks(raw: dict[str, Any], nproc: int) -> None:
    """Train the job ``raw`` on ``nproc`` gloo ranks of ``run_ranks`` (no torchrun: for
    tests of training, not of launching), its store beside the job's dump folder."""
    raw = {**raw, "launch": {**raw.get("launch", {}), "nproc_per_node": nproc}}
    dump = Path(raw["job"]["dump_folder"])
    dump.mkdir(parents=True, exist_ok=True)
    run_ranks(train_each, [raw], store=dump.parent / f"{dump.name}.store", world=nproc)


def step_losses(dump_folder: str | Path) -> dict[int, float]:
    """``{step: loss}`` from ``metrics.jsonl`` (a resumed run appends; later rows win)."""
    return {row["step"]: row["loss"] for row in read_metrics(dump_folder) if "loss" in row}


def train_here(raw: dict[str, Any], *, in_spawned_rank: bool = False) -> list[dict[str, Any]]:
    """Train the job ``raw`` in this process (no torchrun) and return its metrics rows.

    Alone, the trainer makes and ends its own one-rank group; ``in_spawned_rank`` keeps
    the group of ``run_ranks`` (which outlives the trainer) and closes only the metrics.
    """
    from titan_kedro.models.resolve import resolve_job_config
    from titan_kedro.train.trainer import Trainer

    trainer = Trainer(resolve_job_config(raw, source="test"))
    try:
        trainer.train()
    finally:
        if not in_spawned_rank:
            trainer.close()
        elif trainer.metrics is not None:
            trainer.metrics.close()
    return read_metrics(raw["job"]["dump_folder"])


def train_each(rank: int, world: int, jobs: list[dict[str, Any]]) -> None:
    """For ``run_ranks``: train ``jobs`` one after the other on the spawned ranks' group
    (one start-up for several layouts)."""
    for raw in jobs:
        train_here(raw, in_spawned_rank=True)


def _rank_entry(
    rank: int,
    world: int,
    store_path: str,
    call: tuple[Callable[..., None], tuple, float, dict[str, str]],
    errors: Any,
) -> None:
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    check, args, timeout_s, environ = call
    gc.freeze()  # the server's imports stay out of this rank's collections (runs/frozen_imports.py)
    # A forkserver's child has the server's environment, not the test's (its hooks' and
    # threads' variables): take the test's.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        check(rank, world, *args)
        # Both ranks leave together: a rank tearing gloo down while its peer still has a
        # pending operation makes the peer abort ("terminate called without an active
        # exception", SIGABRT), failing a check that passed.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:  # report to the parent, which fails the test
        errors.put(f"rank {rank}: {err!r}\n{traceback.format_exc()}")
        raise


RANK_PRELOAD = (
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "titan_kedro.models.registry",
    "titan_kedro.train.trainer",
)
"""What the forkserver of ``run_ranks`` imports once for all the ranks it forks."""


def run_ranks(
    check: Callable[..., None],
    *args: Any,
    store: Path,
    world: int = 2,
    collective_timeout_s: float = 1800.0,
) -> None:
    """Run ``check(rank, world, *args)`` in ``world`` gloo processes; fail on any error.

    ``check`` must be a module-level function (it is pickled into the children). A
    collective that waits longer than ``collective_timeout_s`` fails its rank.

    The processes are forked from a forkserver that has imported torch and the trainer
    once (``RANK_PRELOAD``), not spawned: a spawned rank spends seconds of CPU importing
    them, and this 2-core suite is bound by CPU. The server starts fresh (no test state, no
    threads) and lives as long as this pytest process.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    errors = context.SimpleQueue()
    environ = {"OMP_NUM_THREADS": "1", **os.environ}
    procs = mp.start_processes(
        _rank_entry,
        args=(world, str(store), (check, args, collective_timeout_s, environ), errors),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    try:
        while not procs.join(timeout=120):
            pass
    finally:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        assert not messages, "\n".join(messages)


def validation_loader(token_dir: Path, *, seq_len: int, local_batch_size: int, seed: int) -> Any:
    """A one-rank ``TokenLoader`` over ``validation.bin`` (what evaluation reads)."""
    from titan_kedro.data.loader import TokenLoader
    from titan_kedro.data.token_store import open_split

    return TokenLoader(
        open_split(token_dir, "validation"),
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        data_rank=0,
        data_ranks=1,
        seed=seed,
    )


def assert_first_step_moves_weights_by_lr(trainer: Any) -> dict[str, Any]:
    """Run the first optimizer step of a fresh, unwrapped ``trainer``; check the update size.

    AdamW's first step moves a weight by ``lr · m̂ / (√v̂ + eps) = lr · g / (|g| + eps)``:
    by ``lr`` exactly for every weight with ``|g| ≫ eps``, whatever the loss. Norm gains
    (1-D, in the group without weight decay) all get a gradient, so the largest move among
    them is the step's ``lr``, up to the float32 rounding of ``w - lr`` (one ulp of a gain
    near 1 is 1.2e-7, 4e-5 of an lr of 3e-3). Returns the step's metrics.
    """
    gains = {n: p for n, p in trainer.model.named_parameters() if p.ndim == 1}
    before = {n: p.detach().clone() for n, p in gains.items()}
    metrics = trainer.train_step()
    assert gains and metrics["lr"] > 0, metrics
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in gains.items())
    assert abs(moved - metrics["lr"]) <= 1e-4 * metrics["lr"], (moved, metrics["lr"])
    return metrics


HOLDER = """
import sys, time
from titan_kedro.runs.lock import hold_run_folder
with hold_run_folder(sys.argv[1], timeout_s=900, run_id="run-1"):
    print("held", flush=True)
    time.sleep(600)
"""


@contextmanager
def live_holder(folder: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that trains into ``folder`` (holds its lock) until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), str(folder)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
