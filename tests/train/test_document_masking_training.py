"""The trainer passes document positions and ids to the model (training.document_masking)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.token_store import open_split
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.documents import document_inputs
from titan_kedro.train.trainer import Trainer, build_model
from train.helpers import tiny_job

BOS = 1


def _packed_token_dir(folder: Path, vocab: int = 128) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for split in ("train", "validation"):
        tokens = rng.integers(2, vocab, 4000).astype("<u4")
        tokens[np.cumsum(rng.integers(3, 12, 800)) % 4000] = BOS
        tokens.tofile(folder / f"{split}.bin")
    (folder / "metadata.json").write_text(json.dumps({"vocab_size": vocab, "bos_id": BOS}))
    return folder


def test_first_step_loss_is_the_document_masked_loss(tmp_path: Path) -> None:
    token_dir = _packed_token_dir(tmp_path / "tokens")
    losses = {}
    for masking in (True, False):
        raw = tiny_job(
            tmp_path / str(masking),
            token_dir,
            model={
                "name": "llama3",
                "flavor": "debugmodel",
                "custom_model_path": None,
                "overrides": {
                    "vocab_size": 128,
                    "n_layers": 1,
                    "dim": 32,
                    "n_heads": 2,
                    "n_kv_heads": 2,
                },
            },
            training={"document_masking": masking, "steps": 1},
            checkpoint={"enable": False},
        )
        resolved = resolve_job_config(raw, source="test")
        trainer = Trainer(resolved)
        try:
            assert trainer.document_bos == (BOS if masking else None)
            losses[masking] = trainer.train_step()["loss"]
        finally:
            trainer.close()
    cfg = resolved.config
    reference = build_model(resolved.spec, resolved.model_args, cfg.job.seed, torch.device("cpu"))
    loader = TokenLoader(
        open_split(token_dir, "train"),
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        data_rank=0,
        data_ranks=1,
        seed=cfg.job.seed,
    )
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        for masking, bos in ((True, BOS), (False, None)):
            logits = reference(inputs, **document_inputs(inputs, bos))
            expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
            assert abs(losses[masking] - expected) < 1e-5, masking
    assert abs(losses[True] - losses[False]) > 1e-4
