"""How a model's blocks are split into pipeline stages, and which splits are refused.

Stages hold whole blocks (``model.layers``), in order. The first stage also holds the
token embedding; the last the final norm, the output projection, the loss and the
multi-token-prediction blocks (DeepSeek-V3's ``layers.{n_layers + k - 1}``, which need
the last hidden state and the shared output head).

The default split balances an **analytic estimate** of each stage's training FLOPs per
token, not its block count (a dense-first DeepSeek block and a MoE block cost
differently, and the last stage also pays for the output projection and MTP):

- a block costs ``6 × active parameters`` (routed experts counted ``top_k`` of
  ``n_routed_experts`` times, as ``flops.py`` counts them) plus its attention matmuls,
  ``6 × seq_len × n_heads × (qk_head_dim + v_head_dim)``;
- the last stage adds ``6 × dim × vocab`` per output head (main and each MTP depth).

``parallelism.pipeline_layout`` overrides it (main blocks per stage). The plan's measured
per-block peaks are not used yet (the plan does not run pipelined steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def main_blocks(args: Any) -> int:
    """Blocks a pipeline splits (``n_layers``; MTP blocks ride on the last stage)."""
    return int(args.n_layers)


def check_pipeline_model(cfg: Any, args: Any) -> None:
    """Refuse pipeline settings the model or the rest of the job cannot run with.

    Raises:
        ValueError: Naming the key at fault and the fix.
    """
    layout, par = cfg.layout, cfg.parallelism
    if layout.pp == 1:
        if par.pipeline_layout is not None:
            raise ValueError(
                "parallelism.pipeline_layout is set but pipeline_parallel_degree is 1; remove "
                "it or raise parallelism.pipeline_parallel_degree"
            )
        return
    if not hasattr(args, "n_layers"):
        raise ValueError(
            f"parallelism.pipeline_parallel_degree={layout.pp}: model {cfg.model.name!r} names "
            "no n_layers, so its blocks cannot be split into stages; use 1"
        )
    blocks, stages = main_blocks(args), layout.pp_stages
    if stages > blocks:
        raise ValueError(
            f"{stages} pipeline stages (parallelism.pipeline_parallel_degree {layout.pp} × "
            f"{layout.pp_stages_per_rank} stage(s) per rank) but the model has {blocks} "
            "blocks; every stage needs at least one: lower the pipeline degree or "
            "pipeline_stages_per_rank"
        )
    custom = par.pipeline_layout
    if custom is not None and (len(custom) != stages or sum(custom) != blocks or min(custom) < 1):
        raise ValueError(
            f"parallelism.pipeline_layout={custom} must give each of the {stages} stages at "
            f"least one block and sum to the model's {blocks} blocks (e.g. "
            f"{even_layout(blocks, stages)}); or remove it for the balanced default"
        )
    if cfg.fault_tolerance.enable:
        raise ValueError(
            "parallelism.pipeline_parallel_degree > 1 with fault_tolerance.enable is not "
            "supported (the replica groups' step is not pipelined); use one of them"
        )
    accum = layout.grad_accum_steps
    if cfg.validation.freq and cfg.validation.steps % accum:
        raise ValueError(
            f"validation.steps={cfg.validation.steps}: pipelined validation scores "
            f"{accum} batches at a time (a step's accumulation), so it must be a multiple of "
            f"{accum}; set validation.steps to {max(accum, cfg.validation.steps // accum * accum)}"
        )


def even_layout(blocks: int, stages: int) -> list[int]:
    """``blocks`` split into ``stages`` counts differing by at most one (later stages fewer)."""
    return [blocks // stages + (i < blocks % stages) for i in range(stages)]


def _active_params(block: nn.Module) -> int:
    total = sum(p.numel() for p in block.parameters())
    for module in block.modules():
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(module, "top_k"):
            continue
        per_expert = sum(p.numel() for p in experts.parameters()) // module.num_experts
        total -= (module.num_experts - module.top_k) * per_expert
    return total


def _attention_channels(args: Any) -> int:
    if hasattr(args, "qk_nope_head_dim"):
        return args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    return 2 * args.dim  # q·k over the heads' dim, weights·v over it again


def stage_costs(model: nn.Module, args: Any, seq_len: int) -> tuple[list[float], float]:
    """Estimated training FLOPs per token of each main block, and the last stage's extra.

    Args:
        model: The model (any device, meta included).
        args: Its args (``n_layers``, ``dim``, ``vocab_size``, ``n_heads``, …).
        seq_len: Tokens per sample.
    """
    attention = 6.0 * seq_len * _attention_channels(args)
    costs = [
        6.0 * _active_params(model.layers[str(i)]) + attention for i in range(main_blocks(args))
    ]
    head = 6.0 * args.dim * args.vocab_size
    mtp = [model.layers[name] for name in model.layers if int(name) >= main_blocks(args)]
    extra = head + sum(6.0 * _active_params(b) + attention + head for b in mtp)
    return costs, extra


def balanced_layout(costs: list[float], stages: int, last_extra: float = 0.0) -> list[int]:
    """Contiguous blocks per stage minimising the costliest stage (``last_extra`` on the last).

    Ties go to the split closest to even block counts (the earliest found).
    """
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the smallest max stage cost of the first i blocks in s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            extra = last_extra if s == stages else 0.0
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[s][i] - 1e-9 * abs(value):
                    best[s][i], cut[s][i] = value, j
    layout, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        layout.append(i - j)
        i = j
    return layout[::-1]


def pipeline_layout(cfg: Any, args: Any, spec: Any) -> list[int]:
    """Main blocks per stage: ``parallelism.pipeline_layout``, else the balanced default."""
    if cfg.parallelism.pipeline_layout is not None:
        return list(cfg.parallelism.pipeline_layout)
    with torch.device("meta"):
        model = spec.build_model(args)
    costs, extra = stage_costs(model, args, cfg.training.seq_len)
    return balanced_layout(costs, cfg.layout.pp_stages, extra)
