"""Weights and configs between our DeepSeek-V3 and transformers' ``DeepseekV3ForCausalLM``.

The key map is DeepSeek-V2's (``deepseek_v2/hf_adapter.py``) plus the routing correction
bias, which transformers' V3 has::

    model.layers.{i}.mlp.gate.e_score_correction_bias     layers.{i}.moe.expert_bias

Multi-token prediction is not exported: transformers builds no MTP layer and its loader
drops ``model.layers.61.*`` of the released checkpoint. ``to_hf`` leaves our MTP blocks
(``layers.{n_layers + k}``, recognised by their ``eh_proj``) out, and ``from_hf`` skips
MTP layers found in an HF state dict (those with ``enorm``/``eh_proj``/``shared_head``),
so ``initial_load_hf`` leaves ours freshly initialised (``train/hf_init`` warns).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from titan_kedro.models.deepseek_v2.hf_adapter import _LAYER_RENAMES, DeepSeekV2StateDictAdapter
from titan_kedro.models.deepseek_v3.args import DeepSeekV3ModelArgs

log = logging.getLogger(__name__)

_HF_MTP_KEY = re.compile(r"^model\.layers\.(\d+)\.(enorm|hnorm|eh_proj|shared_head)\.")
_OUR_MTP_KEY = re.compile(r"^layers\.(\d+)\.eh_proj\.weight$")


class DeepSeekV3StateDictAdapter(DeepSeekV2StateDictAdapter):
    """``StateDictAdapter`` for the ``deepseek_v3`` train spec."""

    family = "DeepSeek-V3"
    args_cls = DeepSeekV3ModelArgs
    layer_renames: ClassVar[Mapping[str, str]] = {
        **_LAYER_RENAMES,
        "mlp.gate.e_score_correction_bias": "moe.expert_bias",
    }
    required_hf_values: ClassVar[Mapping[str, Any]] = {
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": True,
    }

    def args_from_hf_config(
        self, config: Any, *, max_seq_len: int | None = None
    ) -> DeepSeekV3ModelArgs:
        """Model args from a ``transformers.DeepseekV3Config`` (or its ``to_dict()``).

        ``mtp_depth`` is 0: HF weights carry no MTP module that transformers would load.

        Raises:
            ValueError: The config uses a feature this implementation does not have.
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        fields = self._args_fields(cfg, max_seq_len)
        fields.update(
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            aux_loss_alpha=float(cfg.get("aux_loss_alpha") or 0.0),
        )
        return DeepSeekV3ModelArgs(**fields)

    def hf_config_from_args(self, args: DeepSeekV3ModelArgs) -> Any:  # type: ignore[override]
        """A ``transformers.DeepseekV3Config`` describing the same network (without MTP)."""
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **self._hf_config_fields(args), rope_interleave=True, num_nextn_predict_layers=0
        )

    def from_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Our state dict from an HF one; MTP layers in it are skipped (with a warning)."""
        mtp_layers = {m.group(1) for key in state_dict if (m := _HF_MTP_KEY.match(key))}
        if mtp_layers:
            log.warning(
                "skipping the multi-token-prediction layer(s) %s of the Hugging Face weights: "
                "transformers does not load them, and our MTP modules start fresh",
                sorted(mtp_layers, key=int),
            )
            prefixes = tuple(f"model.layers.{layer}." for layer in mtp_layers)
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(prefixes)}
        return super().from_hf(state_dict)

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The HF state dict, without our MTP blocks (transformers has no MTP layer)."""
        dropped = self.keys_not_in_hf(state_dict)
        if dropped:
            log.info(
                "not exporting %d multi-token-prediction tensors: transformers' "
                "DeepseekV3ForCausalLM has no MTP layer",
                len(dropped),
            )
        return super().to_hf({k: v for k, v in state_dict.items() if k not in dropped})

    @staticmethod
    def keys_not_in_hf(keys: Iterable[str]) -> set[str]:
        """Our keys that no Hugging Face state dict holds: the MTP blocks' (recognised by
        their ``eh_proj``)."""
        keys = list(keys)
        layers = {m.group(1) for key in keys if (m := _OUR_MTP_KEY.match(key))}
        prefixes = tuple(f"layers.{layer}." for layer in layers)
        return {key for key in keys if prefixes and key.startswith(prefixes)}
