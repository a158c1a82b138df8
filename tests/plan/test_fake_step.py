"""The plan measures the trainer's own step (not a copy), and the one place that touches
torch's private tracker attributes still finds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from train.helpers import tiny_job, write_token_dir

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan, planner
from titan_kedro.plan.trackers import reset_tracker_peak
from titan_kedro.train import step as step_module
from titan_kedro.train.step import TrainStep
from titan_kedro.train.trainer import Trainer

SEQ, BATCH = 64, 2


def _v3(mtp_depth: int) -> dict[str, Any]:
    return {
        "model": {
            "name": "deepseek_v3",
            "flavor": "debugmodel",
            "mtp_depth": mtp_depth,
            "overrides": {"vocab_size": 2048},
        },
        "metrics": {"peak_tflops": 1.0},
        "plan": {"device_memory_gib": 16.0},
        "training": {"seq_len": SEQ, "local_batch_size": BATCH, "device": "cpu"},
    }


def _measured_flops(raw: dict[str, Any]) -> float:
    planner._MEASURED.clear()  # measure again (a monkeypatched step has the same config)
    return build_plan(resolve_job_config(raw))["cost"]["measured_flops_per_rank_step"]


def test_the_plans_flops_include_the_mtp_heads_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MTP on, the measured step holds the MTP module's forward, backward and loss.

    The yardstick is independent of the step: DeepSeek-V3's FLOP formula (from the args)
    for the MTP module and head. The plan's old copied step scored only the main output
    (the MTP block still ran in the forward, nothing else); such a step measures less
    than half the MTP work, which this test shows fails the check.
    """
    monkeypatch.setattr(planner, "_MEASURED", {})
    off, on = _v3(0), _v3(1)
    formula = {}
    for depth, raw in ((0, off), (1, on)):
        resolved = resolve_job_config(raw)
        formula[depth] = resolved.spec.flops_per_token(resolved.model_args, SEQ) * SEQ * BATCH
    expected = formula[1] - formula[0]
    base = _measured_flops(off)
    assert base == pytest.approx(formula[0], rel=0.05)  # the yardstick fits the main model
    assert _measured_flops(on) - base == pytest.approx(expected, rel=0.10)

    monkeypatch.setattr(step_module, "mtp_loss", lambda *args, **kwargs: None)
    skipping = _measured_flops(on) - base  # a step that leaves out the MTP loss
    assert skipping < 0.6 * expected  # ... fails the check above


def test_the_plan_and_the_trainer_call_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy on ``TrainStep.__call__`` sees the plan's measurement and ``Trainer.train_step``."""
    calls: list[tuple[str, TrainStep]] = []
    original = TrainStep.__call__

    def spy(self: TrainStep) -> dict[str, Any]:
        fake = isinstance(next(self.model.parameters()), torch._subclasses.FakeTensor)
        calls.append(("plan" if fake else "trainer", self))
        return original(self)

    monkeypatch.setattr(TrainStep, "__call__", spy)
    monkeypatch.setattr(planner, "_MEASURED", {})
    build_plan(resolve_job_config(_v3(0)))
    assert [who for who, _ in calls] == ["plan"]
    plan_step = calls[0][1]
    assert (
        plan_step.config.layout.grad_accum_steps == 1
        and plan_step.reads.scalar(torch.ones(())) == 0
    )

    raw = tiny_job(tmp_path, write_token_dir(tmp_path / "tokens"), checkpoint={"enable": False})
    trainer = Trainer(resolve_job_config(raw, source="test"))
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert [who for who, _ in calls] == ["plan", "trainer"]
    assert calls[1][1] is trainer.step_fn and metrics["loss"] > 0


def test_a_measured_accumulating_step_runs_two_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accumulation 4: the step runs 2 micro-batches (the second holds the gradients),
    and the roofline stays per micro-batch, so the planner's × accumulation is right."""
    drawn: list[int] = []
    original = TrainStep.__call__

    def count(self: TrainStep) -> dict[str, Any]:
        source = self.next_batch
        self.next_batch = lambda: drawn.append(1) or source()  # type: ignore[method-assign]
        return original(self)

    monkeypatch.setattr(TrainStep, "__call__", count)
    monkeypatch.setattr(planner, "_MEASURED", {})
    one = build_plan(resolve_job_config(_v3(0)))
    assert len(drawn) == 1
    raw = _v3(0)
    raw["training"]["global_batch_size"] = 4 * BATCH
    four = build_plan(resolve_job_config(raw))
    assert len(drawn) == 3 and four["layout"]["grad_accum_steps"] == 4
    per_micro_batch = one["cost"]["measured_flops_per_rank_step"]
    assert four["cost"]["measured_flops_per_rank_step"] == pytest.approx(
        4 * per_micro_batch, rel=0.01
    )
    # The second micro-batch runs with the first one's gradients held.
    assert four["bytes_per_rank"]["total"] > one["bytes_per_rank"]["total"]


def test_resetting_the_trackers_peak_finds_torchs_private_attributes() -> None:
    """``reset_tracker_peak`` writes ``_peak_mem`` / ``_peak_mem_snap`` (no public API);
    the plan's peak-location mixin also reads ``_peak_mem``, ``_mod_tracker``, ``_in_opt``."""
    tracker = MemTracker()
    with tracker:
        for name in ("_peak_mem", "_peak_mem_snap", "_mod_tracker", "_in_opt"):
            assert hasattr(tracker, name), f"torch's MemTracker has no {name} any more"
        assert callable(getattr(type(tracker), "_update_peak_stats", None))
        big = torch.empty(1 << 20)  # 4 MiB
        del big
        kept = torch.empty(16)

        def peak() -> int:
            return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]

        before = peak()
        reset_tracker_peak(tracker)
        after = peak()
        assert before >= 4 << 20 > after >= kept.numel() * kept.element_size()
        assert tracker._peak_mem == {
            dev: snap["Total"] for dev, snap in tracker.get_tracker_snapshot().items()
        }
