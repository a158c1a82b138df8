"""Output projection + cross-entropy in token chunks, never materialising the full logits.

For a 100K vocabulary the logits of one micro-batch (``tokens × vocab`` in float32) and
their gradient are hundreds of MB; allocating them each step costs more than the matmul
on CPU (page faults). ``linear_cross_entropy`` computes, chunk by chunk, the logits, the
loss and — when gradients are needed — the gradients of the hidden states and of the
projection weight right away (the same three matmuls autograd would run), keeping only
those gradients for backward. Chunk buffers are reused across chunks and steps.

``defer_output_projection(model)`` makes a model's ``output`` layer pass hidden states
through, so ``model(tokens)`` returns ``[b, s, dim]`` and the loss applies the
projection; ``FusedOutputLoss`` is that loss.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_kedro.train.loss import IGNORE_INDEX

_BUFFERS: dict[tuple[Any, ...], torch.Tensor] = {}


def _buffer(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    key = (name, dtype, device)
    buf = _BUFFERS.get(key)
    numel = 1
    for size in shape:
        numel *= size
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[:numel].view(shape)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
    ) -> torch.Tensor:
        dtype = weight.dtype
        h = hidden.to(dtype)
        n_tokens = h.shape[0]
        vocab = weight.shape[0]
        valid_all = labels != IGNORE_INDEX
        n_valid = valid_all.sum().clamp_min(1).to(torch.float32)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        need_grad = grad_h is not None or grad_w is not None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n_tokens, chunk_size):
            stop = min(start + chunk_size, n_tokens)
            rows = stop - start
            hc, yc, valid = h[start:stop], labels[start:stop], valid_all[start:stop]
            low = _buffer("logits_low", (rows, vocab), dtype, h.device)
            torch.mm(hc, weight.t(), out=low)
            if dtype == torch.float32:
                logits = low
            else:
                logits = _buffer("logits", (rows, vocab), torch.float32, h.device)
                logits.copy_(low)
            target = yc.clamp_min(0)
            target_logit = logits.gather(1, target[:, None]).squeeze(1)
            row_max = logits.amax(1)
            logits.sub_(row_max[:, None]).exp_()
            sum_exp = logits.sum(1)
            lse = row_max + sum_exp.log()
            total += ((lse - target_logit) * valid).sum()
            if not need_grad:
                continue
            # softmax − one-hot, scaled by 1 / (valid tokens), zero on ignored rows
            scale = valid.to(torch.float32) / n_valid
            logits.mul_((scale / sum_exp)[:, None])
            logits.view(-1)[torch.arange(rows, device=h.device) * vocab + target] -= scale
            if dtype == torch.float32:
                grad = logits
            else:
                grad = low
                grad.copy_(logits)
            if grad_h is not None:
                torch.mm(grad, weight, out=grad_h[start:stop])
            if grad_w is not None:
                grad_w.add_(grad.t() @ hc)
        ctx.save_for_backward(
            grad_h if grad_h is not None else torch.empty(0),
            grad_w if grad_w is not None else torch.empty(0),
        )
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Scaled in place: the gradients were made for this one backward (no retain_graph).
        grad_h, grad_w = ctx.saved_tensors
        gh = (
            grad_h.mul_(grad_out.to(grad_h.dtype)).to(ctx.hidden_dtype)
            if ctx.needs_input_grad[0]
            else None
        )
        gw = grad_w.mul_(grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: about 2**25 logits (128 MiB in float32), at least 16 tokens."""
    return max(16, (1 << 25) // max(1, vocab_size))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, chunked over tokens.

    Args:
        hidden: ``[..., dim]`` hidden states (cast to ``weight``'s dtype for the matmuls).
        weight: ``[vocab, dim]`` output projection (a plain tensor, e.g. FSDP's unsharded
            parameter during forward/backward).
        labels: ``[...]`` token ids; ``IGNORE_INDEX`` positions are skipped.
        chunk_size: Tokens per chunk (default: ``default_chunk_size(vocab)``).

    Returns:
        A scalar float32 tensor, equal to ``F.cross_entropy`` on the full logits up to
        rounding; the softmax and log-sum-exp are computed in float32.
    """
    if isinstance(weight, DTensor):
        raise TypeError(
            "linear_cross_entropy needs the unsharded output weight; keep the FSDP root "
            "unsharded after forward (apply_fsdp does) or disable training.fused_loss"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree: expected "
            "hidden [batch, seq, dim] and labels [batch, seq]"
        )
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk
    )


def _pass_through(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def can_defer_output_projection(model: nn.Module) -> bool:
    """True when ``model.output`` is a bias-free ``nn.Linear`` (the projection we can fuse)."""
    output = getattr(model, "output", None)
    return isinstance(output, nn.Linear) and output.bias is None


def defer_output_projection(model: nn.Module) -> nn.Linear:
    """Make ``model.output`` return its input, so the loss can apply the projection.

    Parameter names, state dicts and checkpoints are unchanged; only this model instance's
    forward now ends with hidden states instead of logits.

    Returns:
        The output layer (its ``weight`` is what ``FusedOutputLoss`` multiplies by).
    """
    if not can_defer_output_projection(model):
        raise TypeError(f"{type(model).__name__}.output is not a bias-free nn.Linear")
    output = model.output
    output.forward = types.MethodType(_pass_through, output)  # type: ignore[method-assign]
    return output


class FusedOutputLoss:
    """``loss(hidden, labels)`` for a model whose output projection was deferred."""

    def __init__(self, output: nn.Linear, chunk_size: int | None = None):
        self.output = output
        self.chunk_size = chunk_size

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.output.weight, labels, self.chunk_size)
