"""DeepSeek-V2 family (MLA + DeepSeekMoE): the ``deepseek_v2`` train spec (``DEEPSEEK_V2_SPEC``).

Flavors: ``debugmodel`` (61M parameters, a training step on a laptop CPU), ``v2-lite``
(DeepSeek-V2-Lite: 15.7B total, 2.4B active) and ``v2`` (236B total, 21B active), with
the values of the published Hugging Face ``config.json`` files.
"""

from __future__ import annotations

from typing import Any

from titan_kedro.models.common import YarnRopeScaling
from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs
from titan_kedro.models.deepseek_v2.flops import flops_per_token, param_counts
from titan_kedro.models.deepseek_v2.hf_adapter import DeepSeekV2StateDictAdapter
from titan_kedro.models.deepseek_v2.model import DeepSeekV2Model
from titan_kedro.models.deepseek_v2.parallelize import parallelize_deepseek_v2
from titan_kedro.models.deepseek_v2.tensor_parallel import deepseek_tensor_parallel_widths
from titan_kedro.models.spec import TrainSpec

# DeepSeek-V2 and V2-Lite extend a 4K pretraining context 40× with YaRN.
_YARN_40X = YarnRopeScaling(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)

FLAVORS: dict[str, DeepSeekV2ModelArgs] = {
    "debugmodel": DeepSeekV2ModelArgs(
        vocab_size=102400,
        dim=256,
        n_layers=4,
        n_heads=8,
        max_seq_len=2048,
        q_lora_rank=None,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        # DeepSeek-V2 balances with the expert-level aux loss. The V3-style routing bias is
        # opt-in (model.overrides.load_balance_bias_update_speed): transformers'
        # DeepseekV2 has no such bias, so a model trained with it cannot export faithfully.
        # Stronger than V2's 0.001-0.003: at a demo's high learning rate and few steps a
        # weak balance loss lets routing collapse onto two experts per layer.
        aux_loss_alpha=0.01,
        load_balance_bias_update_speed=0.0,
    ),
    "v2-lite": DeepSeekV2ModelArgs(
        vocab_size=102400,
        dim=2048,
        n_layers=27,
        n_heads=16,
        max_seq_len=163840,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=_YARN_40X,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        aux_loss_alpha=0.001,
    ),
    "v2": DeepSeekV2ModelArgs(
        vocab_size=102400,
        dim=5120,
        n_layers=60,
        n_heads=128,
        max_seq_len=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=_YARN_40X,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        first_k_dense_replace=1,
        n_routed_experts=160,
        n_shared_experts=2,
        num_experts_per_tok=6,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
        aux_loss_alpha=0.001,
    ),
}


def validate_config(job_config: Any, args: DeepSeekV2ModelArgs) -> None:
    """Reject an expert-parallel degree that cannot split the routed experts, and MTP under
    tensor parallelism.

    That the degrees divide the ranks is the layout's check (``config/layout.Layout``); the
    widths TP splits are checked by ``models/tensor_parallel.check_tensor_parallel``.

    Raises:
        ValueError: Naming the ``parallelism`` key at fault and the fix.
    """
    ep = job_config.layout.ep
    if args.n_routed_experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} must divide the model's "
            f"n_routed_experts={args.n_routed_experts}; pick a divisor of it"
        )
    tp = job_config.layout.tp
    if tp > 1 and ep % tp and args.n_moe_layers:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} with tensor_parallel_degree={tp}: the "
            "tensor-parallel ranks route different tokens (sequence parallelism), so each "
            "expert-parallel group must hold whole TP groups; set expert_parallel_degree to "
            f"a multiple of {tp} that divides the shard degree × {tp}"
        )
    if tp > 1 and getattr(args, "mtp_depth", 0):
        raise ValueError(
            f"parallelism.tensor_parallel_degree={tp} with model.mtp_depth="
            f"{args.mtp_depth}: the multi-token-prediction modules have no tensor-parallel "
            "plan yet (their projection joins two sequence-sharded streams); set "
            "model.mtp_depth: 0 or tensor_parallel_degree: 1"
        )


DEEPSEEK_V2_SPEC = TrainSpec(
    name="deepseek_v2",
    model_cls=DeepSeekV2Model,
    flavors=FLAVORS,
    parallelize_fn=parallelize_deepseek_v2,
    state_dict_adapter=DeepSeekV2StateDictAdapter(),
    flops_per_token=flops_per_token,
    expert_parallel=True,
    tensor_parallel_widths=deepseek_tensor_parallel_widths,
    validate_config_fn=validate_config,
)
"""Found by ``get_train_spec("deepseek_v2")`` through ``registry.BUILTIN_SPECS``."""

__all__ = [
    "DEEPSEEK_V2_SPEC",
    "FLAVORS",
    "DeepSeekV2Model",
    "DeepSeekV2ModelArgs",
    "DeepSeekV2StateDictAdapter",
    "flops_per_token",
    "param_counts",
    "validate_config",
]
