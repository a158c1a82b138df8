"""Weights and configs between our DeepSeek-V2 and transformers' ``DeepseekV2ForCausalLM``.

Key map (``{i}`` = layer, ``{e}`` = expert)::

    model.embed_tokens.weight                       tok_embeddings.weight
    model.norm.weight / lm_head.weight              norm.weight / output.weight
    model.layers.{i}.input_layernorm                layers.{i}.attention_norm
    model.layers.{i}.post_attention_layernorm       layers.{i}.ffn_norm
    …self_attn.q_proj | q_a_proj | q_a_layernorm | q_b_proj
                                                    …attention.wq | wq_a | q_norm | wq_b
    …self_attn.kv_a_proj_with_mqa | kv_a_layernorm | kv_b_proj | o_proj
                                                    …attention.wkv_a | kv_norm | wkv_b | wo
    …mlp.gate_proj | up_proj | down_proj (dense)    …feed_forward.w1 | w3 | w2
    …mlp.gate.weight                                …moe.router.gate.weight
    …mlp.shared_experts.gate_proj | up_proj | down_proj
                                                    …moe.shared_experts.w1 | w3 | w2
    …mlp.experts.gate_up_proj  [E, 2h, d]           …moe.experts.w1 ‖ w3  [E, h, d] each
    …mlp.experts.down_proj     [E, d, h]            …moe.experts.w2

transformers 5 keeps routed experts fused in memory (above); checkpoint files on the hub
hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight`` …), which ``from_hf``
also accepts. ``moe.expert_bias`` (aux-loss-free balancing) has no HF counterpart:
``from_hf`` sets it to zero and ``to_hf`` drops it, warning if it is not zero, since
transformers would then choose experts differently.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs, yarn_from_mapping

log = logging.getLogger(__name__)

# Per-layer renames (HF suffix -> ours), applied after "model.layers.{i}." / "layers.{i}.".
_LAYER_RENAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
    "mlp.experts.down_proj": "moe.experts.w2",
}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SLOT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class DeepSeekV2StateDictAdapter:
    """``StateDictAdapter`` for the ``deepseek_v2`` train spec."""

    family = "DeepSeek-V2"
    """Name in error messages."""
    args_cls: type[DeepSeekV2ModelArgs] = DeepSeekV2ModelArgs
    """The model-args class ``args_from_hf_config`` builds."""
    layer_renames: Mapping[str, str] = _LAYER_RENAMES
    """Per-layer HF suffix → ours."""
    required_hf_values: Mapping[str, Any] = {
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "scoring_func": "softmax",
    }
    """HF config values this implementation supports (a key may be absent)."""

    def args_from_hf_config(
        self, config: Any, *, max_seq_len: int | None = None
    ) -> DeepSeekV2ModelArgs:
        """Model args from a ``transformers.DeepseekV2Config`` (or its ``to_dict()``).

        Args:
            config: The HF config.
            max_seq_len: Rotary table length; default ``max_position_embeddings``.

        Raises:
            ValueError: The config uses a feature this implementation does not have.
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return self.args_cls(**self._args_fields(cfg, max_seq_len))

    def _args_fields(self, cfg: Mapping[str, Any], max_seq_len: int | None) -> dict[str, Any]:
        for key, ours in self.required_hf_values.items():
            if key in cfg and cfg[key] != ours:
                raise ValueError(
                    f"{self.family} config has {key}={cfg[key]!r}; only {ours!r} is supported"
                )
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if kv_heads != cfg["num_attention_heads"]:
            raise ValueError(
                f"num_key_value_heads={kv_heads} differs from num_attention_heads="
                f"{cfg['num_attention_heads']}; MLA has one key/value head per query head"
            )
        if cfg.get("num_experts_per_tok") is None:
            raise ValueError(f"{self.family} config lacks num_experts_per_tok (routed top-k)")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if kind in ("default", None) else yarn_from_mapping(rope)
        return dict(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            max_seq_len=max_seq_len or cfg["max_position_embeddings"],
            rms_norm_eps=cfg["rms_norm_eps"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            n_routed_experts=cfg["n_routed_experts"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            topk_method=cfg.get("topk_method") or "greedy",
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            aux_loss_alpha=float(cfg.get("aux_loss_alpha") or 0.0),
            seq_aux=bool(cfg.get("seq_aux", True)),
            initializer_range=cfg.get("initializer_range", 0.02),
        )

    def hf_config_from_args(self, args: DeepSeekV2ModelArgs) -> Any:
        """A ``transformers.DeepseekV2Config`` describing the same network."""
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            **self._hf_config_fields(args),
            topk_method=args.topk_method,
            # Not fields of transformers' class, kept for DeepSeek's reference code.
            aux_loss_alpha=args.aux_loss_alpha,
            seq_aux=args.seq_aux,
            scoring_func="softmax",
        )

    def _hf_config_fields(self, args: DeepSeekV2ModelArgs) -> dict[str, Any]:
        """Config fields DeepSeek-V2 and V3 share in transformers."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
        if args.rope_scaling is not None:
            s = args.rope_scaling
            rope = {
                "rope_type": "yarn",
                "rope_theta": args.rope_theta,
                "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow,
                "mscale": s.mscale,
                "mscale_all_dim": s.mscale_all_dim,
                "truncate": s.truncate,
            }
        return dict(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_heads,
            max_position_embeddings=args.max_seq_len,
            rms_norm_eps=args.rms_norm_eps,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            rope_parameters=rope,
            intermediate_size=args.intermediate_size,
            moe_intermediate_size=args.moe_intermediate_size,
            first_k_dense_replace=args.first_k_dense_replace,
            n_routed_experts=args.n_routed_experts,
            n_shared_experts=args.n_shared_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            n_group=args.n_group,
            topk_group=args.topk_group,
            norm_topk_prob=args.norm_topk_prob,
            routed_scaling_factor=args.routed_scaling_factor,
            initializer_range=args.initializer_range,
            tie_word_embeddings=False,
        )

    def from_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Our state dict from an HF one (fused or per-expert routed experts).

        Raises:
            KeyError: A key has no counterpart (the message names it).
        """
        out: dict[str, Any] = {}
        per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for key, value in state_dict.items():
            if key in _TOP_RENAMES:
                out[_TOP_RENAMES[key]] = value
                continue
            match = _HF_LAYER.match(key)
            if match is None:
                raise KeyError(f"unexpected Hugging Face key '{key}' for {self.family}")
            layer, rest = match.groups()
            prefix = f"layers.{layer}."
            if rest in self.layer_renames:
                out[prefix + self.layer_renames[rest]] = value
            elif rest == "mlp.experts.gate_up_proj":
                w1, w3 = value.chunk(2, dim=1)
                out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = w1, w3
            elif expert := _HF_EXPERT.match(rest):
                index, proj = expert.groups()
                per_expert.setdefault((int(layer), _EXPERT_SLOT[proj]), {})[int(index)] = value
            else:
                raise KeyError(f"unexpected Hugging Face key '{key}' for {self.family}")
            if rest == "mlp.gate.weight":
                out.setdefault(
                    prefix + "moe.expert_bias", torch.zeros(value.shape[0], device=value.device)
                )
        for (layer, slot), experts in per_expert.items():
            if sorted(experts) != list(range(len(experts))):
                raise KeyError(f"layer {layer}: routed experts {sorted(experts)} are not 0..n-1")
            out[f"layers.{layer}.moe.experts.{slot}"] = torch.stack(
                [experts[e] for e in range(len(experts))]
            )
        return out

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The HF state dict (fused experts, as ``DeepseekV2ForCausalLM.state_dict()``).

        Raises:
            KeyError: A key has no counterpart (the message names it).
        """
        reverse_top = {ours: hf for hf, ours in _TOP_RENAMES.items()}
        reverse_layer = {ours: hf for hf, ours in self.layer_renames.items()}
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key in reverse_top:
                out[reverse_top[key]] = value
                continue
            match = _OUR_LAYER.match(key)
            if match is None:
                raise KeyError(f"unexpected {self.family} key '{key}'; no Hugging Face name")
            layer, rest = match.groups()
            prefix = f"model.layers.{layer}."
            if rest in reverse_layer:
                out[prefix + reverse_layer[rest]] = value
            elif rest == "moe.experts.w1":
                w3 = state_dict[f"layers.{layer}.moe.experts.w3"]
                out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([value, w3], dim=1)
            elif rest == "moe.experts.w3":
                continue  # fused with w1 above
            elif rest == "moe.expert_bias":
                if torch.count_nonzero(value):
                    log.warning(
                        "layer %s: the aux-loss-free expert bias is not zero, but transformers' "
                        "DeepSeek-V2 has no such bias; the exported model will choose experts "
                        "without it",
                        layer,
                    )
            else:
                raise KeyError(f"unexpected {self.family} key '{key}'; no Hugging Face name")
        return out
