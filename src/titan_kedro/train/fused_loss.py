"""Output projection + cross-entropy in token chunks, never materialising the full logits.

For a 100K vocabulary the logits of one micro-batch (``tokens × vocab`` in float32) and
their gradient are hundreds of MB; allocating them each step costs more than the matmul
on CPU (page faults). ``linear_cross_entropy`` computes, chunk by chunk, the logits, the
loss and — when gradients are needed — the gradients of the hidden states and of the
projection weight right away (the same three matmuls autograd would run), keeping only
those gradients for backward. Chunk buffers are reused across chunks and steps.

The per-chunk softmax / gradient arithmetic is memory-bound: eager PyTorch makes about
eight passes over the ``chunk × vocab`` logits (cast, max, subtract, exp, sum, scale,
one-hot, cast back). With ``compile=True`` it runs as one ``torch.compile``d function
(inductor fuses it into a row reduction and one pointwise pass; bf16 logits are read
once and the bf16 gradient written once), about 5× faster on CPU.

``defer_output_projection(model)`` makes a model's ``output`` layer pass hidden states
through, so ``model(tokens)`` returns ``[b, s, dim]`` and the loss applies the
projection; ``FusedOutputLoss`` is that loss.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_kedro.components.loss import IGNORE_INDEX, build_cross_entropy_loss

_BUFFERS: dict[tuple[Any, ...], torch.Tensor] = {}


@contextmanager
def separate_chunk_buffers() -> Iterator[None]:
    """Give the code inside its own chunk buffers, and restore the process's afterwards.

    The plan's fake step allocates fake buffers; they must neither reuse the real ones
    (their sizes would hide the step's own allocation) nor outlive the step.
    """
    saved = dict(_BUFFERS)
    _BUFFERS.clear()
    try:
        yield
    finally:
        _BUFFERS.clear()
        _BUFFERS.update(saved)


def _chunk_exp(
    low: torch.Tensor, target: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``lse - target_logit``, ``E = exp(logits - row max)`` in ``low``'s dtype, and
    ``coef = scale / Σ E`` (the logits' gradient is then ``coef · E - scale · one-hot``)."""
    logits = low.float()
    row_max = logits.amax(1, keepdim=True)
    exp = (logits - row_max).exp()
    sum_exp = exp.sum(1)
    row_loss = row_max.squeeze(1) + sum_exp.log() - logits.gather(1, target[:, None]).squeeze(1)
    return row_loss, exp.to(low.dtype), scale / sum_exp


def _chunk_loss(low: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-row ``lse - target_logit`` (no gradient)."""
    logits = low.float()
    return torch.logsumexp(logits, 1) - logits.gather(1, target[:, None]).squeeze(1)


def _add_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """``total += part`` for a float32 ``total`` (compiled: one pass, no float32 copy of ``part``)."""
    total.add_(part)


_COMPILED: dict[str, Any] = {}
_FUNCTIONS = {"grad": _chunk_exp, "loss": _chunk_loss, "add": _add_into}


def _compiled(name: str) -> Any:
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_FUNCTIONS[name], dynamic=False)
    return _COMPILED[name]


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


def _accumulate_grads(  # noqa: PLR0917
    exp: torch.Tensor,
    coef: torch.Tensor,
    scale: torch.Tensor,
    target: torch.Tensor,
    hc: torch.Tensor,
    weight: torch.Tensor,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    start: int,
    compile: bool,
) -> None:
    """Write one chunk's hidden-state gradient and add its weight gradient (fp32).

    The logits' gradient ``G = coef · E - scale · one-hot(target)`` is never formed (that
    would be one more pass over ``chunk × vocab``): ``G @ W = coef · (E @ W) - scale ·
    W[target]`` and ``Gᵀ @ h = Eᵀ @ (coef · h) - scatter(target, scale · h)``.
    """
    coef, scale = coef[:, None], scale[:, None]
    if grad_h is not None:
        product = torch.mm(exp, weight)
        rows = product.shape[0]
        grad_h[start : start + rows] = product.float() * coef - weight[target].float() * scale
    if grad_w is None:
        return
    scaled_h = (hc.float() * coef).to(hc.dtype)
    if start == 0:  # the first chunk writes the buffer: no zero-filling pass
        if exp.dtype == torch.float32:
            torch.mm(exp.t(), scaled_h, out=grad_w)
        else:
            grad_w.copy_(exp.t() @ scaled_h)
    elif exp.dtype == torch.float32:
        grad_w.addmm_(exp.t(), scaled_h)
    else:  # bf16 product, accumulated in fp32
        (_compiled("add") if compile else _add_into)(grad_w, exp.t() @ scaled_h)
    grad_w.index_add_(0, target, hc.float() * -scale)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]  # noqa: PLR0917
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        compile: bool = False,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        dtype = dtype or weight.dtype
        h = hidden.to(dtype)
        weight = weight.to(dtype)  # under autocast one cast per step, as autocast's own
        n_tokens = h.shape[0]
        vocab = weight.shape[0]
        valid_all = labels != IGNORE_INDEX
        n_valid = valid_all.sum().clamp_min(1).to(torch.float32)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        grad_w = (
            torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        need_grad = grad_h is not None or grad_w is not None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # Equal chunks, so a compiled chunk function sees one shape (two at most).
        chunk_size = -(-n_tokens // -(-n_tokens // chunk_size)) if n_tokens else chunk_size
        for start in range(0, n_tokens, chunk_size):
            stop = min(start + chunk_size, n_tokens)
            rows = stop - start
            hc, yc, valid = h[start:stop], labels[start:stop], valid_all[start:stop]
            low = _buffer("logits_low", (rows, vocab), dtype, h.device)
            torch.mm(hc, weight.t(), out=low)
            target = yc.clamp_min(0)
            if compile:
                if not need_grad:
                    total += (_compiled("loss")(low, target) * valid).sum()
                    continue
                scale = valid.to(torch.float32) / n_valid
                row_loss, exp, coef = _compiled("grad")(low, target, scale)
                total += (row_loss * valid).sum()
                _accumulate_grads(
                    exp, coef, scale, target, hc, weight, grad_h, grad_w, start, compile
                )
                continue
            if dtype == torch.float32:
                logits = low
            else:
                logits = _buffer("logits", (rows, vocab), torch.float32, h.device)
                logits.copy_(low)
            target_logit = logits.gather(1, target[:, None]).squeeze(1)
            row_max = logits.amax(1)
            logits.sub_(row_max[:, None]).exp_()
            sum_exp = logits.sum(1)
            total += ((row_max + sum_exp.log() - target_logit) * valid).sum()
            if not need_grad:
                continue
            # The gradient is scaled by 1 / (valid tokens) and zero on ignored rows.
            scale = valid.to(torch.float32) / n_valid
            if dtype == torch.float32:
                exp = logits
            else:
                exp = low
                exp.copy_(logits)
            _accumulate_grads(
                exp, scale / sum_exp, scale, target, hc, weight, grad_h, grad_w, start, False
            )
        ctx.save_for_backward(
            grad_h if grad_h is not None else torch.empty(0),
            grad_w if grad_w is not None else torch.empty(0),
        )
        return total / n_valid

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Scaled in place: the gradients were made for this one backward (no retain_graph).
        # A plain loss.backward() on CPU sends 1: no pass over the vocab-sized weight
        # gradient then (elsewhere reading the value would wait for the device).
        grad_h, grad_w = ctx.saved_tensors
        unit = grad_out.device.type == "cpu" and float(grad_out) == 1.0
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = (grad_h if unit else grad_h.mul_(grad_out.to(grad_h.dtype))).to(ctx.hidden_dtype)
        if ctx.needs_input_grad[1]:
            gw = (grad_w if unit else grad_w.mul_(grad_out)).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: about 2**26 logits (256 MiB in float32), at least 16 tokens.

    Larger chunks make better matmuls (on a 2-core CPU 512 × 102,400 chunks beat 256 × by
    15-25 % per step); the chunk buffers are allocated once.
    """
    return max(16, (1 << 26) // max(1, vocab_size))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, chunked over tokens.

    Args:
        hidden: ``[..., dim]`` hidden states (cast to the compute dtype for the matmuls).
        weight: ``[vocab, dim]`` output projection (a plain tensor, e.g. FSDP's unsharded
            parameter during forward/backward). The matmuls run in its dtype, or in the
            autocast dtype when autocast is on (as ``F.linear`` would); its gradient is
            accumulated in float32 and returned in its own dtype.
        labels: ``[...]`` token ids; ``IGNORE_INDEX`` positions are skipped.
        chunk_size: Tokens per chunk (default: ``default_chunk_size(vocab)``); the tokens
            are split into equal chunks of at most this many.
        compile: Run the per-chunk softmax and gradient as one ``torch.compile``d function.

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
    device_type = weight.device.type
    dtype = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    )
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk, compile, dtype
        )


def _pass_through(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def can_defer_output_projection(model: nn.Module) -> bool:
    """True when ``model.output`` is a bias-free ``nn.Linear`` (the projection we can fuse)."""
    output = getattr(model, "output", None)
    return isinstance(output, nn.Linear) and output.bias is None


def uses_fused_loss(cfg: Any, spec: Any, model: nn.Module) -> bool:
    """Whether training fuses the output projection into the loss (trainer and planner alike).

    Only for the default token cross-entropy (a spec's own loss sees real logits), when
    ``training.fused_loss`` is on, the model's projection can be deferred, and without
    tensor parallelism: there the output weight is split over the vocabulary, and the
    loss-parallel cross-entropy (``models/tensor_parallel``) already keeps each rank to
    its own logits' share, so the trainer uses that.
    """
    return (
        cfg.training.fused_loss
        and spec.build_loss_fn is build_cross_entropy_loss
        and can_defer_output_projection(model)
        and cfg.layout.tp == 1
    )


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

    def __init__(self, output: nn.Linear, chunk_size: int | None = None, compile: bool = False):
        self.output = output
        self.chunk_size = chunk_size
        self.compile = compile

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden, self.output.weight, labels, self.chunk_size, compile=self.compile
        )
