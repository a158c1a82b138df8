"""Nodes of the ``model_spec`` pipeline (thin wrappers over ``titan_kedro.models``)."""

from __future__ import annotations

import logging
from typing import Any

from titan_kedro.data.vocab import check_vocab_fits
from titan_kedro.models.counting import model_card
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan, format_plan, resolve_layout

logger = logging.getLogger(__name__)


def build_model_spec(
    token_metadata: dict[str, Any] | None = None, **sections: dict[str, Any]
) -> dict[str, Any]:
    """Resolve the model named by the job config and describe it.

    Args:
        token_metadata: ``metadata.json`` of the token files; the model's embedding must
            hold the tokenizer's vocabulary. None skips that check.
        **sections: The job-config sections by name (``model``, ``training``, …; the
            pipeline passes every one, see ``titan_kedro.pipelines.job_params``).

    Returns:
        The model card (see ``titan_kedro.models.counting.model_card``) with ``plan``, the
        per-rank memory measured on the sharded model, whether it fits, and the cost
        (see ``titan_kedro.plan.build_plan``); with ``plan.search`` or
        ``parallelism.layout: auto`` also ``layout_search``, the ranked layouts (the
        chosen one marked; the card and its plan then describe that layout).

    Raises:
        ConfigError: Unknown spec, unknown flavor, invalid override or custom-model
            import failure, with what to fix.
        ValueError: The token files hold ids beyond the model's embedding.
        NoLayoutFitsError: ``parallelism.layout: auto`` found no layout that fits.
    """
    resolved = resolve_job_config(sections, source="parameters")
    if token_metadata is not None:
        check_vocab_fits(token_metadata, int(resolved.model_args.vocab_size))
    resolved, search = resolve_layout(resolved)
    card = model_card(resolved.spec, resolved.model_args, resolved.config)
    card["plan"] = build_plan(resolved)
    if search is not None:
        card["layout_search"] = search
    params = card["parameters"]
    logger.info(
        "model %s/%s: %s parameters (%s active per token), %.3g GFLOPs/token at seq_len %d\n%s",
        card["spec"],
        card["flavor"],
        _millions(params["total"]),
        _millions(params["active"]),
        card["flops_per_token"] / 1e9,
        card["seq_len"],
        format_plan(card["plan"]),
    )
    return card


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f}M"
