"""Tensor parallelism (with sequence parallelism) trains like one process, and its checkpoint
continues without it.

DeepSeek-V2 (MLA with q-LoRA, a dense block, MoE blocks with shared experts, the balance
loss and the routing bias, two blocks recomputed in backward) on 4 ranks as TP 2 × FSDP 2 with EP 2 folded onto the TP ranks,
and Llama 3 (GQA) as TP 2 on 2 ranks, must give the losses, gradient norms and auxiliary
losses of one process that accumulates the same global batch, within 1e-5 over 6 steps
in float32 (only the reduction order differs). The DeepSeek run's step-3 checkpoint,
continued by one process (TP 1), must give the uninterrupted reference's steps 4-6.

The three one-process runs share one Python process (the trainer leaves its process group
when it closes), so the test starts three process groups in all.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from train.helpers import REPO, TINY_DEEPSEEK, read_metrics, run_worker, tiny_job, write_token_dir

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


def _one_process(jobs: list[dict[str, Any]]) -> None:
    """Train ``jobs`` one after another in one plain Python process (world size 1)."""
    files = []
    for raw in jobs:
        dump = Path(raw["job"]["dump_folder"])
        dump.mkdir(parents=True, exist_ok=True)
        files.append(dump / "input_config.yaml")
        files[-1].write_text(yaml.safe_dump(raw), encoding="utf-8")
    script = (
        "import sys\nfrom titan_kedro.train.__main__ import run_worker\n"
        "for path in sys.argv[1:]:\n    run_worker(['--config', path])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, files)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


def _assert_same(ours: list[dict], theirs: list[dict], keys: tuple[str, ...], what: str) -> None:
    assert [row["step"] for row in ours] == [row["step"] for row in theirs], what
    for mine, reference in zip(ours, theirs, strict=True):
        for key in (key for key in keys if key in reference):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5), (what, mine["step"], key)


def test_tensor_parallel_layouts_train_like_one_process_and_resume_without_tp(
    tmp_path: Path,
) -> None:
    tokens = write_token_dir(tmp_path / "tokens", n_train=4_000)
    deepseek_tp = _job(
        tmp_path,
        tokens,
        "deepseek",
        "tp2_fsdp2_ep2",
        parallelism={"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        checkpoint={"interval": 3},
    )
    run_worker(deepseek_tp, nproc=4, timeout_s=300)
    llama_tp = _job(tmp_path, tokens, "llama", "tp2", parallelism={"tensor_parallel_degree": 2})
    run_worker(llama_tp, nproc=2, timeout_s=300)

    resumed = _job(tmp_path, tokens, "deepseek", "resumed_tp1", checkpoint={"resume": "latest"})
    step_3 = Path(deepseek_tp["checkpoint"]["folder"]) / "step-3"
    shutil.copytree(step_3, Path(resumed["checkpoint"]["folder"]) / "step-3")
    references = {model: _job(tmp_path, tokens, model, "one") for model in MODELS}
    _one_process([*references.values(), resumed])

    reference = {
        model: read_metrics(job["job"]["dump_folder"]) for model, job in references.items()
    }
    assert [row["step"] for row in reference["deepseek"]] == STEPS
    # The losses really move (the comparison would be empty otherwise).
    assert len({round(row["loss"], 5) for row in reference["deepseek"]}) == len(STEPS)
    assert "val_loss" in reference["llama"][-1]
    for model, job in (("deepseek", deepseek_tp), ("llama", llama_tp)):
        _assert_same(read_metrics(job["job"]["dump_folder"]), reference[model], KEYS[model], model)
    # Throughput per rank: a TP 2 group shares its 4 micro-batches × 2 × 32 tokens per step.
    for row in read_metrics(llama_tp["job"]["dump_folder"]):
        assert row["tps"] * row["step_time_s"] == pytest.approx(4 * 2 * 32 / 2)
    _assert_same(
        read_metrics(resumed["job"]["dump_folder"]),
        reference["deepseek"][3:],
        KEYS["deepseek"],
        "TP 2 checkpoint resumed on TP 1",
    )
