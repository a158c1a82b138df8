"""Warmup → stable → decay schedule against closed-form values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from train.conftest import make_config

from titan_kedro.components.lr_schedulers import build_lr_schedulers, schedule_phases
from titan_kedro.components.optimizers import build_optimizers
from titan_kedro.config import ConfigError

PEAK, MIN = 1.0e-3, 1.0e-4


def _lrs(steps: int, **scheduler: object) -> list[float]:
    """Learning rate used by optimizer steps 1..steps."""
    cfg = make_config(
        training={"steps": steps}, optimizer={"lr": PEAK}, lr_scheduler={"min_lr": MIN, **scheduler}
    )
    model = nn.Linear(2, 2)
    opt = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opt, cfg)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        assert all(g["lr"] == seen[-1] for g in opt.param_groups)
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize(
    ("decay_type", "shape"),
    [
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
    ],
)
def test_closed_form(decay_type: str, shape: object) -> None:
    steps, warmup, ratio = 20, 4, 0.5
    lrs = _lrs(steps, warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type)
    decay = 10
    stable = steps - warmup - decay
    for n, lr in enumerate(lrs, start=1):
        if n <= warmup:
            expected = PEAK * n / warmup
        elif n <= warmup + stable:
            expected = PEAK
        else:
            p = (n - warmup - stable) / decay
            expected = MIN + (PEAK - MIN) * shape(p)  # type: ignore[operator]
        assert lr == pytest.approx(expected, rel=1e-12), (n, lr, expected)
    assert lrs[warmup - 1] == pytest.approx(PEAK)
    assert lrs[-1] == pytest.approx(MIN)


def test_default_decays_over_everything_after_warmup() -> None:
    assert schedule_phases(10, 2, None) == (2, 0, 8)
    assert schedule_phases(10, 2, 0.9) == (2, 0, 8)  # capped by the steps left
    assert schedule_phases(10, 20, None) == (10, 0, 0)
    lrs = _lrs(10, warmup_steps=2, decay_type="linear")
    assert lrs[2] == pytest.approx(MIN + (PEAK - MIN) * (1 - 1 / 8))
    assert lrs[-1] == pytest.approx(MIN)


def test_no_warmup_starts_at_peak() -> None:
    assert _lrs(5, warmup_steps=0, decay_ratio=0.0)[0] == pytest.approx(PEAK)


def test_state_round_trip_resumes_the_schedule() -> None:
    cfg = make_config(training={"steps": 12}, lr_scheduler={"warmup_steps": 3})
    model = nn.Linear(2, 2)
    opt = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opt, cfg)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    expected = opt.param_groups[0]["lr"]

    opt2 = build_optimizers([nn.Linear(2, 2)], cfg)
    sched2 = build_lr_schedulers(opt2, cfg)
    sched2.load_state_dict(state)
    assert sched2.last_step == 5
    assert opt2.param_groups[0]["lr"] == pytest.approx(expected)
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_min_lr_above_peak_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"lr_scheduler\.min_lr=0\.001 is above optimizer\.lr"):
        make_config(optimizer={"lr": 1e-4}, lr_scheduler={"min_lr": 1e-3})
    # A config changed without validation (model_copy) is still refused by the builder.
    cfg = make_config(optimizer={"lr": 1e-4})
    cfg = cfg.model_copy(
        update={"lr_scheduler": cfg.lr_scheduler.model_copy(update={"min_lr": 1e-3})}
    )
    with pytest.raises(ValueError, match="min_lr"):
        build_lr_schedulers(build_optimizers([nn.Linear(2, 2)], cfg), cfg)


def test_lambda_is_checkpoint_friendly() -> None:
    cfg = make_config()
    sched = build_lr_schedulers(build_optimizers([nn.Linear(2, 2)], cfg), cfg)
    assert sched.state_dict() == {"last_step": 0}
    assert isinstance(sched.get_last_lr()[0], float)
    torch.save(sched.state_dict(), __import__("io").BytesIO())
