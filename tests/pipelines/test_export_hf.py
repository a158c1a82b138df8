"""Hugging Face export: transformers loads the folder, and its logits are ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.models import get_train_spec
from titan_kedro.models.export_folder import MARKER, ExportFolderError, recover
from titan_kedro.models.hf_export import compare_logits, export_hf_folder
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.pipelines.export_hf import nodes as export_nodes
from titan_kedro.pipelines.export_hf.nodes import export_final_model
from titan_kedro.train.evaluate import LoadedCheckpoint
from titan_kedro.train.trainer import build_model

TOKENIZER = "deepseek-ai/DeepSeek-V2-Lite"
# Small DeepSeek-V2 with the real (padded) vocabulary: 102400 embedding rows, 100002 tokens.
TINY_DSV2 = {
    "vocab_size": 102400,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 2,
    "max_seq_len": 128,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def dsv2() -> tuple[Any, Any, torch.nn.Module]:
    spec = get_train_spec("deepseek_v2")
    args = spec.resolve_args("debugmodel", TINY_DSV2)
    return spec, args, build_model(spec, args, 5, torch.device("cpu")).eval()


def _tokens(tokenizer: Any) -> torch.Tensor:
    ids = tokenizer.encode(
        "The river runs through the old city, past the market.", bos=True, eos=False
    )
    return torch.tensor([ids])


def test_export_loads_with_auto_classes_and_matches_our_logits(
    tmp_path: Path, tokenizer: Any, dsv2: tuple[Any, Any, torch.nn.Module]
) -> None:
    spec, args, model = dsv2
    folder = tmp_path / "hf"
    files = export_hf_folder(model, spec, args, folder, tokenizer=tokenizer, model_card="# card\n")
    names = {p.name for p in files}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= names
    assert not (tmp_path / "hf.tmp").exists()

    config = json.loads((folder / "config.json").read_text())
    # The model's (padded) embedding size, not the tokenizer's 100002.
    assert config["vocab_size"] == 102400 != tokenizer.vocab_size
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)

    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    tokens = _tokens(tokenizer)
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= 1e-4

    hf_tok = AutoTokenizer.from_pretrained(folder)
    text = "Tokenizers must agree: 12345 naïve café"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(
        text, bos=False, eos=False
    )


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[Any, Any, torch.nn.Module]:
    spec = get_train_spec("llama3")
    args = spec.resolve_args(
        "debugmodel",
        {
            "vocab_size": 512,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 64,
        },
    )
    return spec, args, build_model(spec, args, 0, torch.device("cpu")).eval()


def _export(tiny: tuple[Any, Any, torch.nn.Module], folder: Path, **kwargs: Any) -> list[Path]:
    spec, args, model = tiny
    return export_hf_folder(model, spec, args, folder, **kwargs)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_refuses_a_folder_that_is_not_an_export_and_deletes_nothing(
    tmp_path: Path, tiny_llama: tuple[Any, Any, torch.nn.Module]
) -> None:
    # export.folder=data/06_models: the folder that holds the run's checkpoints.
    models = tmp_path / "data" / "06_models"
    (models / "checkpoints" / "run" / "step-4").mkdir(parents=True)
    (models / "checkpoints" / "run" / "step-4" / "metadata.json").write_text("{}")
    (models / "model_spec.json").write_text("{}")
    before = _tree(models)
    with pytest.raises(ExportFolderError, match=rf"refusing to replace .*06_models.*no {MARKER}"):
        _export(tiny_llama, models)
    assert _tree(models) == before
    assert sorted(p.name for p in models.parent.iterdir()) == ["06_models"]  # no staging left


def test_re_export_replaces_a_previous_export_but_not_files_added_to_it(
    tmp_path: Path, tiny_llama: tuple[Any, Any, torch.nn.Module]
) -> None:
    folder = tmp_path / "hf"
    _export(tiny_llama, folder, model_card="# one\n")
    files = _export(tiny_llama, folder, model_card="# two\n")
    assert (folder / "README.md").read_text() == "# two\n"
    assert {p.name for p in files} <= set(json.loads((folder / MARKER).read_text())["files"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no aside or staging left
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ExportFolderError, match=r"did not write \(notes.txt\)"):
        _export(tiny_llama, folder)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "README.md").is_file()


def test_an_export_interrupted_between_its_renames_is_put_back(
    tmp_path: Path, tiny_llama: tuple[Any, Any, torch.nn.Module]
) -> None:
    folder = tmp_path / "hf"
    _export(tiny_llama, folder, model_card="# old\n")
    folder.rename(tmp_path / ".hf.previous")  # the crash: old one aside, new one not in yet
    recover(folder)
    assert (folder / "README.md").read_text() == "# old\n"
    assert not (tmp_path / ".hf.previous").exists()


def test_large_weights_are_sharded_with_an_index(
    tmp_path: Path, tiny_llama: tuple[Any, Any, torch.nn.Module]
) -> None:
    spec, args, model = tiny_llama
    files = export_hf_folder(model, spec, args, tmp_path / "hf", max_shard_gib=100_000 / 2**30)
    shards = [p for p in files if p.suffix == ".safetensors"]
    assert len(shards) > 1 and not (tmp_path / "hf" / "model.safetensors").exists()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    assert compare_logits(tmp_path / "hf", model, tokens) <= 1e-4


def test_a_spec_without_adapter_is_refused(
    tmp_path: Path, dsv2: tuple[Any, Any, torch.nn.Module]
) -> None:
    spec, args, model = dsv2
    from dataclasses import replace

    with pytest.raises(ValueError, match="has no Hugging Face counterpart"):
        export_hf_folder(model, replace(spec, state_dict_adapter=None), args, tmp_path / "hf")


def _run_export_node(
    tmp_path: Path, model: torch.nn.Module, tokenizer: Any, **export: Any
) -> dict[str, Any]:
    resolved = resolve_job_config(
        {
            "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": TINY_DSV2},
            "training": {"seq_len": 64},
        }
    )
    stream = np.asarray(_tokens(tokenizer)[0].tolist() * 4, dtype=np.uint32)
    return export_final_model(
        final_model=LoadedCheckpoint(model, resolved, tmp_path / "step-7", 7),
        token_files={"validation": stream},
        tokenizer={"name_or_path": TOKENIZER},
        export={
            "folder": str(tmp_path / "hf"),
            "verify": True,
            "verify_tokens": 32,
            "tolerance": 1e-4,
            "max_shard_gib": 5.0,
            **export,
        },
        training_summary={"tokens_seen": 1234},
        evaluation_results={"eval_loss": 7.5, "eval_perplexity": 1808.0},
        reporting_summary={"final_loss": 7.0},
    )


def test_export_node_verifies_the_folder_and_writes_a_model_card(
    tmp_path: Path, tokenizer: Any, dsv2: tuple[Any, Any, torch.nn.Module]
) -> None:
    manifest = _run_export_node(tmp_path, dsv2[2], tokenizer)
    assert manifest["faithful"] is True and manifest["max_abs_logit_diff"] <= 1e-4
    assert (manifest["vocab_size"], manifest["tokenizer_vocab_size"]) == (
        102400,
        tokenizer.vocab_size,
    )
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "| validation loss | 7.5 |" in card and "| training steps | 7 |" in card


def test_export_node_flags_a_nonzero_expert_bias_that_transformers_cannot_express(
    tmp_path: Path, tokenizer: Any
) -> None:
    spec = get_train_spec("deepseek_v2")
    # The routing bias is opt-in (aux-loss-free balancing); only then does it steer routing.
    args = spec.resolve_args("debugmodel", {**TINY_DSV2, "load_balance_bias_update_speed": 0.001})
    model = build_model(spec, args, 5, torch.device("cpu")).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.tensor([5.0, -5.0, 5.0, -5.0]))
    manifest = _run_export_node(tmp_path, model, tokenizer)
    assert manifest["faithful"] is False and manifest["max_abs_logit_diff"] > 1e-4
    assert "expert bias is not zero" in manifest["mismatch_reason"]


def test_export_node_registers_under_the_configured_name_and_alias(
    tmp_path: Path,
    tokenizer: Any,
    dsv2: tuple[Any, Any, torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registered: list[tuple[str, str]] = []

    class Registered:
        def to_dict(self) -> dict[str, str]:
            return {"name": registered[0][0], "alias": registered[0][1]}

    def register(folder: Path, *, name: str, alias: str) -> Registered:
        registered.append((name, alias))
        return Registered()

    monkeypatch.setattr(export_nodes.mlflow, "active_run", object)  # a run is active
    monkeypatch.setattr(export_nodes, "register_hf_folder", register)
    manifest = _run_export_node(
        tmp_path, dsv2[2], tokenizer, verify=False, registered_model_name="mine", alias="staging"
    )
    assert registered == [("mine", "staging")]  # the node's export settings, not the defaults
    assert manifest["registered_model"] == {"name": "mine", "alias": "staging"}
