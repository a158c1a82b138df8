"""``plan.search``: which layouts of a world of ranks fit the job, ranked by planned speed.

1. **Enumerate** every ``pp × dp_replicate × dp_shard × tp = world`` with ``tp`` dividing
   ``launch.nproc_per_node`` (a TP group stays on one node), ``ep`` any divisor of
   ``dp_shard × tp`` for a spec with expert parallelism, and for ``pp > 1`` both
   schedules (``PP_SCHEDULES``) with the job's microbatch size.
2. **Prune cheaply**: a replicated layout (``dp_replicate > 1``) plans the same roofline
   time as the one with ``dp_replicate = 1`` and holds ``dp_replicate`` × its states, so
   it never ranks above it (kept only when it is the job's own setting); a layout whose
   parameters, gradients and AdamW state alone (counted on the meta model) exceed the
   device is dropped.
3. **Validate** with the job's own rules, never restated: every layout through
   ``JobConfig.layout`` (``config/layout.py``: divisibility, EP within ``dp_shard × tp``,
   the schedule's microbatches); the full resolution (``resolve_job_config``: the spec's
   EP and TP checks, the pipeline's blocks) for each layout about to be measured.
4. **Measure** the promising ones with ``build_plan`` (``search_table.search_row``; a
   pipelined layout through ``pipeline_plan``): the smallest pipeline bubble first, then
   the smallest TP (its per-block communication is not in the roofline), the largest EP
   (the smallest gathered experts); first the best of each ``(pp, schedule, tp)``, then
   the rest in the same order; at most ``MAX_MEASURED`` fake steps, until
   ``ENOUGH_FITTING`` fit or, once one fits, ``MEASURE_BUDGET_S`` CPU seconds would pass.
5. **Rank** (``search_table.rank_rows``) the fitting rows by planned tokens per second
   (step time for the same global batch), nearly equal speeds by the smaller peak.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from titan_kedro.config.layout import PP_SCHEDULES
from titan_kedro.config.load import ConfigError
from titan_kedro.models.counting import count_parameters
from titan_kedro.models.parallel import training_dtypes
from titan_kedro.models.resolve import ResolvedJob, resolve_job_config
from titan_kedro.plan.devices import GIB, planned_device, planned_kind
from titan_kedro.plan.memory import ADAMW_STATES
from titan_kedro.plan.pipeline_plan import bubble_share
from titan_kedro.plan.search_table import (
    choose_layout,
    format_search,
    rank_rows,
    search_row,
)

logger = logging.getLogger(__name__)

MAX_MEASURED = 4
"""Fake-step measurements one search runs at most (each costs seconds to tens of seconds)."""
ENOUGH_FITTING = 3
"""A search stops measuring once this many layouts fit."""
MEASURE_BUDGET_S = 60.0
"""Once a layout fits, a search starts no fake step expected to end after this many CPU
seconds of measuring (a 671B fake step takes 10–30; CPU time, so that other work on the
machine does not change which layouts are measured)."""

_SEARCHED: dict[str, dict[str, Any]] = {}
"""Searches run in this process: a ``kedro run`` searches in the model-spec node and again
in the training node, which reuses the first result."""


@dataclass(frozen=True)
class Candidate:
    """One layout of the world: the degrees ``parallelism.*`` will be set to."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    schedule: str

    def label(self) -> str:
        """``PP 2 (1F1B) × rep 1 × shard 32 × TP 2, EP 8``-style name of the layout."""
        pipeline = f"PP {self.pp} ({self.schedule}) × " if self.pp > 1 else ""
        return (
            f"{pipeline}rep {self.dp_replicate} × shard {self.dp_shard} × TP {self.tp}, "
            f"EP {self.ep}"
        )

    def parallelism(self, section: dict[str, Any]) -> dict[str, Any]:
        """The ``parallelism`` section ``section`` with this layout's degrees."""
        changed = {
            "pipeline_parallel_degree": self.pp,
            "data_parallel_replicate_degree": self.dp_replicate,
            "data_parallel_shard_degree": self.dp_shard,
            "tensor_parallel_degree": self.tp,
            "expert_parallel_degree": self.ep,
            "pipeline_schedule": self.schedule,
        }
        out = {**section, **changed}
        if self.pp != section.get("pipeline_parallel_degree"):
            out["pipeline_layout"] = None  # the balanced split of the new degree
        if self.schedule != section.get("pipeline_schedule"):
            out["pipeline_stages_per_rank"] = None
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: Any, world: int, expert_parallel: bool) -> list[Candidate]:
    """Every arithmetic layout of ``world`` ranks (unvalidated; see the module doc)."""
    own = cfg.parallelism
    per_node = cfg.launch.nproc_per_node
    candidates = []
    for tp in (d for d in _divisors(world) if per_node % d == 0):
        for pp in _divisors(world // tp):
            schedules = PP_SCHEDULES if pp > 1 else (own.pipeline_schedule,)
            for dp_replicate in _divisors(world // (tp * pp)):
                dp_shard = world // (tp * pp * dp_replicate)
                for ep in _divisors(dp_shard * tp) if expert_parallel else [1]:
                    candidates += [
                        Candidate(pp, dp_replicate, dp_shard, tp, ep, schedule)
                        for schedule in schedules
                    ]
    return candidates


def _state_bytes_per_param(model: torch.nn.Module) -> int:
    """Parameter, gradient and AdamW bytes of one parameter (``memory.measure_sharded``)."""
    size = next(model.parameters()).element_size()
    return size * (2 + ADAMW_STATES)


def _analytic(resolved: ResolvedJob) -> tuple[int, int]:
    """(total parameters, state bytes per parameter) of the meta model."""
    with torch.device("meta"):
        model = resolved.spec.build_model(resolved.model_args)
    return count_parameters(model).total, _state_bytes_per_param(model)


def resolve_layout(
    resolved: ResolvedJob, *, table: bool = True
) -> tuple[ResolvedJob, dict[str, Any] | None]:
    """Search when ``plan.search`` or ``parallelism.layout: auto`` asks; apply ``auto``'s pick.

    Args:
        resolved: The resolved job.
        table: Honour ``plan.search`` (the model-spec node); False searches only for
            ``auto`` (the training node, which needs the layout, not the table).

    Returns:
        ``(resolved, None)`` when neither asks; else the job (with the chosen layout's
        degrees under ``auto``) and the search (``search_layouts``; under ``auto`` the
        chosen row has ``chosen: true``), whose table is logged.

    Raises:
        NoLayoutFitsError: ``auto`` and no layout fits (with ``plan.enforce``).
    """
    cfg = resolved.config
    auto = cfg.parallelism.layout == "auto"
    if not ((cfg.plan.search and table) or auto):
        return resolved, None
    search = copy.deepcopy(search_layouts(resolved))
    if auto:
        row = choose_layout(search, enforce=cfg.plan.enforce)
        resolved = apply_layout(resolved, row)
        fitting = sum(r["fits"] for r in search["rows"])
        logger.info(
            "parallelism.layout: auto chose %s: %s of the %d fitting measured layouts "
            "(%.0f tokens/s planned, step %.3g s, peak %.1f GiB per rank, recompute %s)",
            row["layout"],
            "the fastest (ties within 1 %: the smaller peak)"
            if row["fits"]
            else "none fits; the smallest peak (plan.enforce: false)",
            fitting,
            row["tokens_per_s"],
            row["step_time_s"],
            row["peak_gib"],
            row["recompute"],
        )
    logger.info("%s", format_search(search))
    return resolved, search


def apply_layout(resolved: ResolvedJob, row: dict[str, Any]) -> ResolvedJob:
    """``resolved`` with the layout of a search row (validated by the job's own checks)."""
    fields = {f.name for f in dataclasses.fields(Candidate)}
    chosen = Candidate(**{k: v for k, v in row["degrees"].items() if k in fields})
    checked = _validated(resolved, chosen)
    if isinstance(checked, str):
        raise ValueError(f"the searched layout {chosen.label()} is refused: {checked}")
    return checked


def _validated(resolved: ResolvedJob, c: Candidate) -> ResolvedJob | str:
    """The job resolved with layout ``c``, or why the job's own checks refuse it."""
    raw = resolved.config.model_dump(mode="json")
    raw["parallelism"] = c.parallelism(raw["parallelism"])
    try:
        return resolve_job_config(raw)
    except (ConfigError, ValueError) as err:
        return str(err)


def search_layouts(resolved: ResolvedJob, world: int | None = None) -> dict[str, Any]:
    """Search the layouts of ``world`` ranks (default: the launch's) for ``resolved``'s job.

    Returns:
        A JSON-safe dict: ``world_size, device, enumerated, pruned_replicated,
        pruned_states, refused`` (counts, with ``refused_examples``), ``measured`` (fake
        steps run), ``rows`` (ranked: fitting rows first, see ``search_table``),
        ``searched_in_s``.
    """
    cfg = resolved.config
    world = world or cfg.launch.world_size
    key = f"{world}|{resolved.config.model_dump_json()}|{resolved.spec.name}"
    key += f"|{resolved.model_args!r}|{MAX_MEASURED}|{ENOUGH_FITTING}|{MEASURE_BUDGET_S}"
    if key in _SEARCHED:
        return _SEARCHED[key]
    start = time.perf_counter()
    result = _search(resolved, world)
    result["searched_in_s"] = time.perf_counter() - start
    _SEARCHED[key] = result
    return result


def _search(resolved: ResolvedJob, world: int) -> dict[str, Any]:
    cfg = resolved.config
    if world != cfg.launch.world_size:
        raw = cfg.model_dump(mode="json")
        per_node = cfg.launch.nproc_per_node if world % cfg.launch.nproc_per_node == 0 else world
        raw["launch"] = {**raw["launch"], "nproc_per_node": per_node, "nnodes": world // per_node}
        resolved = resolve_job_config(raw)
        cfg = resolved.config
    own = cfg.layout
    total, per_param = _analytic(resolved)
    compute, _ = training_dtypes(cfg, torch.device(planned_kind(cfg)))
    device = planned_device(cfg, compute)
    budget = (device.memory_gib - cfg.plan.reserved_gib) * GIB
    enumerated = enumerate_layouts(cfg, world, bool(resolved.spec.expert_parallel))
    kept, replicated, too_big = [], 0, 0
    for c in enumerated:
        if c.dp_replicate > 1 and c.dp_replicate != own.dp_replicate:
            replicated += 1
            continue
        if total * per_param * c.dp_replicate / world > budget:
            too_big += 1
            continue
        kept.append(c)
    shaped: list[tuple[Candidate, Any]] = []
    refused: list[str] = []
    for c in kept:
        shape = _layout_of(cfg, c)
        if isinstance(shape, str):
            refused.append(f"{c.label()}: {shape}")
        else:
            shaped.append((c, shape))
    failed: list[str] = []
    stopped: list[str] = []
    rows = _measure_promising(resolved, shaped, refused, failed, stopped)
    return {
        "world_size": world,
        "device": {"name": device.name, "memory_gib": device.memory_gib},
        "reserved_gib": cfg.plan.reserved_gib,
        "enumerated": len(enumerated),
        "pruned_replicated": replicated,
        "pruned_states": too_big,
        "refused": len(refused),
        "refused_examples": refused[:5],
        "layout_valid": len(shaped),
        "measured": len(rows),
        "failed": failed,
        "stopped": stopped[0],
        "rows": rank_rows(rows),
    }


def _layout_of(cfg: Any, c: Candidate) -> Any:
    """The ``Layout`` of the job with layout ``c`` (``config/layout.py``'s rules), or why not.

    The cheap check every candidate gets; the model-aware ones (the spec's EP and TP
    rules, the pipeline's blocks) run in ``_validated`` on those about to be measured."""
    section = c.parallelism(cfg.parallelism.model_dump())
    changed = cfg.model_copy(update={"parallelism": cfg.parallelism.model_copy(update=section)})
    try:
        return changed.layout
    except ValueError as err:
        return str(err)


def _measure_promising(
    resolved: ResolvedJob,
    shaped: list[tuple[Candidate, Any]],
    refused: list[str],
    failed: list[str],
    stopped: list[str],
) -> list[dict[str, Any]]:
    """Fake-step plans of the most promising layouts (see the module doc, step 4): each
    is validated by the job's own checks first (a refusal goes to ``refused``); one whose
    fake step fails is named in ``failed``; why the measuring stopped goes to ``stopped``."""

    def order(item: tuple[Candidate, Any]) -> tuple[float, int, int, int]:
        c, layout = item
        return (bubble_share(layout), c.dp_replicate, c.tp, -c.ep)

    ordered = [c for c, _ in sorted(shaped, key=order)]
    groups: set[tuple[int, str, int]] = set()
    tried: set[Candidate] = set()
    rows: list[dict[str, Any]] = []
    start, longest = time.process_time(), 0.0
    # First the best of each (pp, schedule, tp), then the rest in the same order.
    for first_pass in (True, False):
        for c in ordered:
            group = (c.pp, c.schedule, c.tp)
            if c in tried or (first_pass and group in groups):
                continue
            stop = _stop_reason(rows, len(failed), time.process_time() - start + longest)
            if stop:
                stopped.append(stop)
                return rows
            tried.add(c)
            job = _validated(resolved, c)
            if isinstance(job, str):
                refused.append(f"{c.label()}: {job.splitlines()[-1].strip()[:200]}")
                continue
            groups.add(group)
            began = time.process_time()
            row = _measure(c, job, failed)
            longest = max(longest, time.process_time() - began)
            if row is not None:
                rows.append(row)
    stopped.append("every valid layout measured")
    return rows


def _stop_reason(rows: list[dict[str, Any]], failed: int, expected_s: float) -> str | None:
    """Why to measure no more (None: go on); the next fake step is expected to end after
    ``expected_s`` CPU seconds of measuring (the longest one so far added)."""
    fitting = sum(r["fits"] for r in rows)
    if fitting >= ENOUGH_FITTING:
        return f"{fitting} layouts fit"
    if len(rows) + failed >= MAX_MEASURED:
        return f"{MAX_MEASURED} fake steps run"
    if fitting and expected_s > MEASURE_BUDGET_S:
        return f"a layout fits and another fake step would pass {MEASURE_BUDGET_S:.0f} CPU s"
    return None


def _measure(c: Candidate, job: ResolvedJob, failed: list[str]) -> dict[str, Any] | None:
    """The search row of ``c`` (``search_row``), or None with the failure in ``failed``."""
    started = time.perf_counter()
    try:
        row = search_row(job)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        logger.warning("plan.search: the fake step of %s failed: %s", c.label(), err)
        failed.append(f"{c.label()}: {type(err).__name__}: {str(err)[:200]}")
        return None
    row["layout"] = c.label()
    row["degrees"] = {**dataclasses.asdict(c), **row.get("degrees", {})}
    logger.info(
        "plan.search: %s planned %.1f GiB per rank (%s) in %.0f s",
        c.label(),
        row["peak_gib"],
        "fits" if row["fits"] else "does not fit",
        time.perf_counter() - started,
    )
    return row
