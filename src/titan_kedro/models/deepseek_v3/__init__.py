"""DeepSeek-V3 family (MLA + DeepSeekMoE with V3 routing + MTP), the ``deepseek_v3`` train spec.

It shares DeepSeek-V2's attention, blocks, MoE machinery, expert parallelism and
parallelize function (``models/deepseek_v2``); the router takes V3's options (sigmoid
scores, bias-corrected node-limited selection). New here: multi-token prediction
(``model.py``), its FLOPs (``flops.py``) and the transformers ``DeepseekV3`` mapping
(``hf_adapter.py``).

Flavors: ``debugmodel`` (a training step on a laptop CPU, with q-LoRA and group-limited
routing), ``16B`` (torchtitan's DSV3-16B shape: 27 layers, dim 2048, 64 routed + 2
shared experts, top-6, with V3 routing and the V3 tokenizer's vocabulary) and ``671B``
(the published DeepSeek-V3 ``config.json``, one MTP module).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from titan_kedro.models.common import YarnRopeScaling
from titan_kedro.models.deepseek_v2 import validate_config as validate_expert_parallel
from titan_kedro.models.deepseek_v2.parallelize import parallelize_deepseek_v2
from titan_kedro.models.deepseek_v2.tensor_parallel import deepseek_tensor_parallel_widths
from titan_kedro.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan_kedro.models.deepseek_v3.flops import flops_per_token, param_counts
from titan_kedro.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
from titan_kedro.models.deepseek_v3.model import DeepSeekV3Model, MTPBlock
from titan_kedro.models.spec import TrainSpec

# DeepSeek-V3 extends its 4K pretraining context 40× with YaRN (published config.json).
_YARN_40X = YarnRopeScaling(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

FLAVORS: dict[str, DeepSeekV3ModelArgs] = {
    "debugmodel": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=256,
        n_layers=4,
        n_heads=8,
        max_seq_len=2048,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        # A demo's few steps at a high learning rate: a faster bias (V3: 0.001) and a
        # stronger sequence-wise loss (V3: 0.0001) keep routing from collapsing.
        load_balance_bias_update_speed=0.01,
        aux_loss_alpha=0.001,
    ),
    "16B": DeepSeekV3ModelArgs(
        vocab_size=129280,
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
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    ),
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=128,
        max_seq_len=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=_YARN_40X,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        first_k_dense_replace=3,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        mtp_depth=1,
    ),
}


class DeepSeekV3ModelExtension(BaseModel):
    """Fields DeepSeek-V3 adds to the ``model`` section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mtp_depth: StrictInt | None = Field(None, ge=0)
    """Multi-token-prediction modules (0: none; the released V3 uses 1); None keeps the
    flavor's (0 for debugmodel and 16B, 1 for 671B). A shorthand for
    ``model.overrides.mtp_depth``, which it is copied into."""


class DeepSeekV3TrainingExtension(BaseModel):
    """Fields DeepSeek-V3 adds to the ``training`` section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mtp_loss_weight: float = Field(0.3, ge=0.0)
    """Weight λ of the multi-token-prediction loss (the mean over depths of each depth's
    cross-entropy) added to the main loss; DeepSeek-V3 used 0.3, then 0.1. Only used when
    the model has MTP modules; logged as ``mtp_loss`` (unweighted)."""


DEEPSEEK_V3_SPEC = TrainSpec(
    name="deepseek_v3",
    model_cls=DeepSeekV3Model,
    flavors=FLAVORS,
    parallelize_fn=parallelize_deepseek_v2,
    state_dict_adapter=DeepSeekV3StateDictAdapter(),
    flops_per_token=flops_per_token,
    extensions={
        "model": DeepSeekV3ModelExtension,
        "training": DeepSeekV3TrainingExtension,
    },
    validate_config_fn=validate_expert_parallel,
    expert_parallel=True,
    tensor_parallel_widths=deepseek_tensor_parallel_widths,
)

__all__ = [
    "DEEPSEEK_V3_SPEC",
    "FLAVORS",
    "DeepSeekV3Model",
    "DeepSeekV3ModelArgs",
    "DeepSeekV3ModelExtension",
    "DeepSeekV3StateDictAdapter",
    "DeepSeekV3TrainingExtension",
    "MTPBlock",
    "flops_per_token",
    "param_counts",
]
