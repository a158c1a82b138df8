"""``plan.search``: the enumeration, the ranking and the choice of ``parallelism.layout: auto``,
and the plan of a pipelined layout (heaviest rank, in-flight microbatches, bubble)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from train.helpers import TINY_DEEPSEEK

from titan_kedro.config.layout import Layout
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan, search
from titan_kedro.plan.pipeline_plan import bubble_share, pipelined_plan
from titan_kedro.plan.search import _stop_reason, enumerate_layouts, resolve_layout
from titan_kedro.plan.search_table import NoLayoutFitsError, choose_layout, rank_rows


def _row(name: str, tokens_per_s: float, peak_gib: float, fits: bool) -> dict[str, Any]:
    return {
        "layout": name,
        "tokens_per_s": tokens_per_s,
        "step_time_s": 1000 / tokens_per_s,
        "peak_gib": peak_gib,
        "fits": fits,
        "recompute": "none",
    }


def _search(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "world_size": 8,
        "device": {"name": "H200", "memory_gib": 100.0},
        "reserved_gib": 2.0,
        "enumerated": 9,
        "pruned_replicated": 0,
        "pruned_states": 0,
        "refused": 0,
        "refused_examples": [],
        "layout_valid": len(rows),
        "measured": len(rows),
        "failed": [],
        "stopped": "every valid layout measured",
        "rows": rank_rows(rows),
    }


def test_the_fastest_fitting_layout_is_chosen_and_a_tie_goes_to_the_smaller_peak() -> None:
    rows = [
        _row("fast, big", 1000.0, 90.0, True),
        _row("as fast (0.5 % slower), smaller", 995.0, 60.0, True),
        _row("slow, tiny", 800.0, 10.0, True),
        _row("fastest, too big", 2000.0, 120.0, False),
        _row("too big, smaller", 500.0, 110.0, False),
    ]
    search = _search(rows)
    # Within 1 % the speeds tie and the 60 GiB layout wins; the 800 tokens/s one is 20 %
    # slower, so its 10 GiB do not lift it; layouts that do not fit come last, by peak.
    assert [r["layout"] for r in search["rows"]] == [
        "as fast (0.5 % slower), smaller",
        "fast, big",
        "slow, tiny",
        "too big, smaller",
        "fastest, too big",
    ]
    chosen = choose_layout(search)
    assert chosen["layout"] == "as fast (0.5 % slower), smaller" and chosen["chosen"]
    following = search["rows"][1]
    assert following["fits"] and chosen["peak_gib"] <= following["peak_gib"]
    assert [r["rank"] for r in search["rows"]] == [1, 2, 3, 4, 5]
    assert sum(bool(r.get("chosen")) for r in search["rows"]) == 1


def test_no_fitting_layout_fails_naming_the_smallest_peak_and_what_would_help() -> None:
    search = _search([_row("A", 900.0, 150.0, False), _row("B", 1000.0, 130.5, False)])
    with pytest.raises(NoLayoutFitsError) as err:
        choose_layout(search)
    message = str(err.value)
    assert "smallest planned peak is 130.5 GiB (B" in message
    assert "98.0 GiB per rank" in message  # 100 GiB of H200 here, 2 reserved
    assert "activation_checkpoint" in message and "launch.nnodes" in message
    # Without plan.enforce the smallest peak is launched.
    assert choose_layout(search, enforce=False)["layout"] == "B"


def test_every_factorisation_of_the_world_is_enumerated_with_both_schedules() -> None:
    cfg = SimpleNamespace(
        parallelism=SimpleNamespace(pipeline_schedule="1F1B"),
        launch=SimpleNamespace(nproc_per_node=8),
    )
    layouts = enumerate_layouts(cfg, 8, expert_parallel=False)
    # 8 = 2³ into (tp, pp, replicate, shard): C(3 + 3, 3) = 20 ordered factorisations, of
    # which C(3 + 2, 2) = 10 have pp = 1; the other 10 come once per schedule (2).
    assert len(layouts) == 10 + 10 * 2
    assert all(c.pp * c.dp_replicate * c.dp_shard * c.tp == 8 for c in layouts)
    # One node of 2 ranks: TP never spans nodes, so TP ∈ {1, 2}.
    cfg.launch.nproc_per_node = 2
    assert {c.tp for c in enumerate_layouts(cfg, 8, expert_parallel=False)} == {1, 2}
    # Expert parallelism: every divisor of dp_shard × tp (here world 2, pp 1, tp 1: 1, 2).
    moe = [c for c in enumerate_layouts(cfg, 2, expert_parallel=True) if c.pp == c.tp == 1]
    assert sorted((c.dp_shard, c.ep) for c in moe if c.dp_replicate == 1) == [(2, 1), (2, 2)]


def test_the_bubble_is_the_idle_share_of_the_schedule() -> None:
    one = Layout.build(world_size=8, pp=4, local_batch_size=8, pp_microbatch_size=1)
    assert bubble_share(one) == pytest.approx(3 / 8)  # (pp − 1) / microbatches
    inter = Layout.build(
        world_size=8, pp=4, local_batch_size=8, pp_microbatch_size=1, pp_schedule="Interleaved1F1B"
    )
    assert bubble_share(inter) == pytest.approx(3 / 16)  # two stages per rank halve it
    assert bubble_share(Layout.build(world_size=8)) == 0.0


def test_a_pipelined_plan_is_its_heaviest_rank_plus_in_flight_microbatches_and_bubble() -> None:
    raw = {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": TINY_DEEPSEEK},
        "training": {"seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "parallelism": {"pipeline_parallel_degree": 2, "pipeline_microbatch_size": 1},
        "launch": {"nproc_per_node": 4},
        "validation": {"freq": 0},
    }
    job = resolve_job_config(raw)
    seen = []
    gib = 2**30

    def measure(stage: Any) -> dict[str, Any]:
        seen.append(stage)
        return {
            "bytes_per_rank": {"total": 50 * gib, "activations": 10 * gib},
            "device_memory_gib": 80.0,
            "reserved_gib": 2.0,
            "peak_at": {"phase": "backward"},
            "cost": {"roofline_step_time_s": 2.0},
            "layout": {},
            "compute_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "figures": {},
        }

    plan = pipelined_plan(job, measure)
    stage = seen[0]
    # 3 blocks over 2 ranks: the heavier holds 2, the model's last two (both MoE, the
    # one dense block is the first); 2 of the 4 ranks shard one stage; its batch is a
    # microbatch of 1 sample, 2 of them per step.
    assert stage.model_args.n_layers == 2
    assert job.model_args.first_k_dense_replace == 1
    assert stage.model_args.first_k_dense_replace == 0
    assert stage.config.launch.world_size == 2 and stage.config.layout.pp == 1
    assert stage.config.training.local_batch_size == 1 and stage.config.layout.grad_accum_steps == 2
    # The stage holds all its parameters' gradients unsharded in float32 through the step
    # (the schedule's gradient sync is off but for the last microbatch), and keeps every
    # block's gathered bf16 parameters from forward to backward (reshard_after_forward
    # never under PP): 4 + 2 bytes per parameter of the stage (no TP, no EP here).
    with torch.device("meta"):
        n_stage = sum(p.numel() for p in job.spec.build_model(stage.model_args).parameters())
    held = plan["pipeline"]["held_bytes"]
    assert held == {"unsharded_grads": 4 * n_stage, "gathered_params": 2 * n_stage}
    # 1F1B's first rank holds min(pp 2, 2 microbatches) = 2 microbatches' activations.
    assert plan["bytes_per_rank"]["total"] == 60 * gib + 6 * n_stage
    assert plan["fits"] and plan["headroom_gib"] == pytest.approx(80 - 2 - 60, abs=0.01)
    # Bubble (2 − 1) / 2 microbatches: 2 s × 1.5.
    assert plan["cost"]["roofline_step_time_s"] == pytest.approx(3.0)
    assert plan["layout"]["pp"] == 2 and plan["world_size"] == 4


def test_measuring_stops_at_enough_fitting_the_cap_or_the_budget_once_one_fits() -> None:
    fits, big = _row("a", 1.0, 1.0, True), _row("b", 1.0, 200.0, False)
    # 3 layouts fitting are enough; 4 fake steps (failed ones count) are the cap.
    assert _stop_reason([fits] * 3, 0, 0.0) == "3 layouts fit"
    assert _stop_reason([big] * 3, 1, 0.0) == "4 fake steps run"
    # Past the time budget the search stops only if something already fits.
    late = search.MEASURE_BUDGET_S + 1
    assert _stop_reason([big, big], 0, late) is None
    assert "fits and another fake step would pass" in str(_stop_reason([big, fits], 0, late))
    assert _stop_reason([big, fits], 0, search.MEASURE_BUDGET_S - 1) is None


def _pipelined_tiny(**sections: dict[str, Any]) -> dict[str, Any]:
    """``TINY_DEEPSEEK`` on 4 ranks as PP 2 with one-sample microbatches, plus ``sections``."""
    return {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": TINY_DEEPSEEK},
        "training": {"seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "parallelism": {"pipeline_parallel_degree": 2, "pipeline_microbatch_size": 1},
        "launch": {"nproc_per_node": 4},
        "validation": {"freq": 0},
        **sections,
    }


def test_auto_recompute_of_a_pipelined_stage_is_chosen_again_for_the_held_microbatches() -> None:
    raw = _pipelined_tiny(plan={"device_memory_gib": 80.0})
    raw["training"]["activation_checkpoint"] = "auto"
    gib, budgets = 2**30, []

    def measure(stage: Any) -> dict[str, Any]:
        budgets.append(stage.config.plan.device_memory_gib)
        activations = (30 if len(budgets) == 1 else 15) * gib
        return {
            "bytes_per_rank": {"total": 40 * gib + activations, "activations": activations},
            "device_memory_gib": stage.config.plan.device_memory_gib,
            "reserved_gib": 2.0,
            "peak_at": {"phase": "backward"},
            "cost": {"roofline_step_time_s": 2.0},
            "layout": {},
            "extrapolated": {"measured_blocks": 2},
            "compute_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "figures": {},
        }

    plan = pipelined_plan(resolve_job_config(raw), measure)
    # One microbatch fits (40 + 30 ≤ 78 GiB) but 2 held do not (40 + 60). Recompute must
    # leave each ≤ (78 − 40) / 2 = 19 GiB: the stage is planned again for 40 + 19 GiB of
    # budget, 61 GiB with the 2 reserved. Its 15 GiB per microbatch then fit: 40 + 30.
    assert budgets == [80.0, pytest.approx(61.0)]
    assert plan["bytes_per_rank"]["total"] == 70 * gib + sum(
        plan["pipeline"]["held_bytes"].values()
    )
    assert plan["device_memory_gib"] == 80.0 and plan["fits"]


def test_the_training_node_searches_only_for_layout_auto_not_for_the_table() -> None:
    raw = {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": TINY_DEEPSEEK},
        "training": {"seq_len": 32, "device": "cpu"},
        "plan": {"search": True},
    }
    job = resolve_job_config(raw)
    same, table = resolve_layout(job, table=False)  # plan.search alone: nothing to apply
    assert table is None and same is job


def test_build_plan_of_a_pipelined_job_measures_its_heaviest_rank() -> None:
    raw = _pipelined_tiny(metrics={"peak_tflops": 1.0}, plan={"device_memory_gib": 4.0})
    plan = build_plan(resolve_job_config(raw))
    # 4 ranks, 2 per stage; the heavier of the 2 pipeline ranks holds 2 of the 3 blocks.
    assert plan["world_size"] == 4 and plan["layout"]["pp"] == 2
    assert plan["layout"]["dp_shard"] == 2 and plan["pipeline"]["rank_blocks"] == 2
    assert plan["pipeline"]["bubble"] == pytest.approx(1 / 2)  # (2 − 1) / 2 microbatches
