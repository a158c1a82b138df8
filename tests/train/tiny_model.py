"""A tiny dense decoder that follows the model contract, registered as train spec ``tiny_dense``.

Training tests point ``model.custom_model_path`` at this file, so the worker imports it
the same way it would import a user's model. ``tiny_moe`` adds a router and the MoE hooks
(``moe_aux_loss``, ``expert_load``, ``update_expert_bias``) to test the trainer's MoE
wiring without a real MoE model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_kedro.models import sharded_init as init
from titan_kedro.models.registry import TrainSpec, register_train_spec, unregister_train_spec

SPEC_NAME = "tiny_dense"
MOE_SPEC_NAME = "tiny_moe"


@dataclass(frozen=True)
class TinyArgs:
    vocab_size: int = 512
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 128
    moe_hooks: bool = False
    n_experts: int = 4


class Block(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.attn_norm = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.up = nn.Linear(args.dim, 4 * args.dim)
        self.down = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class TinyDecoder(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos = nn.Parameter(torch.zeros(args.max_seq_len, args.dim))
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.moe_hooks:
            self.router = nn.Linear(args.dim, args.n_experts, bias=False)
            self.register_buffer("expert_bias", torch.zeros(args.n_experts))
            self.register_buffer("_load", torch.zeros(1, args.n_experts))
        self._aux: torch.Tensor | None = None
        self.init_weights()

    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            if "norm" in name:
                init.ones_(p) if name.endswith("weight") else init.zeros_(p)
            elif name.endswith("bias"):
                init.zeros_(p)
            else:
                init.normal_(p, std=0.02)
        if self.args.moe_hooks:
            self.expert_bias.zero_()
            self._load.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        if self.args.moe_hooks:
            scores = self.router(x).float()
            probs = scores.softmax(-1)
            chosen = (scores + self.expert_bias).argmax(-1)
            self._load += torch.bincount(chosen.flatten(), minlength=self.args.n_experts)
            self._aux = 0.01 * probs.mean((0, 1)).pow(2).sum() * self.args.n_experts
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x)).float()


class TinyMoEDecoder(TinyDecoder):
    """``TinyDecoder`` with the MoE hooks the trainer looks for."""

    def moe_aux_loss(self) -> torch.Tensor:
        assert self._aux is not None
        return self._aux

    def expert_load(self) -> torch.Tensor:
        return self._load.clone()

    def reset_expert_load(self) -> None:
        self._load.zero_()

    def update_expert_bias(self, global_load: torch.Tensor) -> None:
        self.expert_bias += 1e-3 * torch.sign(global_load.mean() - global_load[0])


def tiny_flops_per_token(args: TinyArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) and attention.

    Per block the matmul weights are ``qkv`` (3·dim²), ``proj`` (dim²), ``up`` and ``down``
    (4·dim² each): 12·dim². Attention's ``q·kᵀ`` and ``scores·v`` cost 2·seq_len·dim
    multiply-adds per token over the full sequence (causal halving not taken, the
    built-in specs' convention), 2 FLOPs each, × 3 with the backward. The output
    projection (dim·vocab) and, with the MoE hooks, the router (dim·n_experts) are
    matmuls too; embeddings, positions, norms, biases and activations are not counted.
    """
    matmul = args.n_layers * 12 * args.dim * args.dim + args.dim * args.vocab_size
    if args.moe_hooks:
        matmul += args.dim * args.n_experts
    attention = 12 * args.n_layers * args.dim * seq_len
    return 6.0 * matmul + attention


def register() -> None:
    unregister_train_spec(SPEC_NAME)
    register_train_spec(
        TrainSpec(
            name=SPEC_NAME,
            model_cls=TinyDecoder,
            flavors={"debugmodel": TinyArgs()},
            flops_per_token=tiny_flops_per_token,
        )
    )
    unregister_train_spec(MOE_SPEC_NAME)
    register_train_spec(
        TrainSpec(
            name=MOE_SPEC_NAME,
            model_cls=TinyMoEDecoder,
            flavors={"debugmodel": TinyArgs(moe_hooks=True)},
            flops_per_token=tiny_flops_per_token,
        )
    )


register()
