"""Parameter counts and training FLOPs per token of a DeepSeek-V2 model, from its args.

Training FLOPs per token (forward + backward, the MFU numerator)::

    6 · N_active_non_embedding  +  6 · n_layers · n_heads · seq_len · (qk_nope + qk_rope + v_head)

- ``N_active_non_embedding``: parameters a token uses (routed experts counted top-k times
  per MoE layer, shared experts and dense FFNs fully) minus the input embedding table.
  The output projection is a matmul, so it counts. Each weight costs 2 FLOPs per token
  forward and 4 backward.
- The attention term is the score (q·k over ``qk_nope + qk_rope`` channels) and mixing
  (weights·v over ``v_head``) matmuls, 2 FLOPs per multiply-add, × 3 for the backward.
  It is the **full** (non-causal) count: every token is charged all ``seq_len``
  positions although the causal mask skips half of them, the convention of PaLM and
  torchtitan, so MFU is comparable with theirs.
"""

from __future__ import annotations

from titan_kedro.models.counting import ParamCounts
from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs


def param_counts(args: DeepSeekV2ModelArgs) -> ParamCounts:
    """Count parameters from the args alone (what ``count_parameters`` gives for the model)."""
    d, h = args.dim, args.n_heads
    if args.q_lora_rank is None:
        q = d * h * args.qk_head_dim
    else:
        q = d * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * h * args.qk_head_dim
    kv = (
        d * (args.kv_lora_rank + args.qk_rope_head_dim)
        + args.kv_lora_rank
        + args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
    )
    attention = q + kv + h * args.v_head_dim * d
    norms = 2 * d
    dense_ffn = 3 * d * args.intermediate_size
    expert = 3 * d * args.moe_intermediate_size
    shared = args.n_shared_experts * expert
    router = d * args.n_routed_experts
    moe_total = router + args.n_routed_experts * expert + shared
    moe_active = router + args.num_experts_per_tok * expert + shared

    n_moe, n_dense = args.n_moe_layers, args.first_k_dense_replace
    embedding = args.vocab_size * d
    outside = embedding + d + args.vocab_size * d  # embeddings, final norm, output
    common = args.n_layers * (attention + norms) + n_dense * dense_ffn + outside
    return ParamCounts(
        total=common + n_moe * moe_total,
        active=common + n_moe * moe_active,
        embedding=embedding,
        routed_experts=n_moe * args.n_routed_experts * expert,
    )


def flops_per_token(args: DeepSeekV2ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` (formula in the module docstring)."""
    counts = param_counts(args)
    dense = 6 * (counts.active - counts.embedding)
    head_channels = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    attention = 6 * args.n_layers * args.n_heads * seq_len * head_channels
    return float(dense + attention)
