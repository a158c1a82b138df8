"""Model arguments of the DeepSeek-V3 family: DeepSeek-V2's, with V3's routing and MTP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs, ScoringFunc, TopkMethod


@dataclass(frozen=True)
class DeepSeekV3ModelArgs(DeepSeekV2ModelArgs):
    """Sizes and switches of one DeepSeek-V3 model (MLA + DeepSeekMoE + multi-token prediction).

    Every field of ``DeepSeekV2ModelArgs`` keeps its meaning (MLA, YaRN, dense-first layers
    through ``first_k_dense_replace``, shared and routed experts); the defaults below are
    DeepSeek-V3's routing, and ``mtp_depth`` is new.
    """

    vocab_size: int = 129280
    """Rows of the embedding and the output projection (the V3 tokenizer's 128,815 ids,
    padded as in the published config)."""
    scoring_func: ScoringFunc = "sigmoid"
    """V3 scores each expert with an independent sigmoid (no softmax over experts)."""
    topk_method: TopkMethod = "noaux_tc"
    """V3 chooses experts by score plus the per-expert correction bias within the
    ``topk_group`` groups whose two best biased scores sum highest (node-limited routing);
    the combine weights use the unbiased scores."""
    norm_topk_prob: bool = True
    """V3 renormalizes the chosen experts' sigmoid scores to sum to one, then applies
    ``routed_scaling_factor``."""
    routed_scaling_factor: float = 2.5
    """Multiplier of the routed experts' combine weights (2.5 in DeepSeek-V3)."""
    aux_loss_alpha: float = 0.0001
    """Coefficient of the small sequence-wise balance loss (DeepSeek-V3 eq. 17-20, α =
    0.0001); balance comes mainly from the correction bias. 0 turns it off."""
    seq_aux: bool = True
    """The balance loss is computed per sequence and averaged, as in DeepSeek-V3."""
    load_balance_bias_update_speed: float = 0.001
    """Aux-loss-free balancing: the correction bias moves by this much per optimizer step
    towards balance (γ = 0.001 in DeepSeek-V3); 0 freezes it (it still routes)."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3 §2.2): module ``k`` predicts the token
    ``k + 1`` ahead from depth ``k - 1``'s hidden state and the embedding of the token
    ``k`` ahead, through one more block; shares the embedding and output head. 0: none
    (the released V3 has 1). The job config's ``model.mtp_depth`` sets it."""

    family: ClassVar[str] = "DeepSeek-V3"
    topk_methods: ClassVar[tuple[str, ...]] = ("noaux_tc",)
    scoring_funcs: ClassVar[tuple[str, ...]] = ("sigmoid",)

    def _validate(self) -> None:
        super()._validate()
        if self.mtp_depth < 0:
            raise ValueError(
                f"{self.family} model arg mtp_depth={self.mtp_depth}: must not be negative"
            )
