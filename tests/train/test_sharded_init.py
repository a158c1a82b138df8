"""Initialisation on shards: every layout's ranks start from one process's global tensors.

The trainer builds on the meta device, cuts stages and applies TP / EP / FSDP there, and
only then allocates and initialises each rank's shards (``models/sharded_init``). Here
4 gloo ranks build DeepSeek-V3 (MTP), DeepSeek-V2 under TP (q-LoRA off, so the
column-parallel ``wq`` is used) and Llama 3 in several layouts the way the trainer does, gather every parameter back to its
full tensor and compare it, bitwise, to the model one process builds with the same seed.
A custom model whose ``init_weights`` uses ``torch.nn.init`` is refused on shards, naming
the parameters and the method to write. Under pipelining a stage keeps its gathered
parameters after forward (``parallelism.fsdp_reshard_after_forward: default``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from train.helpers import TINY_DEEPSEEK, run_ranks, tiny_job, write_token_dir

pytestmark = pytest.mark.slow

LLAMA = {"vocab_size": 512, "n_layers": 4, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
MODELS = {
    "deepseek_v3": {**TINY_DEEPSEEK, "n_layers": 4, "mtp_depth": 1},
    "deepseek_v2": {**TINY_DEEPSEEK, "n_layers": 4, "q_lora_rank": None},
    "llama3": {**LLAMA, "ffn_hidden_dim": 128},
}
LAYOUTS: dict[str, list[dict[str, int]]] = {
    "deepseek_v3": [
        {"expert_parallel_degree": 4},  # FSDP 4, experts whole on their rank
        {"expert_parallel_degree": 2, "data_parallel_replicate_degree": 2},  # HSDP, EP 2
        {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2},  # PP 2 x FSDP 2
    ],
    "deepseek_v2": [  # V3's MTP has no TP plan yet: V2 (same blocks) takes the TP layouts
        {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},  # TP 2 x FSDP 2
        {"tensor_parallel_degree": 4, "expert_parallel_degree": 4},  # TP alone
    ],
    "llama3": [
        {"tensor_parallel_degree": 2},  # TP 2 x FSDP 2: FSDP over TP rows (strided)
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
        {
            "pipeline_parallel_degree": 2,
            "pipeline_schedule": "Interleaved1F1B",
            "pipeline_stages_per_rank": 2,
        },
    ],
}


def _config(root: Path, tokens: Path, model: str, parallelism: dict[str, int]) -> Any:
    from titan_kedro.models.resolve import resolve_job_config

    raw = tiny_job(
        root,
        tokens,
        model={"name": model, "flavor": "debugmodel", "custom_model_path": None,
               "overrides": MODELS[model]},
        training={"global_batch_size": 16, "local_batch_size": 2},
        parallelism=parallelism,
        launch={"nproc_per_node": 4},
    )  # fmt: skip
    return resolve_job_config(raw, source="test")


def _sharded_parts(resolved: Any) -> list[nn.Module]:
    """The trainer's recipe (``Trainer._build_model``) without data or optimizer."""
    from titan_kedro.models.sharded_init import init_on_shards
    from titan_kedro.train.parallel_dims import ParallelDims
    from titan_kedro.train.pipeline import build_model_parts

    cfg = resolved.config
    dims = ParallelDims.from_config(cfg, 4, torch.device("cpu"))
    dims.build_mesh()
    with torch.device("meta"):
        model = resolved.spec.build_model(resolved.model_args)
    parts, _, _ = build_model_parts(
        model, resolved.spec, resolved.model_args, dims, cfg=cfg,
        loss_fn=resolved.spec.build_loss_fn(cfg),
    )  # fmt: skip
    for part in parts:
        init_on_shards(part, cfg.job.seed, "cpu")
    return parts


def _check_layouts(rank: int, world: int, root: str) -> None:
    from titan_kedro.models import sharded_init
    from titan_kedro.models.sharded_init import clean_name
    from titan_kedro.train.trainer import build_model

    # Draws of 3 rows of 64 (1 row of wider tensors): shard edges fall inside draws, and a
    # tensor takes many draws, as at real sizes (the default makes these tiny ones one).
    sharded_init.CHUNK_ELEMENTS = 192
    tokens = Path(root) / "tokens"
    for model, layouts in LAYOUTS.items():
        one = _config(Path(root) / "one", tokens, model, {})
        reference = build_model(one.spec, one.model_args, one.config.job.seed, torch.device("cpu"))
        expected = dict(reference.named_parameters())
        for parallelism in layouts:
            seen = 0
            parts = _sharded_parts(_config(Path(root) / "x", tokens, model, parallelism))
            for part in parts:
                for name, param in part.named_parameters():
                    full = param.full_tensor() if isinstance(param, DTensor) else param
                    want = expected[clean_name(name)]
                    assert torch.equal(full.detach(), want.detach()), (model, parallelism, name)
                    seen += 1
            # A pipeline rank holds a share of the parameters, the others all of them.
            assert seen == len(expected) or "pipeline_parallel_degree" in parallelism, seen
            if model == "llama3" and "tensor_parallel_degree" not in parallelism:
                _check_reshard_after_forward(parts, pipelined=True)
    # Without pipelining a block frees its gathered parameters after forward (ZeRO-3).
    flat = _sharded_parts(_config(Path(root) / "x", tokens, "llama3", {}))
    _check_reshard_after_forward(flat, pipelined=False)


def _check_reshard_after_forward(parts: list[nn.Module], *, pipelined: bool) -> None:
    # parallelism.fsdp_reshard_after_forward: default keeps a stage's gathered parameters
    # from forward to backward (one all-gather per step, not one per microbatch): after a
    # forward its blocks hold plain (unsharded) tensors; otherwise sharded DTensors again.
    for part in parts:
        first = getattr(part, "pipeline_stage", {"first": True})["first"]
        x = torch.randint(0, 512, (2, 16)) if first else torch.randn(2, 16, 64)
        part(x)
        kept = [not isinstance(p, DTensor) for p in part.layers.parameters()]
        assert all(kept) if pipelined else not any(kept), (pipelined, kept)


def test_every_layout_starts_from_one_process_weights(tmp_path: Path) -> None:
    write_token_dir(tmp_path / "tokens", n_train=2_000)
    run_ranks(_check_layouts, str(tmp_path), store=tmp_path / "store", world=4)


class _PlainInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 4, bias=False)

    def init_weights(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p)


def test_a_model_initialised_by_torch_nn_init_is_refused_naming_the_method() -> None:
    from titan_kedro.models.sharded_init import ShardedInitError, init_on_shards

    with torch.device("meta"):
        model = _PlainInit()
    with pytest.raises(ShardedInitError, match=r"layers.0.weight, layers.0.bias, head.weight.*"
                       r"write init_weights\(self\) with titan_kedro.models.sharded_init"):  # fmt: skip
        init_on_shards(model, 0, "cpu")
    with torch.device("meta"):
        bare = nn.Linear(2, 2)
    with pytest.raises(ShardedInitError, match=r"Linear has no init_weights\(\)"):
        init_on_shards(bare, 0, "cpu")
