"""Autoregressive sampling for any model of the registry: greedy, or top-k with a seed.

Models here have no key/value cache, so each new token re-runs the whole (truncated)
context. That is fine for the short sample generations of the evaluation stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    max_new_tokens: int,
    top_k: int | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    eos_id: int | None = None,
    max_context: int | None = None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """Continue equal-length prompts token by token.

    Args:
        model: ``model(tokens[b, s]) -> logits[b, s, vocab]``.
        prompts: ``[batch, prompt_len]`` token ids (all prompts the same length).
        max_new_tokens: Tokens to add per prompt (fewer when ``eos_id`` comes first).
        top_k: None (or 1) for greedy decoding; else sample among the ``top_k`` most
            likely tokens.
        temperature: Divides the logits before sampling (ignored by greedy decoding).
        seed: Seeds the sampler, so the same seed gives the same continuations.
        eos_id: Stop a prompt's continuation after this token (it is kept).
        max_context: Feed at most this many trailing tokens (the model's ``max_seq_len``).
        vocab_limit: Never produce ids ``>= vocab_limit`` (the tokenizer's size, when the
            embedding is padded beyond it).

    Returns:
        The new tokens of each prompt (without the prompt).

    Raises:
        ValueError: Empty or ragged prompts, or invalid sampling settings.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None or at least 1, got {top_k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    if isinstance(prompts, torch.Tensor):
        tokens = prompts.to(device=device, dtype=torch.long)
    else:
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError(f"prompts must share one length, got lengths {sorted(lengths)}")
        tokens = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(
            f"prompts must be a non-empty [batch, prompt_len] array, got {tuple(tokens.shape)}"
        )

    generator = None
    if top_k not in (None, 1):
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)

    was_training = model.training
    model.eval()
    try:
        batch = tokens.shape[0]
        new = torch.empty((batch, 0), dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            context = torch.cat([tokens, new], dim=1)
            if max_context is not None:
                context = context[:, -max_context:]
            logits = model(context)[:, -1, :].float()
            if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                logits[:, vocab_limit:] = float("-inf")
            if generator is None:
                next_token = logits.argmax(dim=-1)
            else:
                values, indices = torch.topk(logits / temperature, min(top_k, logits.shape[-1]))
                probs = torch.softmax(values, dim=-1)
                choice = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                next_token = indices.gather(-1, choice[:, None]).squeeze(-1)
            if eos_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
                finished |= next_token == eos_id
            new = torch.cat([new, next_token[:, None]], dim=1)
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)

    rows = new.tolist()
    if eos_id is None:
        return rows
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]
