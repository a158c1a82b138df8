"""Model arguments of the DeepSeek-V2 family, named after the Hugging Face config fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from titan_kedro.models.common import YarnRopeScaling

TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
ScoringFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class DeepSeekV2ModelArgs:
    """Sizes and switches of one DeepSeek-V2 model (MLA attention + DeepSeekMoE).

    Field names follow ``transformers.DeepseekV2Config`` where one exists; ``dim``,
    ``n_layers``, ``n_heads`` and ``max_seq_len`` are the project-wide names of
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``max_position_embeddings``.
    """

    vocab_size: int = 102400
    """Rows of the embedding and the output projection (the tokenizer's padded size)."""
    dim: int = 2048
    """Model width (HF ``hidden_size``)."""
    n_layers: int = 27
    """Transformer blocks (HF ``num_hidden_layers``)."""
    n_heads: int = 16
    """Attention heads (HF ``num_attention_heads``); MLA has as many key/value heads."""
    max_seq_len: int = 4096
    """Longest sequence the rotary table covers (HF ``max_position_embeddings``)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    # Multi-head latent attention.
    q_lora_rank: int | None = None
    """Rank of the low-rank query projection; None projects queries at full rank."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (what an inference cache stores)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without position information."""
    qk_rope_head_dim: int = 64
    """Per-head query/key channels carrying RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value channels."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: YarnRopeScaling | None = None
    """YaRN context extension (HF ``rope_scaling`` of type ``yarn``); a mapping is accepted."""

    # Feed-forward and DeepSeekMoE.
    intermediate_size: int = 10944
    """Hidden width of the dense SwiGLU FFN of the first ``first_k_dense_replace`` layers."""
    moe_intermediate_size: int = 1408
    """Hidden width of each routed and shared expert."""
    first_k_dense_replace: int = 1
    """The first this many layers use the dense FFN; the others are MoE layers."""
    n_routed_experts: int = 64
    """Routed experts per MoE layer."""
    n_shared_experts: int = 2
    """Shared experts per MoE layer (always active; fused into one FFN of n × width)."""
    num_experts_per_tok: int = 6
    """Routed experts chosen per token (top-k)."""
    scoring_func: ScoringFunc = "softmax"
    """Gate scores: ``softmax`` over the experts (DeepSeek-V2) or an independent
    ``sigmoid`` per expert (DeepSeek-V3)."""
    topk_method: TopkMethod = "greedy"
    """``greedy``: top-k over all experts; ``group_limited_greedy``: top-k within the
    ``topk_group`` best of ``n_group`` expert groups, a group worth its best expert
    (DeepSeek-V2's device-limited routing); ``noaux_tc``: the same with a group worth the
    sum of its two best bias-corrected scores, and the selection bias always applied
    (DeepSeek-V3's node-limited routing)."""
    n_group: int = 1
    """Expert groups for group-limited routing (must divide ``n_routed_experts``)."""
    topk_group: int = 1
    """Groups kept per token by group-limited routing."""
    norm_topk_prob: bool = False
    """Renormalize the top-k gate weights to sum to one, then apply ``routed_scaling_factor``
    (the DeepSeek-V3 order; V2's reference code skips the scaling when renormalizing, but
    no V2 release sets both). transformers 5.x ignores this field."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed experts' gate weights."""

    # Load balancing.
    aux_loss_alpha: float = 0.0
    """Coefficient of the DeepSeek-V2 expert-level balance loss; 0 turns it off."""
    seq_aux: bool = True
    """Compute the balance loss per sequence and average (DeepSeek's ``seq_aux``); else
    over all tokens of the micro-batch."""
    load_balance_bias_update_speed: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's
    selection bias moves by this much towards balance; 0 turns it off. The bias only
    changes which experts are chosen, never the gate weights."""

    # Initialisation and kernels.
    initializer_range: float = 0.02
    """Standard deviation of the weight init (deeper projections are scaled down)."""
    use_grouped_mm: bool = True
    """Run routed experts with ``torch._grouped_mm`` where it applies; else padded ``bmm``."""

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", yarn_from_mapping(self.rope_scaling))
        self._validate()

    @property
    def qk_head_dim(self) -> int:
        """Query/key channels per head (no-position part + rotary part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        """Layers whose FFN is a DeepSeekMoE block."""
        return self.n_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` uses the MoE FFN."""
        return layer_id >= self.first_k_dense_replace

    family: ClassVar[str] = "DeepSeek-V2"
    """Family name used in error messages."""
    topk_methods: ClassVar[tuple[str, ...]] = ("greedy", "group_limited_greedy")
    """The ``topk_method`` values this family's transformers counterpart has."""
    scoring_funcs: ClassVar[tuple[str, ...]] = ("softmax",)
    """The ``scoring_func`` values this family's transformers counterpart has."""

    def _validate(self) -> None:
        def fail(field: str, problem: str) -> None:
            raise ValueError(f"{self.family} model arg {field}={getattr(self, field)!r}: {problem}")

        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "max_seq_len",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "intermediate_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        ):
            if getattr(self, name) < 1:
                fail(name, "must be a positive integer")
        for name in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace"):
            if getattr(self, name) < 0:
                fail(name, "must not be negative")
        for name in ("aux_loss_alpha", "load_balance_bias_update_speed", "rms_norm_eps"):
            if getattr(self, name) < 0:
                fail(name, "must not be negative")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            fail("q_lora_rank", "must be a positive integer, or None for a full-rank query")
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", "must be even (RoPE rotates channel pairs)")
        if self.first_k_dense_replace > self.n_layers:
            fail("first_k_dense_replace", f"exceeds n_layers={self.n_layers}")
        if self.topk_method not in self.topk_methods:
            fail(
                "topk_method",
                f"must be one of {self.topk_methods} (the other DeepSeek family "
                "routes otherwise: choose model.name deepseek_v2 or deepseek_v3)",
            )
        if self.scoring_func not in self.scoring_funcs:
            fail(
                "scoring_func",
                f"must be one of {self.scoring_funcs} (the other DeepSeek family "
                "routes otherwise: choose model.name deepseek_v2 or deepseek_v3)",
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"exceeds n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            fail("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
        if self.topk_group > self.n_group:
            fail("topk_group", f"exceeds n_group={self.n_group}")
        if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
            fail("n_group", "leaves fewer than 2 experts per group (noaux_tc sums a group's top 2)")
        if self.topk_method != "greedy":
            reachable = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.num_experts_per_tok > reachable:
                fail(
                    "num_experts_per_tok",
                    f"exceeds the {reachable} experts in topk_group={self.topk_group} groups",
                )


def yarn_from_mapping(cfg: Mapping[str, Any]) -> YarnRopeScaling:
    """Build YaRN settings from an HF-style ``rope_scaling``/``rope_parameters`` mapping."""
    kind = cfg.get("rope_type", cfg.get("type", "yarn"))
    if kind != "yarn":
        raise ValueError(
            f"DeepSeek-V2 supports YaRN rope scaling only, got rope type {kind!r}; "
            "use rope_scaling: null for plain RoPE"
        )
    known = {f.name for f in dataclasses.fields(YarnRopeScaling)}
    ignored = {"type", "rope_type", "rope_theta"}
    unknown = sorted(set(cfg) - known - ignored)
    if unknown:
        raise ValueError(f"rope_scaling has unknown keys {unknown}; known: {sorted(known)}")
    missing = sorted({"factor", "original_max_position_embeddings"} - set(cfg))
    if missing:
        raise ValueError(f"rope_scaling of type yarn needs {missing}")
    values = {k: v for k, v in cfg.items() if k in known and v is not None}
    return YarnRopeScaling(**values)
