"""Llama 3: a dense decoder with grouped-query attention, RoPE and SwiGLU.

Rotary embeddings use the "rotate half" channel pairing of transformers' Llama, so
Hugging Face checkpoints load without permuting the q/k projection rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titan_kedro.models import sharded_init as init
from titan_kedro.models.common import (
    AttentionMask,
    FeedForward,
    RMSNorm,
    RotaryTableModule,
    apply_rotary_emb_half,
    attention,
    precompute_freqs_cis,
    rotations_and_mask,
)
from titan_kedro.models.llama3.args import Llama3Args


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, no biases."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_size
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism this rank's share of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q = apply_rotary_emb_half(q, freqs_cis)
        k = apply_rotary_emb_half(k, freqs_cis)
        out = attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            mask,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, init_std: float) -> None:
        """q/k/v at std 0.02, the output projection at ``init_std``."""
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        """Norm gains to one, projections truncated-normal (output projections depth-scaled)."""
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Llama3Model(RotaryTableModule):
    """Llama 3 decoder: ``model(tokens[b, s]) -> logits[b, s, vocab]`` in float32.

    Args:
        args: The model shape; see ``Llama3Args``.
    """

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def _rotary_table(self) -> torch.Tensor:
        return precompute_freqs_cis(
            self.args.head_size, self.args.max_seq_len, self.args.rope_theta, self.args.rope_scaling
        )

    def init_weights(self) -> None:
        """Re-initialise every parameter and the rotary buffer (after ``to_empty`` from meta)."""
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = self._rotary_table()
        # A pipeline stage lacks the parts other stages hold (None): it skips them.
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of ``tokens`` ``[b, s]``; ``positions`` / ``document_ids`` ``[b, s]`` (from
        ``common.document_positions``) restart RoPE and mask attention per document."""
        h = self.tok_embeddings(tokens)
        freqs_cis, mask = rotations_and_mask(self.freqs_cis, tokens, positions, document_ids)
        for block in self.layers.values():
            h = block(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()
