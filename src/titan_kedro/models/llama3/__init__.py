"""Llama 3 (dense, GQA, RoPE with Llama 3 scaling): the ``llama3`` train spec (``LLAMA3_SPEC``)."""

from __future__ import annotations

from titan_kedro.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan_kedro.models.llama3.hf_adapter import Llama3StateDictAdapter
from titan_kedro.models.llama3.model import Llama3Model
from titan_kedro.models.llama3.parallelize import llama3_tensor_parallel_widths, parallelize_llama3
from titan_kedro.models.spec import TrainSpec


def llama3_param_count(args: Llama3Args) -> dict[str, int]:
    """Parameters by part, counted from the shapes alone.

    Returns:
        ``embedding`` (token embedding), ``per_layer`` (one block) and ``total``
        (embedding, blocks, final norm and the untied output projection).
    """
    q_width = args.n_heads * args.head_size
    kv_width = args.kv_heads * args.head_size
    attention = args.dim * q_width + 2 * args.dim * kv_width + q_width * args.dim
    per_layer = attention + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim
    embedding = args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + args.dim * args.vocab_size
    return {"embedding": embedding, "per_layer": per_layer, "total": total}


def llama3_flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    ``6 · N + 12 · n_layers · n_heads · head_dim · seq_len``, where ``N`` is every
    parameter except the token embedding (a lookup, not a matmul); the output projection
    is included. The attention term counts the ``q·kᵀ`` and ``scores·v`` matmuls over the
    full ``seq_len`` (2 matmuls × 2 FLOPs per multiply-add × 3 for forward + backward),
    without halving for the causal mask — the convention of PaLM's appendix and
    torchtitan, so MFU figures are comparable with theirs.
    """
    counts = llama3_param_count(args)
    non_embedding = counts["total"] - counts["embedding"]
    return 6 * non_embedding + 12 * args.n_layers * args.n_heads * args.head_size * seq_len


LLAMA3_SPEC = TrainSpec(
    name="llama3",
    model_cls=Llama3Model,
    flavors=LLAMA3_FLAVORS,
    state_dict_adapter=Llama3StateDictAdapter(),
    flops_per_token=llama3_flops_per_token,
    parallelize_fn=parallelize_llama3,
    tensor_parallel_widths=llama3_tensor_parallel_widths,
)
"""Found by ``get_train_spec("llama3")`` through ``registry.BUILTIN_SPECS``."""

__all__ = [
    "LLAMA3_FLAVORS",
    "LLAMA3_SPEC",
    "Llama3Args",
    "Llama3Model",
    "Llama3StateDictAdapter",
    "llama3_flops_per_token",
    "llama3_param_count",
]
