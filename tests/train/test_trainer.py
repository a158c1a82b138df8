"""The training loop in this process (a one-rank group): resume, NaN stop, MoE hooks, metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.runs.resume import latest_checkpoint, list_checkpoints
from titan_kedro.train.checkpoint.safe_load import load_model_weights
from titan_kedro.train.fused_loss import FusedOutputLoss
from titan_kedro.train.trainer import NonFiniteLossError, Trainer
from titan_kedro.train.validation import mean_loss
from train.helpers import (
    assert_first_step_moves_weights_by_lr,
    read_metrics,
    tiny_job,
    validation_loader,
    write_token_dir,
)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_dir(tmp_path_factory.mktemp("tokens"))


def _trainer(raw: dict[str, Any]) -> Trainer:
    return Trainer(resolve_job_config(raw, source="test"))


def _run(raw: dict[str, Any], stop_at: int | None = None) -> dict[str, Any]:
    trainer = _trainer(raw)
    try:
        return trainer.train(stop_at=stop_at)
    finally:
        trainer.close()


def _no_exit(code: int) -> None:
    raise AssertionError(f"a test hook ended the process (os._exit({code}))")


def _losses(dump: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(dump)}


def test_exact_resume_matches_a_straight_run(
    tmp_path: Path, token_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = {"training": {"steps": 6, "global_batch_size": 4}, "checkpoint": {"interval": 100}}
    straight = tiny_job(tmp_path / "straight", token_dir, **job)
    split = tiny_job(tmp_path / "split", token_dir, **job)
    # The crash hook's variables without the switch (TITAN_KEDRO_TEST_HOOKS): nothing happens.
    monkeypatch.setenv("TITAN_KEDRO_CRASH_AT_STEP", "2")
    monkeypatch.setenv("TITAN_KEDRO_CRASH_RANK", "0")
    monkeypatch.delenv("TITAN_KEDRO_TEST_HOOKS", raising=False)
    monkeypatch.setattr("os._exit", _no_exit)
    _run(straight)
    monkeypatch.delenv("TITAN_KEDRO_CRASH_AT_STEP")
    first = _run(split, stop_at=3)
    assert first["final_step"] == 3 and first["checkpoint_dir"].endswith("step-3")
    second = _run({**split, "checkpoint": {**split["checkpoint"], "resume": "latest"}})
    assert second["final_step"] == 6
    a, b = _losses(tmp_path / "straight" / "job"), _losses(tmp_path / "split" / "job")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), step
    assert a[6] < a[1]  # it learns
    summary = json.loads((tmp_path / "split" / "job" / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["tokens_seen"] == 6 * 4 * 32
    assert summary["final_loss"] == pytest.approx(a[6], rel=1e-6)
    assert set(summary) == {
        "checkpoint_dir",
        "final_step",
        "final_loss",
        "tokens_seen",
        "wall_time_s",
    }


def test_nan_stops_with_last_good_checkpoint_kept(tmp_path: Path, token_dir: Path) -> None:
    raw = tiny_job(tmp_path, token_dir, training={"steps": 5}, checkpoint={"interval": 2})
    stale = tmp_path / "ckpt" / "step-9.tmp"  # left by a crash in an earlier save
    (stale / "dir").mkdir(parents=True)
    trainer = _trainer(raw)
    try:
        trainer.train(stop_at=2)
        assert not stale.exists()  # removed by the next save
        with torch.no_grad():
            next(trainer.model.parameters()).fill_(float("nan"))  # one rank: plain tensors
        with pytest.raises(NonFiniteLossError, match=r"step 3 .*step-2"):
            trainer.train()
    finally:
        trainer.close()
    assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-2"
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2]


def test_a_run_stopped_early_validates_and_logs_its_last_step(
    tmp_path: Path, token_dir: Path
) -> None:
    # Step 3 is neither a validation step (freq 4), a log step (freq 5) nor training.steps;
    # it is the last step of this run (stop_at), so its validation and metrics row happen.
    raw = tiny_job(
        tmp_path,
        token_dir,
        training={"steps": 6},
        validation={"freq": 4, "steps": 2},
        metrics={"log_freq": 5},
    )
    first = _run(raw, stop_at=3)
    assert first["final_step"] == 3 and first["checkpoint_dir"].endswith("step-3")
    rows = read_metrics(tmp_path / "job")
    assert [r["step"] for r in rows] == [3]
    assert rows[0]["val_loss"] > 0 and "tps" in rows[0]
    _run({**raw, "checkpoint": {**raw["checkpoint"], "resume": "latest"}})
    rows = read_metrics(tmp_path / "job")
    assert [(r["step"], "val_loss" in r) for r in rows] == [
        (3, True),
        (4, True),
        (5, False),
        (6, True),
    ]


PEAK_TFLOPS = 0.25
# TinyArgs: dim 32, 2 layers, vocab 512; seq_len 32 → 6·(layers·(12·dim² + 2·seq·dim) + dim·vocab)
TINY_FLOPS_PER_TOKEN = 6.0 * (2 * 12 * 32 * 32 + 32 * 512 + 32 * 4) + 12 * 2 * 32 * 32
"""``tiny_moe`` (dim 32, 2 layers, vocab 512, 4 experts) at seq_len 32: 6 × (block matmul
weights + output + router) + 12 · layers · dim · seq_len (attention)."""


def test_metrics_validation_moe_hooks_and_weights(tmp_path: Path, token_dir: Path) -> None:
    raw = tiny_job(
        tmp_path,
        token_dir,
        model={"name": "tiny_moe"},
        training={"steps": 4, "max_norm": 0.5},
        validation={"freq": 2, "steps": 2},
        metrics={"log_freq": 2, "peak_tflops": PEAK_TFLOPS},
        checkpoint={"interval": 2, "keep_latest_k": 1},
    )
    trainer = _trainer(raw)
    try:
        assert isinstance(trainer.loss_fn, FusedOutputLoss)  # the model returns hidden states
        bias_before = trainer.model.expert_bias.clone()
        trainer.train()
        bias_changed = not torch.equal(trainer.model.expert_bias, bias_before)
        reference = {
            k: v.full_tensor()
            for k, v in trainer.model.state_dict().items()
            if hasattr(v, "full_tensor")
        }
    finally:
        trainer.close()
    assert bias_changed  # update_expert_bias ran with the reduced load
    rows = read_metrics(tmp_path / "job")
    assert [r["step"] for r in rows] == [2, 4]
    keys = {
        "loss",
        "grad_norm",
        "lr",
        "step_time_s",
        "data_time_s",
        "tps",
        "tflops",
        "mfu_pct",
        "memory_gib",
        "vmhwm_gib",
        "moe_max_load_ratio",
        "moe_dead_expert_frac",
        "val_loss",
        "val_perplexity",
        "tokens_seen",
        "expert_load",
    }
    for row in rows:
        assert keys <= set(row), keys - set(row)
        assert row["grad_norm"] > 0 and row["tps"] > 0
        # MFU from the logged tokens/s, the tiny model's FLOPs counted by hand, the set peak.
        assert row["tflops"] == pytest.approx(row["tps"] * TINY_FLOPS_PER_TOKEN / 1e12)
        assert row["mfu_pct"] == pytest.approx(
            100 * row["tps"] * TINY_FLOPS_PER_TOKEN / 1e12 / PEAK_TFLOPS
        )
        assert row["val_perplexity"] == pytest.approx(__import__("math").exp(row["val_loss"]))
        load = torch.tensor(row["expert_load"])
        assert load.shape == (1, 4) and load.sum().item() == pytest.approx(1.0)
        assert row["moe_max_load_ratio"] >= 1.0
    # keep_latest_k=1 leaves only the final checkpoint, which loads into a plain model
    (only,) = list_checkpoints(tmp_path / "ckpt")
    assert only[0] == 4
    spec = resolve_job_config(raw).spec
    plain = spec.build_model(spec.flavors["debugmodel"])
    load_model_weights(only[1], plain)
    for name, tensor in reference.items():
        torch.testing.assert_close(plain.state_dict()[name], tensor, msg=name)
    # The logged val_loss is what evaluation's mean_loss gives the final weights on the
    # same held-out batches, through plain logits and the unfused loss.
    loader = validation_loader(token_dir, seq_len=32, local_batch_size=2, seed=raw["job"]["seed"])
    expected, tokens = mean_loss(
        plain, loader, spec.build_loss_fn(resolve_job_config(raw).config), n_batches=2
    )
    assert tokens == 2 * 2 * 32
    assert rows[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_trains_unwrapped_like_fsdp(
    tmp_path: Path, token_dir: Path, bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.fsdp import FSDPModule

    from titan_kedro.train.parallel_dims import ParallelDims

    def losses(name: str) -> tuple[list[float], Trainer]:
        raw = tiny_job(
            tmp_path / name,
            token_dir,
            training={"mixed_precision_cpu": bf16},
            checkpoint={"enable": False},
        )
        trainer = _trainer(raw)
        try:
            first = (
                assert_first_step_moves_weights_by_lr(trainer)
                if name == "plain"
                else trainer.train_step()
            )
            return [first["loss"]] + [trainer.train_step()["loss"] for _ in range(2)], trainer
        finally:
            trainer.close()

    plain, trainer = losses("plain")
    assert not any(isinstance(m, FSDPModule) for m in trainer.model.modules())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.autocast_dtype == (torch.bfloat16 if bf16 else None)
    monkeypatch.setattr(ParallelDims, "fsdp_enabled", property(lambda self: True))
    sharded, trainer = losses("fsdp")  # what one rank ran before: FSDP2 over a 1-rank mesh
    assert isinstance(trainer.model, FSDPModule) and trainer.autocast_dtype is None
    # float32 (one thread): the same operations in the same order, so equal. bf16: autocast rounds
    # each matmul's inputs to bf16, FSDP's policy rounds the weights and keeps bf16
    # activations between ops; measured ≤ 7.4e-5 relative over the 3 steps, bounded at
    # 1/10 of a bf16 unit roundoff (2^-8): a loss off by one bf16 rounding would fail.
    tolerance = 2**-8 / 10 if bf16 else 0
    for a, b in zip(plain, sharded, strict=True):
        assert a == pytest.approx(b, rel=tolerance, abs=0), (plain, sharded)
