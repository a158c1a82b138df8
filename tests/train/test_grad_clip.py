"""Clipping is value-free (no host read of the norm), with the numerics it always had."""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_kedro.train.grad_clip import clip_grad_norm_


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for values in grads:
        param = torch.nn.Parameter(torch.zeros(len(values)))
        param.grad = torch.tensor(values)
        params.append(param)
    return params


def test_clipping_scales_to_max_norm_and_leaves_small_or_non_finite_gradients() -> None:
    params = _params([3.0, 0.0], [0.0, 4.0])  # norm 5
    norm = clip_grad_norm_(params, 1.0)
    assert float(norm) == 5.0
    coef = 1.0 / (5.0 + 1e-6)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 0.0]) * torch.tensor(coef))
    small = _params([0.3, 0.4])
    clip_grad_norm_(small, 1.0)
    assert torch.equal(small[0].grad, torch.tensor([0.3, 0.4]))
    bad = _params([math.inf, 1.0], [math.nan, 2.0])
    assert not math.isfinite(float(clip_grad_norm_(bad, 1.0)))
    assert bad[0].grad[1] == 1.0 and bad[1].grad[1] == 2.0  # unchanged: the caller stops


def test_clipping_reads_no_value_so_it_runs_on_fake_tensors() -> None:
    with FakeTensorMode():  # a host read of the norm would raise here
        params = _params([3.0, 0.0], [0.0, 4.0])
        norm = clip_grad_norm_(params, 1.0)
        assert norm.shape == () and params[0].grad.shape == (2,)
