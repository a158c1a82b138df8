"""Parameter counts and a per-device training-memory estimate, from a model built on meta.

``count_parameters`` and ``estimate_training_memory`` only read shapes, so they work on a
model built under ``torch.device("meta")`` (an 8B model costs no memory there).

Memory model (per device, everything in GiB), stated so the numbers can be checked:

- Persistent state, sharded by FSDP: fp32 parameters (4 B), fp32 gradients (4 B) and the
  two AdamW moments (8 B) — 16 B per parameter. Expert parallelism borrows its ranks
  from the FSDP shard dimension (``train/parallel_dims.py``), so routed experts are split
  ``ep`` ways and then FSDP-sharded over the remaining ``dp_shard / ep`` ranks; every
  parameter therefore ends up divided by the FSDP shard degree. HSDP replicas
  (``data_parallel_replicate_degree``) hold full copies of the shard and divide nothing.
- Transient compute copy: while FSDP2 runs a unit it holds the unit's all-gathered
  parameters in the compute dtype (bf16 under mixed precision on GPU, else fp32), and
  prefetches the next one, so two units (the two largest among the blocks, the token
  embedding and the output projection) are counted; a block's routed experts count
  ``1/ep`` of their size since each EP rank gathers only its own experts. Backward also
  holds one unit's unsharded gradient before the reduce-scatter. Without sharding
  (one FSDP rank) and in fp32 the model computes in place and this term is zero.
- Activations saved for backward for ``local_batch_size × seq_len`` tokens, in the compute
  dtype, per token and block (fused SDPA attention, which keeps no ``seq × seq`` scores):
  ``6·dim + 2·kv_dim + 4·ffn_active`` elements — the two norm inputs and outputs, q/k/v,
  the attention output, and SwiGLU's gate, up, activated gate and product.
  ``ffn_active`` is the active non-attention width, ``(active block params − attention
  params) / (3·dim)``, so a MoE layer counts only the experts a token is routed to.
  Activation checkpointing keeps only each checkpointed block's input (``dim``) plus one
  block's full activations while it is recomputed: ``full`` checkpoints every block,
  ``selective`` every other block.
- Logits: fp32 logits and the fp32 softmax gradient the loss keeps (8 B per vocabulary
  entry and token), plus the compute-dtype logits before the cast when that is not fp32.

Not counted: the CUDA context and allocator fragmentation (often 1–3 GiB), communication
buffers, and temporaries inside kernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

GIB = 1024**3
PARAM_BYTES = 4
"""fp32 master parameter."""
GRAD_BYTES = 4
"""fp32 gradient."""
ADAMW_BYTES = 8
"""AdamW ``exp_avg`` and ``exp_avg_sq`` in fp32."""


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model."""

    total: int
    """Every distinct parameter (tied weights counted once)."""
    active: int
    """Parameters one token goes through: ``model.active_params()`` for MoE, else ``total``."""
    embedding: int
    """Parameters of the token embedding (``model.tok_embeddings``)."""
    routed_experts: int = 0
    """Parameters of routed experts (submodules named ``experts``); 0 for dense models."""


@dataclass(frozen=True)
class MemoryLayout:
    """The parallel layout and dtypes the memory estimate assumes."""

    fsdp_degree: int
    """FSDP shard degree ``dp_shard`` (every parameter's persistent state is divided by it)."""
    expert_parallel_degree: int
    """``ep``: routed experts are split this many ways (borrowed from ``dp_shard``)."""
    on_gpu: bool
    """Whether training runs on CUDA (``training.device``; ``auto`` looks for a GPU here)."""
    compute_dtype: str
    """Dtype of the gathered parameters and activations (bf16 only under GPU mixed precision)."""
    reduce_dtype: str
    """Dtype of unsharded gradients before the reduce-scatter."""
    activation_checkpoint: str
    """``none``, ``selective`` or ``full``."""


