"""Evaluation: sampling, held-out loss, prompts from documents, and the pipeline on a checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import c4_documents
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.models import get_train_spec
from titan_kedro.models.generate import generate
from titan_kedro.pipelines.evaluation import create_pipeline
from titan_kedro.pipelines.evaluation.pipeline import load_final_model_node
from titan_kedro.pipelines.job_params import JOB_PARAMS
from titan_kedro.train import evaluate, validation
from titan_kedro.train.trainer import build_model

TINY_LLAMA = {
    "vocab_size": 96,
    "dim": 32,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "max_seq_len": 64,
}


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    spec = get_train_spec("llama3")
    return build_model(spec, spec.resolve_args("debugmodel", TINY_LLAMA), 0, torch.device("cpu"))


def test_the_checkpoint_loader_takes_every_job_config_section() -> None:
    assert set(load_final_model_node().inputs) == {"training_summary", *JOB_PARAMS.values()}


def test_greedy_matches_a_step_by_step_argmax(tiny_model: torch.nn.Module) -> None:
    prompt = [1, 5, 9, 13]
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            expected.append(int(tiny_model(torch.tensor([expected]))[0, -1].argmax()))
    tiny_model.train()
    assert generate(tiny_model, [prompt], max_new_tokens=6) == [expected[4:]]
    assert tiny_model.training  # mode restored


def test_top_k_sampling_is_seeded_and_stays_in_the_top_k(tiny_model: torch.nn.Module) -> None:
    prompts = [[1, 2, 3], [4, 5, 6]]
    first = generate(tiny_model, prompts, max_new_tokens=12, top_k=5, seed=7)
    assert first == generate(tiny_model, prompts, max_new_tokens=12, top_k=5, seed=7)
    assert first != generate(tiny_model, prompts, max_new_tokens=12, top_k=5, seed=8)
    with torch.no_grad():
        top5 = tiny_model(torch.tensor(prompts))[:, -1].topk(5).indices.tolist()
    assert all(row[0] in allowed for row, allowed in zip(first, top5))


def test_generation_stops_at_eos_and_respects_the_vocab_limit(tiny_model: torch.nn.Module) -> None:
    limited = generate(tiny_model, [[1, 2]], max_new_tokens=20, top_k=50, seed=0, vocab_limit=10)
    assert max(limited[0]) < 10
    greedy = generate(tiny_model, [[1, 2]], max_new_tokens=5)[0]
    stopped = generate(tiny_model, [[1, 2]], max_new_tokens=5, eos_id=greedy[1])[0]
    assert stopped == greedy[:2]
    with pytest.raises(ValueError, match="share one length"):
        generate(tiny_model, [[1, 2], [3]], max_new_tokens=2)


def test_mean_loss_is_the_mean_cross_entropy_and_restores_mode(tiny_model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 96, (2, 8), generator=g), torch.randint(0, 96, (2, 8), generator=g))
        for _ in range(3)
    ]
    loss_fn = lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # noqa: E731
    with torch.no_grad():
        expected = np.mean([float(loss_fn(tiny_model(x), y)) for x, y in batches[:2]])
    tiny_model.train()
    loss, tokens = validation.mean_loss(tiny_model, iter(batches), loss_fn, n_batches=2)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert tokens == 32 and tiny_model.training
    with pytest.raises(ValueError, match="validation split is shorter than one batch"):
        validation.mean_loss(tiny_model, iter([]), loss_fn, n_batches=2)


def test_prompts_come_from_document_starts_and_skip_short_documents() -> None:
    bos, eos = 100, 101
    stream = np.array([bos, 1, 2, eos, bos, 3, 4, 5, 6, eos, bos, 7, 8, 9, eos], dtype=np.uint32)
    assert evaluate.document_prompts(stream, bos_id=bos, eos_id=eos, count=2, length=4) == [
        [bos, 3, 4, 5],
        [bos, 7, 8, 9],
    ]
    with pytest.raises(ValueError, match="only 2 validation documents have 4 tokens"):
        evaluate.document_prompts(stream, bos_id=bos, eos_id=eos, count=3, length=4)


def write_checkpoint(model: torch.nn.Module, folder: Path, step: int) -> Path:
    """A checkpoint in the trainer's layout (DCP ``model`` state + metadata.json)."""
    path = folder / f"step-{step}"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"step": step}))
    return path


