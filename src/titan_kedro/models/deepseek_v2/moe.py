"""DeepSeekMoE: shared experts plus top-k routed experts run as grouped matmuls.

The forward pass is split like torchtitan's so expert parallelism can be inserted
without touching the maths:

    router → top-k → ``permute`` (tokens sorted by expert, ``num_tokens_per_expert``)
    → ``self.experts(routed_input, num_tokens_per_expert)`` → ``unpermute`` (weight, sum)
    → + shared experts

An expert-parallel wrapper hooks ``self.experts`` (all-to-all of the sorted tokens and
their counts before, the reverse after), or overrides ``permute``/``unpermute``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_kedro.models import sharded_init as init
from titan_kedro.models.common import FeedForward
from titan_kedro.models.deepseek_v2.args import DeepSeekV2ModelArgs

# torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
_GROUPED_MM_STRIDE_BYTES = 16


class TokenChoiceTopKRouter(nn.Module):
    """Gate choosing ``top_k`` experts per token.

    Scores are a softmax over the experts (DeepSeek-V2) or a sigmoid per expert
    (DeepSeek-V3, ``scoring_func``). Selection is greedy or group-limited
    (``topk_method``); the aux-loss-free bias shifts the scores used for choosing only.
    """

    def __init__(self, args: DeepSeekV2ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.top_k = args.num_experts_per_tok
        self.sigmoid = args.scoring_func == "sigmoid"
        self.topk_method = args.topk_method
        self.n_group = args.n_group
        self.topk_group = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` ``[tokens, dim]``.

        Args:
            x: Token activations.
            expert_bias: Aux-loss-free balancing bias ``[experts]`` added to the scores
                for choosing experts only; None when that balancing is off.

        Returns:
            ``top_scores`` ``[tokens, top_k]`` float32 gate weights from the unbiased
            scores (normalized if ``norm_topk_prob``, times ``routed_scaling_factor``),
            ``selected_experts`` ``[tokens, top_k]`` and the balance-loss probabilities
            ``[tokens, experts]`` (the softmax, or the sigmoid scores normalized to sum
            to one per token as in DeepSeek-V3's sequence-wise loss).
        """
        # The gate runs in float32 whatever the compute dtype, as in DeepSeek's code.
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.topk_method != "greedy":
            choice = self._mask_to_best_groups(choice)
        selected = choice.topk(self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(1, selected)
        if self.norm_topk_prob:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        return top_scores * self.routed_scaling_factor, selected, probs

    def _mask_to_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        # Device/node-limited routing: keep the topk_group best groups, a group worth its
        # best expert (V2) or the sum of its two best (V3's noaux_tc).
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_group, -1)
        if self.topk_method == "noaux_tc":
            worth = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            worth = grouped.amax(dim=-1)
        best = worth.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(tokens, self.n_group, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU FFNs with stacked weights, applied to tokens sorted by expert.

    Weights are ``[num_experts, out, in]`` (the ``nn.Linear`` layout per expert):
    ``w1`` gate ``[E, hidden, dim]``, ``w3`` up ``[E, hidden, dim]``, ``w2`` down
    ``[E, dim, hidden]``. Expert parallelism shards dim 0.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    # Group sizes change every step: compiled, each new size would be a recompile. Left to
    # eager (grouped matmuls), while regional compile fuses everything around it.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Apply expert ``e`` to its contiguous block of rows of ``x`` ``[rows, dim]``.

        ``num_tokens_per_expert`` ``[num_local_experts]`` gives the block sizes in expert
        order; it must sum to ``rows``.
        """
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            # Mixed precision without FSDP (one GPU): autocast does not know
            # torch._grouped_mm, and its bf16-only CUDA kernel would be skipped for the
            # float32 weights. On CPU float32 grouped matmuls stay (casting to bf16 made a
            # CPU step 5 % slower, measured).
            dtype = torch.get_autocast_dtype("cuda")
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if self.use_grouped_mm and grouped_mm_applies(x, w1):
            return _experts_grouped_mm(x, w1, w2, w3, num_tokens_per_expert)
        return _experts_padded_bmm(x, w1, w2, w3, num_tokens_per_expert)

    def init_weights(self, init_std: float) -> None:
        """Gate at std 0.02, up and down projections at the depth-scaled ``init_std``."""
        init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        init.trunc_normal_(self.w3, mean=0.0, std=init_std)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Expert-parallel weights are DTensors sharded over experts; compute on the local shard.
    # (An isinstance test, unlike duck typing, is traced correctly by torch.compile.)
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _recomputing() -> bool:
    # A forward running inside backward is activation-checkpoint recomputation; counting
    # its tokens again would double the expert load of checkpointed blocks.
    return torch._C._current_graph_task_id() != -1


def grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run experts for ``x`` and weights like ``w``.

    It needs row strides in multiples of 16 bytes (model and hidden widths), matching
    dtypes, and on CUDA bfloat16 on compute capability 9.0 or newer. Checked on CPU with
    torch 2.13 (float32 and bfloat16): ``offs`` must be int32 cumulative group ends;
    groups may be empty or of any size; rows past ``offs[-1]`` come back uninitialised
    (so padding rows must be dropped); backward rejects zero-stride (expanded) output
    gradients, which ``unpermute``'s gather never produces.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    row_bytes = x.element_size()
    if any((size * row_bytes) % _GROUPED_MM_STRIDE_BYTES for size in w.shape[1:]):
        return False
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        # Its fake-tensor kernel takes bfloat16 only, so compiled CPU graphs use bmm.
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def _experts_grouped_mm(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def _experts_padded_bmm(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    # Scatter each expert's rows into a zero-padded [experts, longest group, dim] batch so
    # one bmm per projection serves every expert.
    num_experts = w1.shape[0]
    counts = num_tokens_per_expert.long()
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts)
    group_start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - group_start[expert_of_row]
    longest = int(counts.max()) if counts.numel() else 0
    padded = x.new_zeros(num_experts, longest, x.shape[-1])
    padded = padded.index_put((expert_of_row, slot), x)
    h = F.silu(torch.bmm(padded, w1.transpose(-2, -1))) * torch.bmm(padded, w3.transpose(-2, -1))
    out = torch.bmm(h, w2.transpose(-2, -1))
    return out[expert_of_row, slot]


class MoE(nn.Module):
    """DeepSeekMoE layer: ``shared_experts(x) + Σ_topk gate_e · expert_e(x)``.

    Buffers: ``expert_bias`` (aux-loss-free balancing, saved in checkpoints) and
    ``tokens_per_expert`` (tokens routed since the last reset; not saved).
    """

    def __init__(self, args: DeepSeekV2ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.top_k = args.num_experts_per_tok
        self.aux_loss_alpha = args.aux_loss_alpha
        self.seq_aux = args.seq_aux
        self.bias_update_speed = args.load_balance_bias_update_speed
        # DeepSeek-V3 routing always adds its (possibly trained or loaded) correction bias.
        self.always_bias = args.topk_method == "noaux_tc"
        self.router = TokenChoiceTopKRouter(args)
        self.experts = GroupedExperts(
            args.dim, args.moe_intermediate_size, args.n_routed_experts, args.use_grouped_mm
        )
        self.shared_experts = (
            FeedForward(args.dim, args.moe_intermediate_size * args.n_shared_experts)
            if args.n_shared_experts
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(self.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if self.always_bias or self.bias_update_speed > 0 else None
        top_scores, selected, scores = self.router(tokens, bias)
        num_tokens_per_expert = torch.bincount(selected.flatten(), minlength=self.num_experts)
        if not _recomputing():
            with torch.no_grad():
                self.tokens_per_expert.add_(num_tokens_per_expert)
        self.aux_loss = self.balance_loss(scores, selected, batch) if self.aux_loss_alpha else None

        routed_input, permutation = self.permute(tokens, selected)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.unpermute(routed_output, permutation, top_scores)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(batch, seq, dim)

    def permute(
        self, tokens: torch.Tensor, selected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy each token once per chosen expert, grouped by expert.

        Returns:
            ``routed_input`` ``[tokens × top_k, dim]`` sorted by expert (a stable sort, so
            tokens keep their order inside a group) and ``permutation``: for each row of
            ``routed_input``, its index in the flattened ``[tokens, top_k]`` choices.
        """
        permutation = torch.argsort(selected.flatten(), stable=True)
        return tokens[permutation // self.top_k], permutation

    def unpermute(
        self, routed_output: torch.Tensor, permutation: torch.Tensor, top_scores: torch.Tensor
    ) -> torch.Tensor:
        """Undo ``permute`` and sum each token's expert outputs weighted by its gates."""
        n_tokens, top_k = top_scores.shape
        # index_copy is a deterministic scatter (each slot is written once).
        unsorted = torch.zeros_like(routed_output).index_copy(0, permutation, routed_output)
        weighted = unsorted.view(n_tokens, top_k, -1).float() * top_scores.unsqueeze(-1)
        return weighted.sum(dim=1).to(routed_output.dtype)

    def balance_loss(
        self, scores: torch.Tensor, selected: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """Expert-level balance loss ``α Σ_i f_i P_i`` (DeepSeek-V2 §2.2.3, V3 eq. 17-20).

        ``f_i = E / (K T) · (tokens choosing expert i)`` and ``P_i`` is the mean router
        probability of expert ``i`` over the ``T`` tokens (``scores`` as the router
        returns them); per sequence and averaged when ``seq_aux`` (V3's sequence-wise
        loss), else over the whole micro-batch. It is 1·α when routing is uniform.
        """
        groups = batch if self.seq_aux else 1
        scores = scores.view(groups, -1, self.num_experts)
        chosen = selected.view(groups, -1)
        per_group_tokens = scores.shape[1]
        counts = torch.zeros(groups, self.num_experts, device=scores.device)
        counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=counts.dtype))
        load_fraction = counts * self.num_experts / (self.top_k * per_group_tokens)
        mean_prob = scores.mean(dim=1)
        return self.aux_loss_alpha * (load_fraction * mean_prob).sum(dim=1).mean()

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free step: raise the bias of under-loaded experts, lower over-loaded ones.

        Args:
            load: Tokens per expert ``[experts]`` summed over data-parallel ranks.
        """
        if not self.bias_update_speed:
            return
        load = load.to(self.expert_bias.device, torch.float32)
        delta = self.bias_update_speed * torch.sign(load.mean() - load)
        # A shift shared by all experts changes no choice; keep the biases centred at zero.
        self.expert_bias.add_(delta - delta.mean())

    def init_weights(self, init_std: float) -> None:
        """Router and expert weights; the balancing state back to zero."""
        init.trunc_normal_(self.router.gate.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
