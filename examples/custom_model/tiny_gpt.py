"""A tiny GPT-2-style model registered as the ``tiny_gpt`` train spec, from outside the project.

Point a job at this file and it trains like a built-in model::

    kedro run --params "model.custom_model_path=examples/custom_model/tiny_gpt.py,model.name=tiny_gpt"

Importing it registers the spec: its model class, two flavors, a config extension that
adds ``training.label_smoothing`` (default 0.0) and the loss that reads it. Everything
else (FSDP, optimizers, LR schedule, checkpoints) comes from the project's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from titan_kedro.models import TrainSpec, register_train_spec
from titan_kedro.models import sharded_init as init


@dataclass(frozen=True)
class TinyGptArgs:
    """Shape of the model; the fields every model needs are ``vocab_size, dim, n_layers, max_seq_len``."""

    vocab_size: int = 102400
    """Vocabulary size (102400: the DeepSeek tokenizer the data pipeline uses)."""
    dim: int = 64
    """Model width."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``dim``."""
    max_seq_len: int = 512
    """Learned positions available."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")


class Block(nn.Module):
    """Pre-LayerNorm block: causal multi-head attention, then a GELU MLP."""

    def __init__(self, args: TinyGptArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = nn.ModuleDict(
            {"qkv": nn.Linear(args.dim, 3 * args.dim), "proj": nn.Linear(args.dim, args.dim)}
        )
        self.mlp_norm = nn.LayerNorm(args.dim)
        self.mlp = nn.Sequential(
            nn.Linear(args.dim, args.mlp_ratio * args.dim),
            nn.GELU(),
            nn.Linear(args.mlp_ratio * args.dim, args.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.attention["qkv"](self.attention_norm(x))
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in qkv.split(dim, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention["proj"](attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.mlp_norm(x))


class TinyGpt(nn.Module):
    """Follows the project's model contract: ``layers`` ModuleDict, ``tok_embeddings``,
    ``norm``, ``output``, ``init_weights()`` and float32 logits."""

    def __init__(self, args: TinyGptArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by ``1/sqrt(2·n_layers)``."""
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                init.ones_(param)
            elif param.dim() == 1:
                init.zeros_(param)
            else:
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                init.normal_(param, mean=0.0, std=residual_std if residual else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h)).float()


class TinyGptTraining(BaseModel):
    """Adds ``training.label_smoothing`` to the job config when this spec is selected."""

    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    """Cross-entropy label smoothing (0 = plain cross-entropy)."""


def build_loss(job_config: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy with the configured label smoothing."""
    smoothing = getattr(job_config.training, "label_smoothing", 0.0)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2).float(),
            labels.flatten(),
            ignore_index=-100,
            label_smoothing=smoothing,
        )

    return loss_fn


def flops_per_token(args: TinyGptArgs, seq_len: int) -> float:
    """``6 · non-embedding matmul params + 12 · layers · dim · seq_len`` (the attention term)."""
    per_layer = 4 * args.dim * args.dim + 2 * args.mlp_ratio * args.dim * args.dim
    non_embedding = args.n_layers * per_layer + args.dim * args.vocab_size
    return 6 * non_embedding + 12 * args.n_layers * args.dim * seq_len


register_train_spec(
    TrainSpec(
        name="tiny_gpt",
        model_cls=TinyGpt,
        flavors={"tiny": TinyGptArgs(), "small": TinyGptArgs(dim=128, n_layers=4)},
        build_loss_fn=build_loss,
        flops_per_token=flops_per_token,
        extensions={"training": TinyGptTraining},
    )
)
