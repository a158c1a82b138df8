"""DeepSeek-V2 in one page: multi-head latent attention (MLA) + DeepSeekMoE.

    tokens ─ tok_embeddings ─┬─ block 0 … block n-1 ─ norm ─ output → logits (fp32)
                             │
    block:  x = x + attention(attention_norm(x))
            x = x + ffn(ffn_norm(x))       ffn = SwiGLU for the first k layers, else MoE

MLA (DeepSeek-V2 paper, §2.1) shrinks what inference caches: keys and values are
rebuilt from one ``kv_lora_rank``-wide latent per token. Position goes through a small
separate ``qk_rope_head_dim`` slice of q and k ("decoupled RoPE"), because rotating
the up-projected keys would stop the latent from being shared; the rotary key slice is
a single head broadcast to all heads. Queries can also be low-rank (``q_lora_rank``).
With YaRN the softmax scale grows by ``mscale²`` so attention stays as sharp at long
context as it was at the pretraining length.

DeepSeekMoE (§2.2, ``moe.py``): many small routed experts (top-k by softmax gate) plus
always-on shared experts. Balance comes from the expert-level auxiliary loss and/or
the DeepSeek-V3 aux-loss-free bias, which only changes which experts are picked.

The layout matches Hugging Face ``DeepseekV2ForCausalLM`` maths exactly (interleaved
RoPE pairs, float32 router, weights after the experts), so ``hf_adapter`` only renames.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_kedro.models import sharded_init as init
from titan_kedro.models.common import (
    AttentionMask,
    FeedForward,
    RMSNorm,
    RotaryTableModule,
    apply_rotary_emb,
    attention,
    precompute_freqs_cis,
    rotations_and_mask,
)
from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs
from titan_kedro.models.deepseek_v2.moe import MoE


class MLA(nn.Module):
    """Multi-head latent attention with decoupled RoPE (causal, no KV cache: training)."""

    def __init__(self, args: DeepSeekV2ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        q_width = args.n_heads * args.qk_head_dim
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(args.q_lora_rank, q_width, bias=False)
        # One projection gives the latent and the shared rotary key slice.
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        scale = args.qk_head_dim**-0.5
        if args.rope_scaling is not None:
            scale *= args.rope_scaling.softmax_scale_multiplier()
        self.softmax_scale = scale

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism this rank's share of them.
        q = q.view(bsz, seq, -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)

        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)  # one head, shared by all
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, q.shape[2], -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, q.shape[2], -1)], dim=-1)

        out = attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=self.softmax_scale
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def init_weights(self, init_std: float) -> None:
        """Input projections at std 0.02, the output projection at ``init_std``."""
        inputs = [self.wkv_a, self.wkv_b]
        inputs += [self.wq] if self.q_lora_rank is None else [self.wq_a, self.wq_b]
        for linear in inputs:
            init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank is not None:
            self.q_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Pre-norm block: MLA, then a dense SwiGLU FFN (first layers) or a DeepSeekMoE layer."""

    def __init__(self, layer_id: int, args: DeepSeekV2ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.rms_norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.rms_norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.intermediate_size)
        # Deeper layers start smaller so the residual stream does not grow with depth.
        self.weight_init_std = args.initializer_range / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))

    def init_weights(self) -> None:
        """Norms to one, projections per ``weight_init_std``."""
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.weight_init_std)
        else:
            self.feed_forward.init_weights(self.weight_init_std)


class DeepSeekV2Model(RotaryTableModule):
    """DeepSeek-V2 decoder: ``model(tokens [b, s]) -> logits [b, s, vocab]`` in float32.

    ``model(tokens, positions, document_ids)`` masks attention to each document.
    """

    def __init__(self, args: DeepSeekV2ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.rms_norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so not saved; init_weights rebuilds it after to_empty().
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)
        self.init_weights()

    def _rotary_table(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of ``tokens`` ``[b, s]``.

        Args:
            tokens: Token ids.
            positions: RoPE positions ``[b, s]`` (default ``0 … s-1``); from
                ``common.document_positions`` they restart at every document.
            document_ids: ``[b, s]``; when given a token attends only within its document.
        """
        embeddings = self.tok_embeddings(tokens)
        freqs_cis, mask = rotations_and_mask(self.freqs_cis, tokens, positions, document_ids)
        h = embeddings
        for layer_index in range(self.args.n_layers):
            h = self.layers[str(layer_index)](h, freqs_cis, mask)
        self._after_layers(h, embeddings, positions, document_ids)
        return self.output(self.norm(h)).float()

    def _after_layers(
        self,
        h: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> None:
        """Hook for subclasses with extra heads on the last hidden state (DeepSeek-V3's MTP)."""

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Re-initialise every parameter and buffer (also after ``to_empty`` from meta).

        Args:
            buffer_device: Where to build the rotary table (default: where it lives now).
        """
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        # A pipeline stage lacks the parts other stages hold (None): it skips them.
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:  # logits start near zero: std 1/sqrt(dim), cut at 3 std
            std = self.args.dim**-0.5
            init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    # DeepSeekMoE bookkeeping (generic training code checks these with hasattr).

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in layer order (found through any AC/compile/FSDP wrappers)."""
        return [m for m in self.layers.modules() if isinstance(m, MoE)]

    def moe_aux_loss(self) -> torch.Tensor:
        """Sum of the expert-level balance losses of the last forward (0 when disabled)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if not losses:
            return torch.zeros((), device=self.norm.weight.device)
        return torch.stack(losses).sum()

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert since ``reset_expert_load``: ``[moe_layers, experts]``."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros(0, self.args.n_routed_experts)
        return torch.stack([m.tokens_per_expert for m in layers])

    def reset_expert_load(self) -> None:
        """Zero the routed-token counters of every MoE layer."""
        for m in self.moe_layers():
            m.tokens_per_expert.zero_()

    def update_expert_bias(self, global_load: torch.Tensor) -> None:
        """Aux-loss-free balancing step from ``[moe_layers, experts]`` loads over all ranks."""
        layers = self.moe_layers()
        if global_load.shape != (len(layers), self.args.n_routed_experts):
            raise ValueError(
                f"update_expert_bias expects a load of shape {(len(layers), self.args.n_routed_experts)}"
                f" (moe layers, routed experts), got {tuple(global_load.shape)}"
            )
        for m, load in zip(layers, global_load):
            m.update_expert_bias(load)

    def active_params(self) -> int:
        """Parameters used per token: all of them minus the routed experts not chosen."""
        total = sum(p.numel() for p in self.parameters())
        unused_per_layer = 0
        for m in self.moe_layers():
            per_expert = sum(w[0].numel() for w in (m.experts.w1, m.experts.w2, m.experts.w3))
            unused_per_layer += (m.num_experts - m.top_k) * per_expert
        return total - unused_per_layer
