"""Reading a layout search: the ranking, the printed table, the choice of
``parallelism.layout: auto``."""

from __future__ import annotations

from typing import Any

from titan_kedro.models.resolve import ResolvedJob
from titan_kedro.plan.planner import build_plan
from titan_kedro.plan.report import PlanDoesNotFitError

TIE = 0.01
"""Planned speeds within this share of each other are a tie, broken by the smaller peak (the
roofline is a lower bound; a 1 % difference in it says nothing)."""


class NoLayoutFitsError(PlanDoesNotFitError):
    """``parallelism.layout: auto`` found no layout of the world that fits its devices."""


def search_row(job: ResolvedJob) -> dict[str, Any]:
    """A layout's row: ``build_plan`` of ``job`` (resolved with that layout), read off."""
    plan = build_plan(job)
    layout = job.config.layout
    step_s = _step_time(plan)
    tokens = layout.global_batch_size * job.config.training.seq_len
    return {
        "peak_gib": plan["gib_per_rank"]["total"],
        "fits": plan["fits"],
        "headroom_gib": plan["headroom_gib"],
        "step_time_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "recompute": _recompute(plan),
        "method": (plan.get("pipeline") or {}).get("method")
        or ("fake step, extrapolated" if plan["extrapolated"] else "fake step"),
        "degrees": {
            "grad_accum_steps": layout.grad_accum_steps,
            "pp_microbatch_size": layout.pp_microbatch_size,
            "pp_stages_per_rank": layout.pp_stages_per_rank,
        },
    }


def _step_time(plan: dict[str, Any]) -> float:
    """The plan's roofline step time, with a predicted recomputation's forward added (an
    extrapolated ``auto`` plan predicts its checkpointed peak without re-measuring, so its
    roofline is the step without recomputation)."""
    seconds = plan["cost"]["roofline_step_time_s"]
    choice = plan.get("checkpoint_choice") or {}
    if "predicted" in str(choice.get("chosen_by", "")):
        seconds += choice["recompute_roofline_s"] * plan["layout"]["grad_accum_steps"]
    return seconds


def _recompute(plan: dict[str, Any]) -> str:
    """``none``, ``full``, ``selective``, or ``auto: k block(s)`` (those the plan recomputes)."""
    mode = plan["activation_checkpoint"]
    if mode != "auto":
        return mode
    blocks = len(plan["activation_checkpoint_blocks"])
    return f"auto: {blocks} block(s)" if blocks else "auto: none"


def rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fitting rows by planned tokens per second (ties: the smaller peak), then the rest by peak.

    Each returned row gets ``rank`` (1 = best); the input rows are not changed.
    """
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: -r["tokens_per_s"])
    ranked: list[dict[str, Any]] = []
    while fitting:
        fastest = fitting[0]["tokens_per_s"]
        tied = [r for r in fitting if r["tokens_per_s"] >= fastest * (1 - TIE)]
        fitting = fitting[len(tied) :]
        ranked += sorted(tied, key=lambda r: r["peak_gib"])
    ranked += sorted((r for r in rows if not r["fits"]), key=lambda r: r["peak_gib"])
    return [{**row, "rank": i + 1} for i, row in enumerate(ranked)]


def choose_layout(search: dict[str, Any], *, enforce: bool = True) -> dict[str, Any]:
    """Mark and return the best fitting row (``chosen: true``); see ``NoLayoutFitsError``.

    Args:
        search: ``search.search_layouts``'s result (its ``rows`` ranked).
        enforce: ``plan.enforce``; without it, the smallest peak is chosen when none fits.

    Raises:
        NoLayoutFitsError: Nothing fits (with ``enforce``): names the smallest planned peak,
            its layout and what would help.
    """
    rows = search["rows"]
    if not rows:
        raise NoLayoutFitsError(
            f"parallelism.layout: auto: no layout of {search['world_size']} ranks passed the "
            f"job's checks ({search['refused']} refused, e.g. "
            f"{'; '.join(search['refused_examples'][:2]) or 'none'}; "
            f"{search['pruned_states']} hold more parameter and optimizer state than the "
            "device); set the parallelism degrees yourself or change launch.nnodes / "
            "launch.nproc_per_node"
        )
    best = rows[0]
    if not best["fits"] and enforce:
        smallest = min(rows, key=lambda r: r["peak_gib"])
        budget = search["device"]["memory_gib"] - search["reserved_gib"]
        raise NoLayoutFitsError(
            f"parallelism.layout: auto: none of the {len(rows)} measured layouts of "
            f"{search['world_size']} ranks fits {search['device']['name']} "
            f"({budget:.1f} GiB per rank after plan.reserved_gib); the smallest planned peak "
            f"is {smallest['peak_gib']:.1f} GiB ({smallest['layout']}, recompute "
            f"{smallest['recompute']}). What would help: training.activation_checkpoint: "
            "auto (or full), a smaller training.local_batch_size or training.seq_len, more "
            "ranks (launch.nnodes), or a device with more memory (plan.gpu); plan.enforce: "
            "false launches the smallest anyway\n" + format_search(search)
        )
    for row in rows:
        row["chosen"] = row is best
    return best


def format_search(search: dict[str, Any]) -> str:
    """The search as a readable table (``*`` marks the chosen row)."""
    device = search["device"]
    lines = [
        f"plan.search: {search['world_size']} ranks of {device['name']} "
        f"({device['memory_gib']:.0f} GiB, {search['reserved_gib']:.0f} reserved): "
        f"{search['enumerated']} layouts enumerated, {search['pruned_replicated']} "
        f"replicated ones pruned (same time, more state), {search['pruned_states']} whose "
        f"states alone exceed the device, {search['refused']} refused by the job's checks, "
        f"{search['measured']} measured of the {search['layout_valid']} the layout rules "
        "allow, in "
        f"{search.get('searched_in_s', 0.0):.0f} s (stopped: {search['stopped']})"
        + (
            f" ({len(search['failed'])} fake step(s) failed: see failed)"
            if search["failed"]
            else ""
        ),
        f"  {'rank':<5} {'layout':<58} {'peak GiB':>9} {'fits':>5} {'step s':>9} "
        f"{'tokens/s':>11}  recompute",
    ]
    for row in search["rows"]:
        mark = "*" if row.get("chosen") else " "
        lines.append(
            f"  {mark}{row['rank']:<4} {row['layout']:<58} {row['peak_gib']:>9.3g} "
            f"{'yes' if row['fits'] else 'no':>5} {row['step_time_s']:>9.3g} "
            f"{row['tokens_per_s']:>11,.0f}  {row['recompute']}"
        )
    return "\n".join(lines)