def test_evaluation_pipeline_on_a_checkpoint(tmp_path: Path) -> None:
    tok = build_tokenizer("deepseek-ai/DeepSeek-V2-Lite")
    stream = np.concatenate(
        [
            np.asarray(ids, dtype=np.uint32)
            for ids in tok.encode_batch(c4_documents(40), bos=True, eos=True)
        ]
    )
    overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128}
    params: dict[str, Any] = {
        "model": {"name": "llama3", "flavor": "debugmodel", "overrides": overrides},
        "training": {"seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "job": {"seed": 3},
        "checkpoint": {"folder": str(tmp_path / "ckpt")},
        "tokenizer": {"name_or_path": "deepseek-ai/DeepSeek-V2-Lite"},
        "evaluation": {
            "batches": 2,
            "num_prompts": 2,
            "prompt_tokens": 6,
            "max_new_tokens": 4,
            "top_k": 10,
            "temperature": 1.0,
        },
    }
    spec = get_train_spec("llama3")
    trained = build_model(spec, spec.resolve_args("debugmodel", overrides), 99, torch.device("cpu"))
    write_checkpoint(trained, tmp_path / "ckpt", 2)
    checkpoint = write_checkpoint(trained, tmp_path / "ckpt", 4)

    catalog = DataCatalog(
        {
            "training_summary": MemoryDataset({"checkpoint_dir": str(checkpoint), "final_step": 4}),
            "token_files": MemoryDataset(
                {"validation": stream, "metadata": {"tokenizer": {"fingerprint": tok.fingerprint}}},
                copy_mode="assign",
            ),
            **{ds: MemoryDataset(params.get(name, {})) for name, ds in JOB_PARAMS.items()},
            **{
                name: MemoryDataset()
                for name in ("evaluation_results", "evaluation_metrics", "generations")
            },
        }
    )
    SequentialRunner().run(create_pipeline(), catalog)
    results = catalog["evaluation_results"].load()
    metrics = catalog["evaluation_metrics"].load()
    generations = catalog["generations"].load()

    # The loss is the trained weights' loss (seed 99), not a fresh model's (seed 3).
    from titan_kedro.data.loader import TokenLoader

    loader = TokenLoader(stream, seq_len=32, local_batch_size=2, data_rank=0, data_ranks=1, seed=3)
    expected, _ = validation.mean_loss(trained, iter(loader), spec.build_loss_fn(None), n_batches=2)
    assert results["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert results["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert results["step"] == 4 and results["tokens_evaluated"] == 2 * 2 * 32
    assert metrics == {
        "eval_loss": {"value": results["eval_loss"], "step": 4},
        "eval_perplexity": {"value": results["eval_perplexity"], "step": 4},
    }
    samples = generations["samples"]
    assert len(samples) == 2
    for sample in samples:
        assert sample["prompt_ids"][0] == tok.bos_id and len(sample["prompt_ids"]) == 6
        assert sample["prompt"] == tok.decode(sample["prompt_ids"])
        assert 1 <= len(sample["greedy_ids"]) <= 4 and sample["greedy"] == tok.decode(
            sample["greedy_ids"]
        )
        assert max(sample["sampled_ids"]) < tok.vocab_size
    assert generations["settings"]["seed"] == 3


def test_evaluation_refuses_tokens_made_by_another_tokenizer(tmp_path: Path) -> None:
    spec = get_train_spec("llama3")
    model = build_model(spec, spec.resolve_args("debugmodel", TINY_LLAMA), 0, torch.device("cpu"))
    resolved_params = {
        "model": {"name": "llama3", "flavor": "debugmodel", "overrides": TINY_LLAMA},
        "training": {"seq_len": 32},
    }
    from titan_kedro.models.resolve import resolve_job_config
    from titan_kedro.pipelines.evaluation.nodes import generate_samples

    loaded = evaluate.LoadedCheckpoint(model, resolve_job_config(resolved_params), tmp_path, 1)
    with pytest.raises(ValueError, match="is not the one the token files were made with"):
        generate_samples(
            loaded,
            {
                "validation": np.zeros(10, dtype=np.uint32),
                "metadata": {"tokenizer": {"fingerprint": "other"}},
            },
            {"name_or_path": "deepseek-ai/DeepSeek-V2-Lite"},
            {
                "num_prompts": 1,
                "prompt_tokens": 4,
                "max_new_tokens": 2,
                "top_k": 2,
                "temperature": 1.0,
            },
        )


def test_missing_checkpoint_fails_with_advice(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint to evaluate.*checkpoint.enable: true"
    ):
        evaluate.resolve_checkpoint({"checkpoint_dir": None}, tmp_path / "nothing")
