"""Continued pretraining: a fresh run starts from an exported Hugging Face folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.train.helpers import (
    TINY_DEEPSEEK,
    run_worker,
    step_losses,
    tiny_job,
    validation_loader,
    write_token_dir,
)
from titan_kedro.data.loader import TokenLoader
from titan_kedro.data.token_store import open_split
from titan_kedro.models.hf_export import export_hf_folder
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.hf_init import HFInitError, check_hf_config, load_hf_weights
from titan_kedro.train.trainer import build_model


def _job(tmp_path: Path, token_dir: Path, folder: Path | None, **overrides: Any) -> dict[str, Any]:
    return tiny_job(
        tmp_path,
        token_dir,
        model={
            "name": "deepseek_v2",
            "custom_model_path": None,
            "overrides": {**TINY_DEEPSEEK, **overrides},
        },
        training={"steps": 1, "global_batch_size": 4},
        parallelism={"expert_parallel_degree": 2},
        launch={"nproc_per_node": 2},
        checkpoint={"enable": False, "initial_load_hf": str(folder) if folder else None},
    )


def _export(tmp_path: Path, token_dir: Path) -> tuple[Any, torch.nn.Module, Path]:
    resolved = resolve_job_config(_job(tmp_path / "export", token_dir, None))
    # Another seed than the job's, so the run's own initialisation cannot pass for it.
    model = build_model(resolved.spec, resolved.model_args, 123, torch.device("cpu"))
    folder = tmp_path / "hf"
    export_hf_folder(model, resolved.spec, resolved.model_args, folder)
    return resolved, model, folder


@pytest.mark.slow
def test_ep2_run_starts_from_exported_folder_with_its_loss(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=4_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    raw = _job(tmp_path / "run", token_dir, folder)
    proc = run_worker(raw, nproc=2)
    loss = step_losses(raw["job"]["dump_folder"])[1]
    # Rank 0 read only its FSDP / EP shards: about half of the weights.
    read, stored = map(int, re.search(r"this rank read (\d+) of (\d+) bytes", proc.stderr).groups())
    assert 0.4 * stored < read < 0.6 * stored, (read, stored)

    # Step 1's global batch is the first batch of both data-parallel ranks.
    loss_fn = resolved.spec.build_loss_fn(resolved.config)
    tokens = open_split(token_dir, "train")
    batches = [
        next(
            iter(
                TokenLoader(tokens, seq_len=32, local_batch_size=2, dp_rank=r, dp_degree=2, seed=7)
            )
        )
        for r in range(2)
    ]
    own_init = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    with torch.no_grad():
        expected, unloaded = (
            sum(float(loss_fn(m(inputs), labels)) for inputs, labels in batches) / 2
            for m in (model, own_init)
        )
    assert abs(loss - expected) <= 1e-4, (loss, expected)
    assert abs(loss - unloaded) > 1e-3  # the run's own initialisation would not match


def test_single_process_load_reproduces_weights(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    target = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    read = load_hf_weights([target], resolved.spec, resolved.model_args, folder)
    assert read > 0
    theirs = target.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    loader = validation_loader(token_dir, seq_len=32, local_batch_size=2, seed=7)
    inputs, _ = next(iter(loader))
    with torch.no_grad():
        assert torch.equal(model(inputs), target(inputs))


def test_config_mismatch_lists_the_differing_fields(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    _, _, folder = _export(tmp_path, token_dir)
    other = resolve_job_config(_job(tmp_path / "o", token_dir, folder, n_routed_experts=4, dim=32))
    with pytest.raises(HFInitError) as err:
        check_hf_config(other.spec, other.model_args, folder)
    message = str(err.value)
    assert "n_routed_experts: folder 8, config 4" in message
    assert "dim: folder 64, config 32" in message
    assert "n_layers" not in message


def test_hub_per_expert_layout_loads_through_lazy_stacks(tmp_path: Path) -> None:
    # Hub checkpoints (DeepSeek-V2-Lite) hold one tensor per routed expert.
    from safetensors.torch import load_file, save_file

    token_dir = write_token_dir(tmp_path / "tokens", n_train=2_000)
    resolved, model, folder = _export(tmp_path, token_dir)
    fused = load_file(str(folder / "model.safetensors"))
    per_expert = {}
    for key, value in fused.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                per_expert[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                per_expert[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, down in enumerate(value):
                per_expert[f"{prefix}{e}.down_proj.weight"] = down.contiguous()
        else:
            per_expert[key] = value
    (folder / "model.safetensors").unlink()
    save_file(per_expert, str(folder / "model.safetensors"))
    target = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    load_hf_weights([target], resolved.spec, resolved.model_args, folder)
    theirs = target.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key


def test_published_v2_lite_config_matches_the_v2_lite_flavor(tmp_path: Path) -> None:
    import json

    from tests.models.test_deepseek_v2_hf import PUBLISHED
    from titan_kedro.models import get_train_spec

    spec = get_train_spec("deepseek_v2")
    folder = tmp_path / "lite"
    folder.mkdir()
    config = {**PUBLISHED["v2-lite"], "model_type": "deepseek_v2"}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    check_hf_config(spec, spec.resolve_args("v2-lite", {"max_seq_len": 4096}), folder)
    with pytest.raises(HFInitError, match="n_routed_experts: folder 64, config 160"):
        check_hf_config(spec, spec.resolve_args("v2", {}), folder)