def routed_expert_params(model: nn.Module) -> int:
    """Parameters held by submodules named ``experts`` (MoE routed experts; not ``shared_experts``)."""
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    return total


def count_parameters(model: nn.Module) -> ParamCounts:
    """Count a model's parameters (works on the meta device).

    Args:
        model: A model following the contract of ``docs/ARCHITECTURE.md``.

    Returns:
        Total, active-per-token and embedding counts; MoE models report ``active`` through
        their ``active_params()`` method.
    """
    total = sum(p.numel() for p in model.parameters())
    embedding_module = getattr(model, "tok_embeddings", None)
    embedding = (
        sum(p.numel() for p in embedding_module.parameters()) if embedding_module is not None else 0
    )
    active = int(model.active_params()) if hasattr(model, "active_params") else total
    return ParamCounts(
        total=total, active=active, embedding=embedding, routed_experts=routed_expert_params(model)
    )


def memory_layout(job_config: Any) -> MemoryLayout:
    """Read the parallel layout and dtypes from a (resolved) job config.

    Raises:
        ValueError: The degrees do not fit the world size (e.g. EP not dividing ``dp_shard``).
    """
    from titan_kedro.train.parallel_dims import ParallelDims

    training = job_config.training
    dims = ParallelDims.from_config(
        job_config, world_size=job_config.launch.world_size, device=torch.device("cpu")
    )
    device = training.device
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return MemoryLayout(
        fsdp_degree=dims.dp_shard,
        expert_parallel_degree=dims.ep,
        on_gpu=on_gpu,
        compute_dtype=training.mixed_precision_param if on_gpu else "float32",
        reduce_dtype=training.mixed_precision_reduce if on_gpu else "float32",
        activation_checkpoint=training.activation_checkpoint,
    )


def _bytes(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name), device="meta").element_size()


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _gathered_unit_sizes(model: nn.Module, ep: int) -> list[float]:
    """Parameters one rank holds unsharded while FSDP runs each unit."""
    units: list[float] = []
    for block in model.layers.values():
        experts = routed_expert_params(block)
        units.append(_numel(block) - experts + experts / ep)
    embeddings = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    units.append(_numel(embeddings))
    tied = (
        embeddings is not None
        and output is not None
        and getattr(output, "weight", None) is getattr(embeddings, "weight", None)
    )
    if output is not None and not tied:
        units.append(_numel(output))
    return units


def activation_elements_per_token(model: nn.Module, model_args: Any, counts: ParamCounts) -> float:
    """Elements one block saves for backward per token (see the module docstring)."""
    dim = model_args.dim
    n_heads = getattr(model_args, "n_heads", 1)
    head_dim = getattr(model_args, "head_dim", None) or dim // n_heads
    n_kv_heads = getattr(model_args, "n_kv_heads", None) or n_heads
    kv_dim = n_kv_heads * head_dim

    blocks = list(model.layers.values())
    block_params = sum(_numel(b) for b in blocks)
    non_block = counts.total - block_params
    active_per_block = (counts.active - non_block) / len(blocks)
    attention_per_block = sum(_numel(getattr(b, "attention", None)) for b in blocks) / len(blocks)
    ffn_active = max(active_per_block - attention_per_block, 0.0) / (3 * dim)
    return 6 * dim + 2 * kv_dim + 4 * ffn_active


