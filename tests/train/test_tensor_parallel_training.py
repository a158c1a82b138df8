"""Tensor parallelism (with sequence parallelism) trains like one process, and its checkpoint
continues without it.

DeepSeek-V2 (MLA with q-LoRA, a dense block, MoE blocks with shared experts, the balance
loss and the routing bias, two blocks recomputed in backward) on 4 ranks as TP 2 × FSDP 2
with EP 2 folded onto the TP ranks, and Llama 3 (GQA) as TP 2 × PP 2 on 4 ranks, must give the
losses, gradient norms, auxiliary and validation losses of one process that accumulates
the same global batch, within 1e-5 over 6 steps in float32 (only the reduction order
differs). The DeepSeek run's step-3 checkpoint,
continued by one process (TP 1), must give the uninterrupted reference's steps 4-6.

The two 4-rank runs share one spawn of 4 gloo ranks (one start-up); the one-process runs
(the references and the resume) train in the test's own process, one after the other (the
trainer leaves its process group when it closes).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

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

STEPS = list(range(1, 7))
KEYS = {
    "deepseek": ("loss", "grad_norm", "moe_aux_loss"),
    "llama": ("loss", "grad_norm", "val_loss"),
}
MODELS: dict[str, dict[str, Any]] = {
    "deepseek": {
        "name": "deepseek_v2",
        "overrides": {**TINY_DEEPSEEK, "q_lora_rank": 32, "aux_loss_alpha": 0.01},
    },
    "llama": {
        "name": "llama3",
        "flavor": "debugmodel",
        "overrides": {
            "vocab_size": 512,
            "n_layers": 2,
            "dim": 64,
            "n_heads": 4,
            "n_kv_heads": 2,
            "ffn_hidden_dim": 128,
        },
    },
}


def _job(root: Path, tokens: Path, model: str, name: str, **sections: Any) -> dict[str, Any]:
    training = {"steps": len(STEPS), "global_batch_size": 8, "max_norm": 0.5}
    if model == "deepseek":  # recomputes blocks 0 (dense) and 2 (MoE): same maths
        training["activation_checkpoint"] = "selective"
    else:  # Llama also scores 2 held-out batches after the last step
        sections.setdefault("validation", {"freq": len(STEPS), "steps": 2})
    return tiny_job(
        root / f"{model}_{name}",
        tokens,
        model={"custom_model_path": None, **MODELS[model]},
        training=training,
        **{"checkpoint": {"enable": False}, **sections},
    )


def _assert_same(ours: list[dict], theirs: list[dict], keys: tuple[str, ...], what: str) -> None:
    assert [row["step"] for row in ours] == [row["step"] for row in theirs], what
    for mine, reference in zip(ours, theirs, strict=True):
        for key in (key for key in keys if key in reference):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5), (what, mine["step"], key)


def _reference(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics rows of a one-process run, checked to train every step."""
    rows = read_metrics(job["job"]["dump_folder"])
    assert [row["step"] for row in rows] == STEPS
    # The losses really change (the comparison would be empty otherwise).
    assert len({round(row["loss"], 5) for row in rows}) == len(STEPS)
    return rows


def test_tensor_parallel_layouts_train_like_one_process_and_resume_on_tp1(
    tmp_path: Path,
) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    four = {"nproc_per_node": 4}
    deepseek = _job(
        tmp_path,
        tokens,
        "deepseek",
        "tp2_fsdp2_ep2",
        parallelism={"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        launch=four,
        checkpoint={"interval": 3},
    )
    # Tensor parallelism inside each of 2 pipeline stages (1 block each). A pipelined step
    # scores its held-out batches 4 at a time (the accumulation steps).
    validation = {"freq": len(STEPS), "steps": 4}
    layout = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}
    llama = _job(
        tmp_path, tokens, "llama", "tp2_pp2", parallelism=layout, validation=validation, launch=four
    )
    run_ranks(train_each, [deepseek, llama], store=tmp_path / "store", world=4)

    one = _job(tmp_path, tokens, "deepseek", "one")
    resumed = _job(tmp_path, tokens, "deepseek", "resumed_tp1", checkpoint={"resume": "latest"})
    step_3 = Path(deepseek["checkpoint"]["folder"]) / "step-3"
    shutil.copytree(step_3, Path(resumed["checkpoint"]["folder"]) / "step-3")
    llama_one = _job(tmp_path, tokens, "llama", "one", validation=validation)
    for raw in (one, resumed, llama_one):
        train_here(raw)

    reference = _reference(one)
    _assert_same(read_metrics(deepseek["job"]["dump_folder"]), reference, KEYS["deepseek"], "TP")
    _assert_same(
        read_metrics(resumed["job"]["dump_folder"]),
        reference[3:],
        KEYS["deepseek"],
        "TP 2 checkpoint resumed on TP 1",
    )
    llama_reference = _reference(llama_one)
    assert "val_loss" in llama_reference[-1]
    rows = read_metrics(llama["job"]["dump_folder"])
    _assert_same(rows, llama_reference, KEYS["llama"], "Llama TP 2 x PP 2")
    # Throughput per rank: a TP 2 group shares its 4 micro-batches × 2 × 32 tokens per step
    # (the pipeline's ranks train the same samples; each computes its stage's FLOPs).
    for row in rows:
        assert row["tps"] * row["step_time_s"] == pytest.approx(4 * 2 * 32 / 2)


def test_tensor_parallelism_alone_trains_like_one_process(tmp_path: Path) -> None:
    # TP 2 on 2 ranks, one data rank (no FSDP): the step sums the sequence-parallel norms'
    # Partial gradients once, after the last of 2 accumulated micro-batches. DeepSeek with
    # q-LoRA off (the column-parallel wq) and EP 2 on the TP ranks; Llama 3 (GQA).
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    models = {
        "deepseek": {**MODELS["deepseek"], "overrides": {**TINY_DEEPSEEK, "q_lora_rank": None}},
        "llama": MODELS["llama"],
    }
    layouts = {
        "deepseek": {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        "llama": {"tensor_parallel_degree": 2},
    }

    def job(model: str, name: str, nproc: int, parallelism: dict[str, int]) -> dict[str, Any]:
        return tiny_job(
            tmp_path / f"{model}_{name}", tokens,
            model={"custom_model_path": None, **models[model]},
            training={"steps": 4, "global_batch_size": 4, "max_norm": 0.5},
            parallelism=parallelism, launch={"nproc_per_node": nproc},
            checkpoint={"enable": False},
        )  # fmt: skip

    jobs = {model: job(model, "tp2_alone", 2, layout) for model, layout in layouts.items()}
    run_ranks(train_each, list(jobs.values()), store=tmp_path / "store", world=2)
    for model, raw in jobs.items():
        reference = train_here(job(model, "one_alone", 1, {}))
        assert len({round(row["loss"], 5) for row in reference}) == 4
        _assert_same(read_metrics(raw["job"]["dump_folder"]), reference, KEYS[model], model)
