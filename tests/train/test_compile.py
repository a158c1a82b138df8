"""training.compile (regional: each block, plus the fused loss's chunk) trains like eager."""

from __future__ import annotations

from pathlib import Path

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.trainer import Trainer
from train.helpers import tiny_job, write_token_dir


def test_compiled_losses_match_eager_within_bf16_tolerance(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=6000)
    losses = {}
    for compile_ in (False, True):
        raw = tiny_job(
            tmp_path / str(compile_),
            token_dir,
            model={
                "name": "deepseek_v2",
                "flavor": "debugmodel",
                "custom_model_path": None,
                "overrides": {
                    "vocab_size": 512,
                    "n_layers": 1,
                    "first_k_dense_replace": 0,
                    "dim": 64,
                },
            },
            training={"compile": compile_, "steps": 3, "mixed_precision_cpu": True},
            checkpoint={"enable": False},
        )
        trainer = Trainer(resolve_job_config(raw, source="test"))
        try:
            losses[compile_] = [trainer.train_step()["loss"] for _ in range(3)]
        finally:
            trainer.close()
    assert abs(losses[False][-1] - losses[False][0]) > 1e-3  # the updates change the loss
    for eager, compiled in zip(losses[False], losses[True]):
        assert abs(compiled - eager) <= 1e-2 * abs(eager), losses
