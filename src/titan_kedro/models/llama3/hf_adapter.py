"""Weights and configs between our Llama 3 and transformers' ``LlamaForCausalLM``.

Our attention rotates channel pairs ``(i, i + head_dim/2)`` exactly as transformers does,
so q/k projections map one to one, without the row permutation that Meta's original
(interleaved) checkpoints need. Tied HF checkpoints (``tie_word_embeddings``, e.g.
Llama 3.2 1B) load by copying the embedding into our separate output projection; we
always export untied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from titan_kedro.models.common import Llama3RopeScaling
from titan_kedro.models.llama3.args import Llama3Args

_TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_PER_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    # transformers < 5 kept theta and scaling apart.
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class Llama3StateDictAdapter:
    """Maps Hugging Face Llama configs and state dicts to ours and back."""

    def args_from_hf_config(self, config: Any) -> Llama3Args:
        """Our args for a ``transformers.LlamaConfig``.

        Raises:
            ValueError: The config uses something this model does not implement
                (biases, another activation, a RoPE type other than default/llama3).
        """
        unsupported = []
        if getattr(config, "attention_bias", False):
            unsupported.append("attention_bias=True")
        if getattr(config, "mlp_bias", False):
            unsupported.append("mlp_bias=True")
        if getattr(config, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={config.hidden_act!r}")
        rope = _rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in {"default", "llama3"}:
            unsupported.append(f"rope_type={rope_type!r}")
        if unsupported:
            raise ValueError(
                f"Llama config not supported by titan_kedro's llama3: {', '.join(unsupported)}"
            )
        scaling = None
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        head_dim = getattr(config, "head_dim", None)
        if head_dim == config.hidden_size // config.num_attention_heads:
            head_dim = None  # the default, as our flavors spell it
        return Llama3Args(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            ffn_hidden_dim=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=scaling,
            max_seq_len=config.max_position_embeddings,
        )

    def hf_config_from_args(self, args: Llama3Args, **extra: Any) -> Any:
        """A ``transformers.LlamaConfig`` for ``args`` (untied); ``extra`` sets more fields
        (``bos_token_id``, ``eos_token_id``, ``dtype`` …)."""
        from transformers import LlamaConfig

        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
        if args.rope_scaling is not None:
            scaling = args.rope_scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": args.rope_theta,
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            }
        return LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            intermediate_size=args.ffn_hidden_dim,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.head_size,
            hidden_act="silu",
            max_position_embeddings=args.max_seq_len,
            rms_norm_eps=args.norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            architectures=["LlamaForCausalLM"],
            **extra,
        )

    def from_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename a ``LlamaForCausalLM`` state dict to ours (tensors are not copied).

        Raises:
            KeyError: A key has no counterpart here (the message lists them).
        """
        out: dict[str, Any] = {}
        unknown = []
        for key, value in state_dict.items():
            if key in _TOP_LEVEL:
                out[_TOP_LEVEL[key]] = value
            elif (match := _HF_LAYER.match(key)) and match.group(2) in _PER_LAYER:
                out[f"layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"] = value
            elif not _HF_IGNORED.search(key):
                unknown.append(key)
        if unknown:
            raise KeyError(
                f"Hugging Face Llama keys with no titan_kedro counterpart: {unknown[:8]}"
            )
        if "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]  # tied checkpoint
        return out

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Rename our state dict to ``LlamaForCausalLM``'s (untied ``lm_head``).

        Raises:
            KeyError: A key has no Hugging Face counterpart (the message lists them).
        """
        top = {ours: theirs for theirs, ours in _TOP_LEVEL.items()}
        per_layer = {ours: theirs for theirs, ours in _PER_LAYER.items()}
        out: dict[str, Any] = {}
        unknown = []
        for key, value in state_dict.items():
            if key in top:
                out[top[key]] = value
            elif (match := _OUR_LAYER.match(key)) and match.group(2) in per_layer:
                out[f"model.layers.{match.group(1)}.{per_layer[match.group(2)]}"] = value
            else:
                unknown.append(key)
        if unknown:
            raise KeyError(
                f"titan_kedro Llama 3 keys with no Hugging Face counterpart: {unknown[:8]}"
            )
        return out
