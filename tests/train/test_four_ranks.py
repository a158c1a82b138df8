"""Four ranks: EP nested in larger FSDP/HSDP groups, and resuming on another world size.

FSDP 4 + EP 2, EP 4 and HSDP 2×2 + EP 2 must train exactly like one process that
accumulates the same global batch (DeepSeek-V2, and DeepSeek-V3 with MTP); a 2-rank run's
step-3 checkpoint continued on 4 ranks (same global batch) must give the losses of the
uninterrupted 2-rank run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train.helpers import (
    TINY_DEEPSEEK,
    read_metrics,
    run_ranks,
    run_worker,
    step_losses,
    tiny_job,
    train_each,
    train_here,
    train_on_ranks,
    write_token_dir,
)

pytestmark = pytest.mark.slow

LAYOUTS = {
    "fsdp4_ep2": {"expert_parallel_degree": 2},
    "ep4": {"expert_parallel_degree": 4},
    "hsdp2x2_ep2": {"expert_parallel_degree": 2, "data_parallel_replicate_degree": 2},
}


# DeepSeek-V3 (sigmoid, group-limited routing with the correction bias, q-LoRA, one MTP
# depth whose block is an MoE layer too): two steps suffice to carry a bias update over.
# V2 trains every layout; V3's additions (the MTP block, sigmoid group-limited routing and
# its bias) are model code that no layout treats differently, so V3 trains the layout that
# nests all three meshes (replicate × expert-FSDP × EP) once.
MODELS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "model": {},
        "steps": 3,
        "keys": ("loss", "grad_norm", "moe_aux_loss"),
        "layouts": tuple(LAYOUTS),
    },
    "deepseek_v3": {
        "model": {"mtp_depth": 1},
        "steps": 2,
        "keys": ("loss", "grad_norm", "moe_aux_loss", "mtp_loss"),
        "layouts": ("hsdp2x2_ep2",),
    },
}


def _moe_job(
    root: Path, tokens: Path, name: str, parallelism: dict[str, Any], model: str = "deepseek_v2"
) -> dict[str, Any]:
    return tiny_job(
        root / name,
        tokens,
        model={
            "name": model,
            "custom_model_path": None,
            "overrides": TINY_DEEPSEEK,
            **MODELS[model]["model"],
        },
        training={"steps": MODELS[model]["steps"], "global_batch_size": 8, "max_norm": 0.5},
        parallelism=parallelism,
        checkpoint={"enable": False},
    )


def test_four_rank_ep_layouts_train_like_one_process_with_accumulation(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    references, jobs = {}, {}
    for model, spec in MODELS.items():
        references[model] = train_here(_moe_job(tmp_path, tokens, f"one_{model}", {}, model))
        steps = [row["step"] for row in references[model]]
        assert steps == list(range(1, spec["steps"] + 1)), model
        # The weights move every step (the comparison below would be empty otherwise).
        assert len({round(row["loss"], 5) for row in references[model]}) == len(steps), model
        for name in spec["layouts"]:
            job = _moe_job(tmp_path, tokens, f"{model}_{name}", LAYOUTS[name], model)
            job["launch"] = {**job["launch"], "nproc_per_node": 4}
            jobs[model, name] = job
    # Every 4-rank layout in one spawn of 4 gloo ranks (one start-up, not one per layout).
    run_ranks(train_each, list(jobs.values()), store=tmp_path / "store", world=4)
    for (model, name), job in jobs.items():
        rows = read_metrics(job["job"]["dump_folder"])
        assert [row["step"] for row in rows] == [row["step"] for row in references[model]], name
        for ours, theirs in zip(rows, references[model], strict=True):
            for key in MODELS[model]["keys"]:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (name, ours["step"], key)


RESUME_JOB: dict[str, Any] = {
    "training": {"steps": 6, "local_batch_size": 2, "global_batch_size": 8},
    "checkpoint": {"interval": 3},
}


def test_two_ranks_then_four_ranks_continue_like_an_uninterrupted_run(tmp_path: Path) -> None:
    tokens = write_token_dir(tmp_path / "tokens")
    straight = tiny_job(tmp_path / "straight", tokens, **RESUME_JOB)
    train_on_ranks(straight, 2)
    reference = step_losses(straight["job"]["dump_folder"])
    # The uninterrupted run's step-3 checkpoint is the one a 2-rank run stopped after step 3
    # leaves (same job, same steps): continuing it needs no second 2-rank launch. Stopping a
    # run is tested where it matters (test_distributed_training, test_end_to_end).
    step_3 = tmp_path / "straight" / "ckpt" / "step-3"
    assert (step_3 / "metadata.json").is_file()

    job = tiny_job(tmp_path / "resized", tokens, **RESUME_JOB)
    # Continuing is explicit (checkpoint.resume defaults to never); here it names the folder.
    job["checkpoint"] = {**job["checkpoint"], "resume": str(step_3)}
    continued = run_worker(job, nproc=4, timeout_s=300)
    output = continued.stdout + continued.stderr
    assert "written by 2 ranks, now 4" in output and "step-3" in output
    resumed = step_losses(job["job"]["dump_folder"])
    assert sorted(resumed) == [4, 5, 6]  # from the checkpoint, not from step 1
    assert len({round(reference[s], 6) for s in (4, 5, 6)}) == 3  # the losses really change
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), step
