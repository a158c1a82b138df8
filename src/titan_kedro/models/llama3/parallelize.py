"""Parallelize Llama 3: tensor parallelism (with sequence parallelism), then AC, compile, FSDP2.

Attention: ``wq`` / ``wk`` / ``wv`` column-parallel (each ``tp`` rank computes
``n_heads / tp`` query heads and the ``n_kv_heads / tp`` key/value heads they read, since
both are split in contiguous blocks), ``wo`` row-parallel; the SwiGLU MLP column- then
row-parallel; norms, embedding and output as in ``models/tensor_parallel``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titan_kedro.models.parallel import parallelize_dense
from titan_kedro.models.tensor_parallel import (
    apply_block_plans,
    apply_tensor_parallel_ends,
    attention_and_mlp_plan,
)


def llama3_tensor_parallel_widths(args: Any) -> dict[str, int]:
    """The widths TP splits (``TrainSpec.tensor_parallel_widths``)."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.kv_heads,
        "model ffn_hidden_dim": args.ffn_hidden_dim,
        "model vocab_size": args.vocab_size,
    }


_ATTENTION = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
}


def parallelize_llama3(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    """Tensor parallelism over ``parallel_dims.tp_mesh`` (when ``tp`` > 1), then
    ``parallelize_dense`` (AC, compile, FSDP2 over the data-parallel mesh: 2-D with TP)."""
    if parallel_dims.tp > 1:
        apply_block_plans(
            model,
            parallel_dims.tp_mesh,
            lambda block: attention_and_mlp_plan(_ATTENTION, "feed_forward"),
        )
        apply_tensor_parallel_ends(model, parallel_dims.tp_mesh)
    return parallelize_dense(model, parallel_dims, job_config)
