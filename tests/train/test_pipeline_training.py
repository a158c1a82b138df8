"""Pipeline parallelism trains like one process, and its checkpoint resumes on one process.

One spawn of 4 gloo ranks trains two layouts one after the other (no second start-up):

- DeepSeek-V2, PP 2 × FSDP 2, ``1F1B``, 6 steps (checkpoint at step 3);
- DeepSeek-V3 with one MTP depth (4 blocks), PP 2 × FSDP 2 with EP 2 inside, the
  ``Interleaved1F1B`` schedule (2 stages per rank), 3 steps.

Each must give the losses, gradient norms, auxiliary / MTP losses and expert-load
statistics (every stage's MoE layers, in model order) of one process accumulating the same
global batch, within 1e-5 relative (fp32): with one pipeline
microbatch per accumulation step the pipeline computes the same per-microbatch losses and
the schedule's ``1 / n_microbatches`` gradient scale is the accumulation's ``1 / accum``;
only the order of the floating-point sums differs (FSDP's reduce-scatter, the pipeline's
all-reduce of the loss), which moves fp32 results by a few ulps (~1e-7 relative).

The V2 runs validate at steps 3 and 6 (the pipelined run through ``schedule.eval``) and
must agree there too. The PP 2 checkpoint at step 3 then continues on one process: steps
4-6 must be the uninterrupted run's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_kedro.models.deepseek_v2 import flops_per_token
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.checkpoint.safe_load import load_model_weights
from titan_kedro.train.trainer import Trainer
from train.helpers import TINY_DEEPSEEK, read_metrics, run_ranks, tiny_job, write_token_dir

pytestmark = pytest.mark.slow

KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_max_load_ratio")
VALIDATE = {"freq": 3}


def _job(root: Path, tokens: Path, model: str, steps: int, **sections: Any) -> dict[str, Any]:
    extra = {"mtp_depth": 1, "overrides": {**TINY_DEEPSEEK, "n_layers": 4}}
    return tiny_job(
        root,
        tokens,
        model={
            "name": model,
            "custom_model_path": None,
            "overrides": TINY_DEEPSEEK,
            **(extra if model == "deepseek_v3" else {}),
        },
        training={"steps": steps, "global_batch_size": 8, "max_norm": 0.5},
        **sections,
    )


def _train(raw: dict[str, Any], *, close: bool = True) -> list[dict[str, Any]]:
    trainer = Trainer(resolve_job_config(raw, source="test"))
    try:
        trainer.train()
    finally:
        if close:
            trainer.close()
        elif trainer.metrics is not None:
            trainer.metrics.close()  # the spawned ranks' group outlives this trainer
    return read_metrics(raw["job"]["dump_folder"])


def _train_each(rank: int, world: int, jobs: list[dict[str, Any]]) -> None:
    for raw in jobs:
        _train(raw, close=False)


def _assert_same(ours: list[dict], theirs: list[dict], keys: tuple[str, ...], name: str) -> None:
    assert [row["step"] for row in ours] == [row["step"] for row in theirs], name
    for mine, reference in zip(ours, theirs, strict=True):
        for key in keys:
            assert mine[key] == pytest.approx(reference[key], rel=1e-5), (name, mine["step"], key)
        assert ("val_loss" in mine) == ("val_loss" in reference), (name, mine["step"])
        if "val_loss" in reference:
            assert mine["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5), name
        # Token counts are integers: the per-layer fractions are the same numbers.
        assert mine["expert_load"] == reference["expert_load"], (name, mine["step"])


def test_pipelined_layouts_train_like_one_process_and_resume_on_one(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    off = {"checkpoint": {"enable": False}}
    # Validation at steps 3 and 6 over the same 4 held-out batches: 4 on one rank, 2 on
    # each of the 2 data-parallel ranks of the pipelined run.
    v2_one = _train(
        _job(
            tmp_path / "v2_one", tokens, "deepseek_v2", 6, validation=VALIDATE | {"steps": 4}, **off
        )
    )
    v3_one = _train(_job(tmp_path / "v3_one", tokens, "deepseek_v3", 3, **off))
    four = {"nproc_per_node": 4, "log_dir": str(tmp_path / "logs")}
    v2_pp = _job(
        tmp_path / "v2_pp",
        tokens,
        "deepseek_v2",
        6,
        parallelism={"pipeline_parallel_degree": 2},
        launch=four,
        validation=VALIDATE | {"steps": 2},
        checkpoint={"folder": str(tmp_path / "v2_pp_ckpt"), "interval": 3, "keep_latest_k": 2},
    )
    v3_pp = _job(
        tmp_path / "v3_pp",
        tokens,
        "deepseek_v3",
        3,
        parallelism={
            "pipeline_parallel_degree": 2,
            "pipeline_schedule": "Interleaved1F1B",
            "expert_parallel_degree": 2,
        },
        launch=four,
        **off,
    )
    run_ranks(_train_each, [v2_pp, v3_pp], store=tmp_path / "store", world=4)
    _assert_same(read_metrics(tmp_path / "v2_pp" / "job"), v2_one, KEYS, "v2 pp2 x fsdp2")
    _assert_same(
        read_metrics(tmp_path / "v3_pp" / "job"), v3_one, (*KEYS, "mtp_loss"), "v3 interleaved"
    )
    assert v2_one[-1]["loss"] < v2_one[0]["loss"]  # it learns, so equal losses mean something
    # Rank 0 logs the peak memory of every rank of its pipeline (one per stage group), and
    # its TFLOP/s count the half of the model's FLOPs a stage computes over the whole step's
    # time (bubble included); `tps` is 2 samples × 2 accumulation steps × 32 tokens a second.
    model_flops = flops_per_token(resolve_job_config(v2_pp, source="test").model_args, 32)
    for row in read_metrics(tmp_path / "v2_pp" / "job"):
        assert row["pp0_peak_memory_gib"] > 0 and row["pp1_peak_memory_gib"] > 0
        assert row["tps"] == pytest.approx(2 * 2 * 32 / row["step_time_s"], rel=1e-6)
        assert row["tflops"] == pytest.approx(row["tps"] * model_flops / 2 / 1e12, rel=1e-6)

    # The PP 2 checkpoint of step 3 (each stage saved its part) continues on one process.
    shutil.copytree(tmp_path / "v2_pp_ckpt" / "step-3", tmp_path / "resume_ckpt" / "step-3")
    resumed = _job(
        tmp_path / "resumed",
        tokens,
        "deepseek_v2",
        6,
        checkpoint={"folder": str(tmp_path / "resume_ckpt"), "resume": "latest", "interval": 100},
        validation=VALIDATE | {"steps": 4},
    )
    rows = _train(resumed)
    _assert_same(rows, v2_one[3:], KEYS, "pp2 -> pp1 resume")
    # Evaluation and HF export read a checkpoint into a plain model: every weight is there.
    resolved = resolve_job_config(v2_pp, source="test")
    model = resolved.spec.build_model(resolved.model_args)
    before = model.output.weight.clone()
    load_model_weights(tmp_path / "v2_pp_ckpt" / "step-6", model)
    assert not torch.equal(model.output.weight, before)