def estimate_training_memory(
    model: nn.Module, model_args: Any, job_config: Any, counts: ParamCounts | None = None
) -> dict[str, float]:
    """Estimate peak training memory per device, in GiB, with a breakdown.

    Args:
        model: The model (built on the meta device is enough).
        model_args: Its args; ``dim``, ``vocab_size`` and, if present, ``n_heads``,
            ``n_kv_heads``, ``head_dim`` are read.
        job_config: The resolved job config (batch, sequence length, parallelism,
            mixed precision, activation checkpointing).
        counts: ``count_parameters(model)`` if already computed.

    Returns:
        ``params_gib, grads_gib, optimizer_gib`` (persistent, sharded), ``compute_copy_gib``
        (gathered parameters and unsharded gradients), ``activations_gib``, ``logits_gib``
        and ``total_gib``. The assumptions are listed in this module's docstring.
    """
    counts = counts or count_parameters(model)
    layout = memory_layout(job_config)
    compute_bytes = _bytes(layout.compute_dtype)
    reduce_bytes = _bytes(layout.reduce_dtype)
    per_device_params = counts.total / layout.fsdp_degree

    compute_copy = 0.0
    if layout.fsdp_degree > 1 or compute_bytes != 4:
        units = sorted(_gathered_unit_sizes(model, layout.expert_parallel_degree), reverse=True)
        compute_copy = sum(units[:2]) * compute_bytes
        if layout.fsdp_degree > 1:
            compute_copy += units[0] * reduce_bytes

    tokens = job_config.training.local_batch_size * job_config.training.seq_len
    n_blocks = len(model.layers)
    block_elements = activation_elements_per_token(model, model_args, counts)
    if layout.activation_checkpoint == "none":
        stored = n_blocks * block_elements
    else:
        checkpointed = n_blocks if layout.activation_checkpoint == "full" else n_blocks // 2
        stored = (
            checkpointed * model_args.dim
            + (n_blocks - checkpointed) * block_elements
            + block_elements
        )
    activations = tokens * stored * compute_bytes
    logit_bytes = 8 + (compute_bytes if compute_bytes != 4 else 0)
    logits = tokens * model_args.vocab_size * logit_bytes

    breakdown = {
        "params_gib": per_device_params * PARAM_BYTES / GIB,
        "grads_gib": per_device_params * GRAD_BYTES / GIB,
        "optimizer_gib": per_device_params * ADAMW_BYTES / GIB,
        "compute_copy_gib": compute_copy / GIB,
        "activations_gib": activations / GIB,
        "logits_gib": logits / GIB,
    }
    breakdown["total_gib"] = sum(breakdown.values())
    return breakdown


def _json_safe(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def model_card(spec: Any, model_args: Any, job_config: Any) -> dict[str, Any]:
    """Describe the configured model: args, parameter counts, FLOPs and memory per device.

    The model is built on the meta device, so even an 8B or 236B model costs no memory.

    Args:
        spec: The resolved ``TrainSpec``.
        model_args: The flavor's args with the overrides applied.
        job_config: The resolved job config (sequence length, batch, parallelism).

    Returns:
        A JSON-safe dict: ``spec, flavor, overrides, custom_model, args, parameters
        (total, active, embedding, non_embedding, routed_experts), seq_len,
        flops_per_token, memory (layout, estimate_gib), extensions`` (the values of the
        config fields the spec's extensions add).
    """
    with torch.device("meta"):
        model = spec.build_model(model_args)
    counts = count_parameters(model)
    seq_len = job_config.training.seq_len
    flops = spec.flops_per_token(model_args, seq_len) if spec.flops_per_token else None
    extensions = {
        section: {
            name: getattr(getattr(job_config, section), name) for name in extension.model_fields
        }
        for section, extension in spec.extensions.items()
    }
    model_cfg = job_config.model
    card = {
        "spec": spec.name,
        "flavor": model_cfg.flavor,
        "overrides": model_cfg.overrides,
        "custom_model": model_cfg.custom_model_path or model_cfg.custom_import,
        "args": model_args,
        "parameters": {
            **dataclasses.asdict(counts),
            "non_embedding": counts.total - counts.embedding,
        },
        "seq_len": seq_len,
        "flops_per_token": flops,
        "memory": {
            "layout": memory_layout(job_config),
            "estimate_gib": estimate_training_memory(model, model_args, job_config, counts),
        },
        "extensions": extensions,
    }
    return _json_safe(card)
