"""Validation never scores a held-out window twice: requested batches are capped, with a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.trainer import Trainer
from titan_kedro.train.validation import capped_batches
from train.helpers import tiny_job, write_token_dir


def test_capped_batches_warns_only_when_capping(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert capped_batches(3, 5, "validation.steps") == 3
        assert not caplog.records
        assert capped_batches(9, 5, "validation.steps") == 5
    assert "validation.steps=9" in caplog.text and "holds 5 batch(es)" in caplog.text


def test_trainer_validation_is_capped_at_the_held_out_windows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 4,000 validation tokens: 124 windows of 32 tokens → 62 batches of 2.
    tokens = write_token_dir(tmp_path / "tokens")
    raw = tiny_job(tmp_path, tokens, validation={"freq": 2, "steps": 10_000})
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(resolve_job_config(raw, source="test"))
    try:
        available = trainer._validation_loader().batches_per_epoch
        assert available == (4000 - 1) // 32 // 2
        assert trainer.val_batches == available
        assert "validation.steps=10000" in caplog.text
    finally:
        trainer.close()
