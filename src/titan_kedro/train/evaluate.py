"""Single-process evaluation of a checkpoint: loading it and sample generations.

Its held-out loss comes from ``titan_kedro.train.validation.mean_loss``, the function
the trainer validates with.

Used by the evaluation stage after training; runs in the Kedro process, without a
process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from titan_kedro.models.generate import generate
from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.runs.checkpoint_metadata import CheckpointMetadata
from titan_kedro.runs.resume import find_checkpoint, latest_checkpoint
from titan_kedro.storage import StoragePath, as_path
from titan_kedro.train.checkpoint.safe_load import load_model_weights
from titan_kedro.train.device import resolve_device
from titan_kedro.train.trainer import build_model

_PROMPT_SCAN_TOKENS = 4_000_000


def resolve_checkpoint(
    training_summary: dict[str, Any], checkpoint_folder: str | Path
) -> StoragePath:
    """The checkpoint a finished training left: its summary's, else the newest one.

    Raises:
        FileNotFoundError: Training wrote no checkpoint (``checkpoint.enable: false``?).
    """
    path = training_summary.get("checkpoint_dir")
    if path and as_path(path).is_dir():
        return as_path(path)
    try:
        found = latest_checkpoint(checkpoint_folder) or find_checkpoint(checkpoint_folder, "latest")
    except FileNotFoundError:
        found = None
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint to evaluate: the training summary names {path!r} and "
            f"'{checkpoint_folder}' holds no step-<n> folder; train with checkpoint.enable: true"
        )
    return found


class LoadedCheckpoint(NamedTuple):
    model: nn.Module
    """The model in float32, eval mode, with the checkpoint's weights."""
    resolved: ResolvedJob
    """The job config, train spec and model args it was built from."""
    path: StoragePath
    """The ``step-<n>`` folder (a ``UPath`` on object storage)."""
    step: int
    """The optimizer step the checkpoint was taken after."""


def load_checkpoint_model(
    resolved: ResolvedJob, checkpoint: str | Path, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Build the job's model in float32 on ``device`` and load a checkpoint's weights.

    Raises:
        FileNotFoundError: ``checkpoint`` is not a complete checkpoint folder.
        RuntimeError: Its weights do not fit the configured model (changed ``model.*``?).
    """
    metadata = CheckpointMetadata.read(checkpoint)  # fails early on an incomplete folder
    device = torch.device(device) if not isinstance(device, torch.device) else device
    model = build_model(resolved.spec, resolved.model_args, resolved.config.job.seed, device)
    load_model_weights(checkpoint, model)
    return LoadedCheckpoint(model.eval(), resolved, as_path(checkpoint), metadata.step)


def evaluation_device(resolved: ResolvedJob) -> torch.device:
    """The device training used (``training.device``), first GPU when CUDA."""
    return resolve_device(resolved.config.training.device, 0)


def document_prompts(
    tokens: np.ndarray, *, bos_id: int, eos_id: int, count: int, length: int
) -> list[list[int]]:
    """The first ``length`` tokens (BOS included) of the first ``count`` long-enough documents.

    Args:
        tokens: A packed stream ``BOS doc EOS BOS doc EOS …``.

    Raises:
        ValueError: Fewer than ``count`` documents have ``length`` tokens before their EOS.
    """
    window = np.asarray(tokens[:_PROMPT_SCAN_TOKENS])
    prompts: list[list[int]] = []
    for start in np.flatnonzero(window == bos_id):
        prompt = window[start : start + length]
        if len(prompt) == length and eos_id not in prompt[1:]:
            prompts.append([int(t) for t in prompt])
            if len(prompts) == count:
                return prompts
    raise ValueError(
        f"only {len(prompts)} validation documents have {length} tokens, {count} prompts "
        "were asked for; lower evaluation.num_prompts or evaluation.prompt_tokens"
    )


def sample_generations(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    decode: Callable[[Sequence[int]], str],
    max_new_tokens: int,
    top_k: int,
    temperature: float,
    seed: int,
    eos_id: int | None,
    vocab_limit: int | None,
    max_context: int | None,
) -> list[dict[str, Any]]:
    """Greedy and top-k sampled continuations of every prompt, decoded to text.

    Returns:
        One dict per prompt: ``prompt`` text and ids, and ``greedy`` / ``sampled``
        continuations (text and ids).
    """
    common = {
        "max_new_tokens": max_new_tokens,
        "eos_id": eos_id,
        "vocab_limit": vocab_limit,
        "max_context": max_context,
    }
    greedy = generate(model, prompts, **common)
    sampled = generate(model, prompts, top_k=top_k, temperature=temperature, seed=seed, **common)
    return [
        {
            "prompt": decode(prompt),
            "prompt_ids": list(prompt),
            "greedy": decode(g),
            "greedy_ids": g,
            "sampled": decode(s),
            "sampled_ids": s,
        }
        for prompt, g, s in zip(prompts, greedy, sampled, strict=True)
    ]
