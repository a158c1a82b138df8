"""Chunked output projection + cross-entropy against the plain computation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_kedro.components.loss import IGNORE_INDEX
from titan_kedro.models.registry import get_train_spec
from titan_kedro.train.fused_loss import (
    FusedOutputLoss,
    defer_output_projection,
    linear_cross_entropy,
    uses_fused_loss,
)
from train.conftest import make_config


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden.to(weight.dtype) @ weight.t()).float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_loss_and_gradients_match_float32(chunk: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 3] = IGNORE_INDEX
    ref = _reference(hidden, weight, labels)
    ref_gh, ref_gw = torch.autograd.grad(ref * 3, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    gh, gw = torch.autograd.grad(out * 3, (hidden, weight))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)
    assert gh[0, 3].abs().max() == 0  # ignored position


def test_bfloat16_weight_matches_the_autocast_style_reference() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 40, 32, requires_grad=True)
    weight = torch.randn(300, 32, dtype=torch.bfloat16).mul(0.2).requires_grad_()
    labels = torch.randint(0, 300, (3, 40))
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    ref = _reference(hidden, weight, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    gh, gw = torch.autograd.grad(out, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    assert gh.dtype == torch.float32 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 24, 32, requires_grad=True)
    weight = torch.randn(300, 32, dtype=dtype).mul(0.2).requires_grad_()
    labels = torch.randint(0, 300, (2, 24))
    labels[1, 5] = IGNORE_INDEX
    eager = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    compiled = linear_cross_entropy(hidden, weight, labels, chunk_size=16, compile=True)
    grads_eager = torch.autograd.grad(eager, (hidden, weight))
    grads_compiled = torch.autograd.grad(compiled, (hidden, weight))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(compiled, eager, **tol)
    for got, want in zip(grads_compiled, grads_eager):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), **tol)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, labels, chunk_size=16, compile=True), eager, **tol
        )


def test_no_grad_gives_the_loss_only() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    labels = torch.randint(0, 10, (4,))
    with torch.no_grad():
        out = linear_cross_entropy(hidden, weight, labels)
    torch.testing.assert_close(out, _reference(hidden, weight, labels))


def test_deferred_model_output_gives_the_same_loss_and_names() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.norm = torch.nn.LayerNorm(8)
    model.output = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(2, 5, 8)
    labels = torch.randint(0, 30, (2, 5))
    expected = F.cross_entropy(model.output(model.norm(hidden)).flatten(0, 1), labels.flatten())
    keys = model.state_dict().keys()
    loss_fn = FusedOutputLoss(defer_output_projection(model))
    deferred = model.output(model.norm(hidden))
    assert deferred.shape == (2, 5, 8)
    torch.testing.assert_close(loss_fn(deferred, labels), expected)
    assert model.state_dict().keys() == keys
    with pytest.raises(ValueError, match="disagree"):
        loss_fn(deferred, labels[:, :3])


def test_only_the_default_loss_on_a_bias_free_projection_is_fused() -> None:
    spec = get_train_spec("llama3")
    own_loss = dataclasses.replace(spec, build_loss_fn=lambda cfg: F.cross_entropy)
    model = torch.nn.Module()
    model.output = torch.nn.Linear(8, 32, bias=False)
    with_bias = torch.nn.Module()
    with_bias.output = torch.nn.Linear(8, 32, bias=True)
    on, off = make_config(), make_config(training={"fused_loss": False})
    assert uses_fused_loss(on, spec, model)
    assert not uses_fused_loss(off, spec, model)
    assert not uses_fused_loss(on, own_loss, model)  # a spec's own loss sees real logits
    assert not uses_fused_loss(on, spec, with_bias)


def test_autocast_runs_the_matmuls_in_bfloat16_and_keeps_float32_gradients() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 40, 32, requires_grad=True)
    weight = torch.randn(300, 32).mul(0.2).requires_grad_()
    labels = torch.randint(0, 300, (3, 40))
    full = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    ref = _reference(hidden.bfloat16(), weight.bfloat16(), labels)  # what F.linear would do
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert out != full  # the matmuls really ran in bfloat16
    gh, gw = torch.autograd.grad(out, (hidden, weight))
    rh, rw = torch.autograd.grad(full, (hidden, weight))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=1e-3)
