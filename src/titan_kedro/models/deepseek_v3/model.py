"""DeepSeek-V3: DeepSeek-V2's network (MLA + DeepSeekMoE) plus multi-token prediction.

The routing differences (sigmoid scores, bias-corrected node-limited selection,
renormalized and scaled combine weights) live in the shared router
(``deepseek_v2.moe``), switched by the args. What V3 adds here is multi-token prediction
(DeepSeek-V3 §2.2): after the main blocks, module ``k = 1 … mtp_depth`` takes

    h_k = block_k(eh_proj([enorm(emb(t_{i+k})); hnorm(h_{k-1})]))     (h_0: last main hidden)

at positions ``i = 0 … s-1-k`` (the window holds ``t_{i+k}``) and predicts ``t_{i+k+1}``
through its own final norm and the shared output head. The concatenation order is the
released checkpoint's (``eh_proj`` columns: embedding first, then hidden state). MTP
modules are blocks ``layers.{n_layers + k - 1}`` (where the released weights keep them), so
activation checkpointing, compile, FSDP and expert parallelism treat them like any block.

Protocol (``docs/ARCHITECTURE.md``): after a forward in training mode ``mtp_outputs()``
returns one tensor per depth, ``[b, s - k, …]``, of the same kind as the forward's output
(logits, or hidden states when the trainer deferred the output projection); the trainer's
``train/mtp.py`` scores depth ``k`` against ``labels[:, k:]``. In eval mode MTP is skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_kedro.models import sharded_init as init
from titan_kedro.models.common import AttentionMask, RMSNorm, document_mask, rotary_for
from titan_kedro.models.deepseek_v2.model import DeepSeekV2Model, TransformerBlock
from titan_kedro.models.deepseek_v3.args import DeepSeekV3ModelArgs


class MTPBlock(TransformerBlock):
    """One multi-token-prediction module: input norms and projection, a block, a final norm."""

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs) -> None:
        super().__init__(layer_id, args)
        self.enorm = RMSNorm(args.dim, eps=args.rms_norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, eps=args.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        h: torch.Tensor,
        next_embeddings: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth ``k`` from depth ``k - 1``.

        Args:
            h: Previous depth's hidden states ``[b, s', dim]``.
            next_embeddings: Embeddings of the tokens ``k`` ahead ``[b, s', dim]``.
            freqs_cis: Rotations of these ``s'`` positions.
            mask: Attention mask of these positions.

        Returns:
            ``(hidden, normed)``: this depth's hidden states (input of the next depth) and
            their final norm (input of the shared output head).
        """
        x = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(h)], dim=-1))
        x = super().forward(x, freqs_cis, mask)
        return x, self.norm(x)

    def init_weights(self) -> None:
        """Block weights as any block; norms to one, the projection at std 0.02."""
        super().init_weights()
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)


class DeepSeekV3Model(DeepSeekV2Model):
    """DeepSeek-V3 decoder: ``model(tokens [b, s]) -> logits [b, s, vocab]`` in float32.

    With ``mtp_depth > 0``, a forward in training mode also leaves ``mtp_outputs()``.
    """

    args: DeepSeekV3ModelArgs

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__(args)
        for k in range(args.mtp_depth):
            layer_id = args.n_layers + k
            self.layers[str(layer_id)] = MTPBlock(layer_id, args)
            self.layers[str(layer_id)].init_weights()
        self._mtp_outputs: list[torch.Tensor] = []

    def _after_layers(
        self,
        h: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> None:
        self._mtp_outputs = []
        if not self.training:
            return
        seq = h.shape[1]
        for k in range(1, self.args.mtp_depth + 1):
            keep = seq - k
            if keep < 1:
                break
            pos = None if positions is None else positions[:, :keep]
            docs = None if document_ids is None else document_ids[:, :keep]
            freqs_cis = rotary_for(self.freqs_cis, pos, keep)
            mask = None if docs is None else document_mask(docs)
            block = self.layers[str(self.args.n_layers + k - 1)]
            h, normed = block(h[:, :keep], embeddings[:, k:], freqs_cis, mask)
            self._mtp_outputs.append(self.output(normed).float())

    def mtp_outputs(self) -> list[torch.Tensor]:
        """Depth ``k``'s output ``[b, s - k, …]`` (predicting ``labels[:, k:]``) of the last
        training-mode forward, ``k = 1 … mtp_depth``; empty in eval mode or without MTP."""
        return self._mtp_outputs
