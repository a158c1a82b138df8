"""Parameter counts and training FLOPs per token of a DeepSeek-V3 model, from its args.

DeepSeek-V2's counts and formula (``deepseek_v2/flops.py``) with each MTP depth counted
as one more block (layer ``n_layers + k``: dense or MoE like any block, attention over the
sequence included) plus what only MTP has: the ``eh_proj`` projection (``2 · dim²``),
three norms, and one more pass through the shared output head (``vocab · dim`` FLOPs per
multiply-add, no new parameters). Every token pays all of it in training.
"""

from __future__ import annotations

import dataclasses

from titan_kedro.models.counting import ParamCounts
from titan_kedro.models.deepseek_v2 import flops as v2_flops
from titan_kedro.models.deepseek_v3.args import DeepSeekV3ModelArgs


def _as_blocks(args: DeepSeekV3ModelArgs) -> DeepSeekV3ModelArgs:
    # The MTP blocks are layers n_layers … n_layers + mtp_depth - 1.
    return dataclasses.replace(args, n_layers=args.n_layers + args.mtp_depth, mtp_depth=0)


def _mtp_only(args: DeepSeekV3ModelArgs) -> int:
    return args.mtp_depth * (2 * args.dim * args.dim + 3 * args.dim)


def param_counts(args: DeepSeekV3ModelArgs) -> ParamCounts:
    """Count parameters from the args alone, MTP modules included."""
    counts = v2_flops.param_counts(_as_blocks(args))
    extra = _mtp_only(args)
    return dataclasses.replace(counts, total=counts.total + extra, active=counts.active + extra)


def flops_per_token(args: DeepSeekV3ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (module docstring), MTP included."""
    head = args.mtp_depth * args.vocab_size * args.dim
    return v2_flops.flops_per_token(_as_blocks(args), seq_len) + 6.0 * (_mtp_only(args) + head)
