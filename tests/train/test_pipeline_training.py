"""Pipeline parallelism trains like one process, and its checkpoint resumes on PP 1 and TP 2.

One spawn of 4 gloo ranks trains five jobs one after the other (no second start-up), each
of 6 steps, against one process that accumulates the same global batch of 8 samples as 4
micro-batches of 2 (each of a pipelined job's 2 data ranks feeds its pipeline 2
microbatches of 2 samples per step):

- DeepSeek-V2, PP 2 × FSDP 2, ``1F1B`` (checkpoints at steps 4 and 6);
- DeepSeek-V2, PP 2 × EP 2 (the experts split over the 2 data ranks of each stage, the
  dense weights FSDP-sharded over them), ``1F1B``;
- DeepSeek-V3 with one MTP depth (4 blocks), PP 2 × FSDP 2, ``1F1B``;
- the same V3, PP 2 × EP 2, ``Interleaved1F1B`` (2 stages per rank, 4 stages);
- the V2 PP 2 run's step-4 checkpoint continued as TP 2 × FSDP 2 (EP 2 on the TP ranks)
  for steps 5-6.

Each must give the losses, gradient norms, auxiliary / MTP losses and expert-load
statistics (every stage's MoE layers, in model order) of one process accumulating the same
global batch, within 1e-5 relative (fp32), for both schedules: with one pipeline
microbatch per accumulation step the pipeline computes the same per-microbatch losses and
the schedule's ``1 / n_microbatches`` gradient scale is the accumulation's ``1 / accum``.
Neither schedule changes which terms are summed, only the order of the sums, and the same
for both: each runs a stage's microbatch backwards in microbatch order (Interleaved1F1B
only interleaves them with other stages' work), so a rank adds its 2 microbatch gradients,
and the data ranks' gradients meet in another order than one process's: FSDP's
reduce-scatter adds the two ranks' sums, ``(g1 + g2) + (g3 + g4)`` against
``((g1 + g2) + g3) + g4`` (up to which micro-batch is which), and under EP an expert's
gradient is one matmul over the tokens both ranks routed to it, summed in another order;
the reported auxiliary losses add each stage's layers over the stages. The scales
(``1 / 2`` per microbatch and ``1 / 2`` over the data ranks, against ``1 / 4``) are powers
of two, exact in fp32. A reordered fp32 sum differs by a few ulps (~1e-7 relative), so no
schedule needs a looser tolerance.

The V2 runs validate at steps 3 and 6 (the pipelined run through ``schedule.eval``) and
must agree there too. The resume continues from the straight PP 2 run's checkpoint of
step 4, which holds what a PP 2 run killed after step 4 would have left: the save is
synchronous and collective at the end of step 4 and holds only that step's state (model,
optimizer, scheduler, data position, step), so what the run does afterwards cannot change
it. Steps 5-6 on one process (PP 1) and on TP 2 must be the straight run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from titan_kedro.models.deepseek_v2 import flops_per_token
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.checkpoint.safe_load import load_model_weights
from train.helpers import (
    TINY_DEEPSEEK,
    read_metrics,
    run_ranks,
    tiny_job,
    train_each,
    train_here,
    write_token_dir,
)

pytestmark = pytest.mark.slow

KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_max_load_ratio")
VALIDATE = {"freq": 3}
STEPS = 6


def _job(root: Path, tokens: Path, model: str, **sections: Any) -> dict[str, Any]:
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
        training={"steps": STEPS, "global_batch_size": 8, "max_norm": 0.5},
        **sections,
    )


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


def test_pipelined_layouts_train_like_one_process_and_resume_on_pp1_and_tp2(
    tmp_path: Path,
) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    off = {"checkpoint": {"enable": False}}
    # Validation at steps 3 and 6 over the same 4 held-out batches: 4 on one rank, 2 on
    # each of the 2 data-parallel ranks of the 4-rank runs.
    one_rank, two_ranks = VALIDATE | {"steps": 4}, VALIDATE | {"steps": 2}
    v2_one = train_here(
        _job(tmp_path / "v2_one", tokens, "deepseek_v2", validation=one_rank, **off)
    )
    v3_one = train_here(_job(tmp_path / "v3_one", tokens, "deepseek_v3", **off))
    four = {"nproc_per_node": 4, "log_dir": str(tmp_path / "logs")}
    pp2, ep2 = {"pipeline_parallel_degree": 2}, {"expert_parallel_degree": 2}
    step_4 = tmp_path / "v2_pp_ckpt" / "step-4"
    layouts = {
        "v2 pp2 x fsdp2": ("deepseek_v2", pp2, two_ranks),
        "v2 pp2 x ep2": ("deepseek_v2", pp2 | ep2, two_ranks),
        "v3 1F1B": ("deepseek_v3", pp2, {}),
        "v3 Interleaved1F1B": (
            "deepseek_v3",
            pp2 | ep2 | {"pipeline_schedule": "Interleaved1F1B"},
            {},
        ),
        "v2 tp2 from pp2 step 4": ("deepseek_v2", {"tensor_parallel_degree": 2} | ep2, two_ranks),
    }
    checkpoints = {
        "v2 pp2 x fsdp2": {"folder": str(step_4.parent), "interval": 4, "keep_latest_k": 2},
        "v2 tp2 from pp2 step 4": {"folder": str(tmp_path / "tp2_ckpt"), "resume": str(step_4)},
    }
    jobs = {
        name: _job(
            tmp_path / name.replace(" ", "_"),
            tokens,
            model,
            parallelism=parallelism,
            launch=four,
            validation=validation,
            checkpoint=checkpoints.get(name, {"enable": False}),
        )
        for name, (model, parallelism, validation) in layouts.items()
    }
    run_ranks(train_each, list(jobs.values()), store=tmp_path / "store", world=4)
    rows = {name: read_metrics(raw["job"]["dump_folder"]) for name, raw in jobs.items()}
    _assert_same(rows["v2 pp2 x fsdp2"], v2_one, KEYS, "v2 pp2 x fsdp2")
    _assert_same(rows["v2 pp2 x ep2"], v2_one, KEYS, "v2 pp2 x ep2")
    for schedule in ("1F1B", "Interleaved1F1B"):
        _assert_same(rows[f"v3 {schedule}"], v3_one, (*KEYS, "mtp_loss"), schedule)
    assert v2_one[-1]["loss"] < v2_one[0]["loss"]  # it learns, so equal losses mean something
    # Rank 0 logs the peak memory of every rank of its pipeline (one per stage group), and
    # its TFLOP/s count the half of the model's FLOPs a stage computes over the whole step's
    # time (bubble included); `tps` is 2 samples × 2 accumulation steps × 32 tokens a second.
    pipelined = jobs["v2 pp2 x fsdp2"]
    model_flops = flops_per_token(resolve_job_config(pipelined, source="test").model_args, 32)
    for row in rows["v2 pp2 x fsdp2"]:
        assert row["pp0_peak_memory_gib"] > 0 and row["pp1_peak_memory_gib"] > 0
        assert row["tps"] == pytest.approx(2 * 2 * 32 / row["step_time_s"], rel=1e-6)
        assert row["tflops"] == pytest.approx(row["tps"] * model_flops / 2 / 1e12, rel=1e-6)

    # The PP 2 checkpoint of step 4 (each stage saved its part) continues on one process
    # (here) and, above, on TP 2: steps 5-6 are the straight PP 2 run's.
    resumed = _job(
        tmp_path / "resumed",
        tokens,
        "deepseek_v2",
        checkpoint={"folder": str(tmp_path / "pp1_ckpt"), "resume": str(step_4), "interval": 100},
        validation=one_rank,
    )
    straight = rows["v2 pp2 x fsdp2"]
    _assert_same(train_here(resumed), straight[4:], KEYS, "pp2 -> pp1 resume")
    _assert_same(rows["v2 tp2 from pp2 step 4"], straight[4:], KEYS, "pp2 -> tp2 resume")
    # Evaluation and HF export read a checkpoint into a plain model: every weight is there.
    resolved = resolve_job_config(pipelined, source="test")
    model = resolved.spec.build_model(resolved.model_args)
    before = model.output.weight.clone()
    load_model_weights(step_4.parent / "step-6", model)
    assert not torch.equal(model.output.weight, before)
