"""The export registered in MLflow loads back as ``models:/<name>@<alias>`` with our logits."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import torch
from mlflow_store import migrated_store

from titan_kedro.models import get_train_spec
from titan_kedro.models.hf_export import export_hf_folder
from titan_kedro.tracking.model_registry import register_hf_folder
from titan_kedro.train.trainer import build_model

TINY = {
    "vocab_size": 512,
    "dim": 32,
    "n_layers": 2,
    "n_heads": 2,
    "max_seq_len": 64,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
}


def test_registered_alias_loads_and_matches_our_logits(tmp_path: Path) -> None:
    spec = get_train_spec("deepseek_v2")
    args = spec.resolve_args("debugmodel", TINY)
    model = build_model(spec, args, 3, torch.device("cpu")).eval()
    folder = tmp_path / "hf"
    export_hf_folder(model, spec, args, folder)

    mlflow.set_tracking_uri(migrated_store(tmp_path / "mlflow.db"))
    mlflow.set_experiment("registry-test")
    try:
        with mlflow.start_run() as run:
            first = register_hf_folder(folder, name="tiny-dsv2", alias="candidate")
        second = register_hf_folder(
            folder, name="tiny-dsv2", alias="candidate", run_id=run.info.run_id
        )
        assert (first.version, second.version) == ("1", "2")
        version = mlflow.MlflowClient().get_model_version_by_alias("tiny-dsv2", "candidate")
        assert str(version.version) == "2" and version.run_id == run.info.run_id

        loaded = mlflow.pyfunc.load_model(second.uri)
        tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
        theirs = loaded.predict({"input_ids": tokens.numpy()})
        with torch.no_grad():
            ours = model(tokens).numpy()
        assert theirs.shape == ours.shape == (2, 12, 512)
        assert float(np.abs(theirs - ours).max()) <= 1e-4
    finally:
        mlflow.set_tracking_uri(None)
