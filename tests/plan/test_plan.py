"""The memory and cost plan: hand-checked bytes, real model sizes at 8–256 ranks, and the
real trainer's allocations on 2 CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import PlanDoesNotFitError, build_plan, check_plan_fits, format_plan
from titan_kedro.train.fused_loss import default_chunk_size

DIM, VOCAB, LAYERS, FFN = 256, 512, 2, 768
ATTENTION = 2 * DIM * DIM + 2 * DIM * 128  # q, o: 256×256; k, v: 256×128 (8 kv heads of 16)
BLOCK = ATTENTION + 3 * DIM * FFN + 2 * DIM  # + SwiGLU + two norms
ROOT = 2 * VOCAB * DIM + DIM  # embeddings, output, final norm
TOTAL = ROOT + LAYERS * BLOCK
# Saved per token and block: 6·dim + 2·kv_dim + 4·ffn_active, ffn_active = non-attention / 3·dim.
ELEMENTS = 6 * DIM + 2 * 128 + 4 * (BLOCK - ATTENTION) / (3 * DIM)


def _plan(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {
            "name": "llama3",
            "flavor": "debugmodel",
            "overrides": {"vocab_size": VOCAB, "n_layers": LAYERS},
        },
        "metrics": {"peak_tflops": 1.0},
        "plan": {"device_memory_gib": 16.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    raw["training"] = {
        "seq_len": 32,
        "local_batch_size": 2,
        "device": "cpu",
        **raw.get("training", {}),
    }
    plan = build_plan(resolve_job_config(raw))
    assert not dist.is_initialized()  # the fake process group is gone
    return plan


def test_one_cpu_rank_by_hand() -> None:
    plan = _plan()
    got = plan["bytes_per_rank"]
    tokens = 2 * 32
    assert (got["params"], got["grads"], got["optimizer"]) == (TOTAL * 4, TOTAL * 4, TOTAL * 8)
    assert got["gathered_params"] == got["unsharded_grads"] == 0  # fp32 in place on one rank
    assert got["activations"] == int(tokens * LAYERS * ELEMENTS * 4)
    # Fused loss: one chunk of logits, the hidden-state and output-weight gradients.
    assert default_chunk_size(VOCAB) >= tokens
    assert got["loss"] == tokens * VOCAB * 4 + tokens * DIM * 4 + VOCAB * DIM * 4
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    assert plan["fits"] and plan["headroom_gib"] == pytest.approx(16 - 2 - got["total"] / 2**30)
    unfused = _plan(training={"fused_loss": False})["bytes_per_rank"]["loss"]
    assert unfused == tokens * VOCAB * 8  # fp32 logits + fp32 softmax gradient
    assert json.loads(json.dumps(plan)) == plan


def test_fsdp_over_four_ranks_shards_states_and_gathers_units() -> None:
    got = _plan(launch={"nproc_per_node": 4})["bytes_per_rank"]
    assert got["params"] == TOTAL * 4 // 4
    assert got["optimizer"] == 2 * got["params"]
    # The root stays gathered; two blocks (running + prefetched); one block's grads.
    assert got["gathered_params"] == (ROOT + 2 * BLOCK) * 4
    assert got["unsharded_grads"] == BLOCK * 4


def test_gpu_mixed_precision_halves_activations_and_gathers_bf16() -> None:
    plan = _plan(training={"device": "cuda"}, plan={"gpu": "H100", "device_memory_gib": None})
    got = plan["bytes_per_rank"]
    assert plan["device"]["name"] == "H100" and plan["device_memory_gib"] == 80.0
    assert plan["compute_dtype"] == "bfloat16"
    assert got["gathered_params"] == (ROOT + 2 * BLOCK) * 2
    assert got["activations"] == int(2 * 32 * LAYERS * ELEMENTS * 2)


@pytest.mark.parametrize(("mode", "checkpointed"), [("none", 0), ("selective", 1), ("full", 2)])
def test_activation_checkpointing_keeps_block_inputs_only(mode: str, checkpointed: int) -> None:
    got = _plan(training={"activation_checkpoint": mode, "seq_len": 64})["bytes_per_rank"]
    stored = (LAYERS - checkpointed) * ELEMENTS + checkpointed * DIM
    if checkpointed:
        stored += ELEMENTS  # one block recomputed at a time
    assert got["activations"] == int(2 * 64 * stored * 4)


def test_cost_is_flops_over_peak_at_the_assumed_mfu() -> None:
    plan = _plan(launch={"nproc_per_node": 2}, training={"steps": 100}, plan={"assumed_mfu": 0.5})
    cost = plan["cost"]
    assert cost["tokens_per_step"] == 2 * 2 * 32
    assert cost["flops_per_step"] == pytest.approx(cost["flops_per_token"] * 128)
    assert cost["step_time_s"] == pytest.approx(cost["flops_per_step"] / (2 * 1e12 * 0.5))
    assert cost["device_hours"] == pytest.approx(2 * 100 * cost["step_time_s"] / 3600)


def _real(model: str, flavor: str, nproc: int, nnodes: int = 1, **sections: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"name": model, "flavor": flavor},
        "launch": {"nproc_per_node": nproc, "nnodes": nnodes},
        "training": {"device": "cuda", "seq_len": 4096, "local_batch_size": 1},
        **sections,
    }
    return build_plan(resolve_job_config(raw))


def test_deepseek_v2_lite_ep8_params_are_an_eighth_of_the_model() -> None:
    plan = _real("deepseek_v2", "v2-lite", 8, parallelism={"expert_parallel_degree": 8})
    args = resolve_job_config({"model": {"name": "deepseek_v2", "flavor": "v2-lite"}}).model_args
    # Analytic count from the args: routed experts of the MoE layers, and everything else.
    moe_layers = args.n_layers - args.first_k_dense_replace
    experts = moe_layers * args.n_routed_experts * 3 * args.dim * args.moe_intermediate_size
    with torch.device("meta"):
        from titan_kedro.models import get_train_spec

        total = sum(p.numel() for p in get_train_spec("deepseek_v2").build_model(args).parameters())
    share = (experts / 8 + (total - experts) / 8) * 4  # EP 8 × FSDP 1 = dense FSDP 8
    assert plan["layout"] == {
        "dp_replicate": 1,
        "dp_shard": 8,
        "ep": 8,
        "dp_shard_mod_ep": 1,
        "grad_accum_steps": 1,
    }
    assert plan["bytes_per_rank"]["params"] == pytest.approx(share, rel=0.02)
    assert plan["bytes_per_rank"]["optimizer"] == 2 * plan["bytes_per_rank"]["params"]


def test_deepseek_v2_236b_needs_more_than_eight_h200s_and_fits_on_128() -> None:
    h200 = {"plan": {"gpu": "H200"}}
    eight = _real("deepseek_v2", "v2", 8, parallelism={"expert_parallel_degree": 8}, **h200)
    assert eight["device_memory_gib"] == 141.0 and not eight["fits"]
    assert eight["gib_per_rank"]["params"] > 100  # 236B × 4 B / 8
    assert any("more ranks" in s for s in eight["suggestions"])
    with pytest.raises(PlanDoesNotFitError, match="would help: more ranks"):
        check_plan_fits(eight)
    check_plan_fits(eight, enforce=False)
    many = _real("deepseek_v2", "v2", 8, 16, parallelism={"expert_parallel_degree": 8}, **h200)
    assert many["world_size"] == 128 and many["fits"], format_plan(many)
    assert many["suggestions"] == []
    assert many["planned_in_s"] < 60


def test_llama3_8b_fits_on_eight_gpus_at_8k() -> None:
    plan = _real(
        "llama3", "8B", 8, training={"device": "cuda", "seq_len": 8192, "local_batch_size": 1}
    )
    assert plan["fits"], format_plan(plan)
    states = sum(plan["bytes_per_rank"][k] for k in ("params", "grads", "optimizer"))
    assert states == pytest.approx(8_030_261_248 * 16 / 8, rel=1e-3)
    assert plan["gib_per_rank"]["loss"] < 3  # the fused loss never holds 8192 × 128256 logits


def _measure_real(rank: int, world: int, raw: dict[str, Any], out: str) -> None:
    from torch.distributed.tensor import DTensor

    from titan_kedro.train.parallel_dims import ParallelDims
    from titan_kedro.train.trainer import build_model

    resolved = resolve_job_config(raw)
    cfg, spec = resolved.config, resolved.spec
    dims = ParallelDims.from_config(cfg, world, torch.device("cpu"))
    dims.build_mesh()
    model = spec.parallelize_fn(
        build_model(spec, resolved.model_args, 0, torch.device("cpu")), dims, cfg
    )
    optimizers = spec.build_optimizers_fn([model], cfg)
    tokens = torch.randint(0, 512, (1, 16))
    spec.build_loss_fn(cfg)(model(tokens), tokens).backward()
    optimizers.step()

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    states = [
        v
        for opt in optimizers.optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    if rank == 0:
        Path(out).write_text(
            json.dumps({"params": params, "optimizer": sum(map(local_bytes, states))})
        )


@pytest.mark.slow
def test_plan_matches_what_the_trainer_allocates_on_two_cpu_ranks(tmp_path: Path) -> None:
    from train.helpers import run_ranks

    raw = {
        "model": {"name": "deepseek_v2", "flavor": "debugmodel"},
        "launch": {"nproc_per_node": 2},
        "parallelism": {"expert_parallel_degree": 2},
        "training": {"device": "cpu", "seq_len": 16, "local_batch_size": 1},
    }
    plan = build_plan(resolve_job_config(raw))["bytes_per_rank"]
    run_ranks(_measure_real, raw, str(tmp_path / "real.json"), store=tmp_path / "store")
    real = json.loads((tmp_path / "real.json").read_text())
    assert real["params"] > 10_000_000  # the debug model's shard, not nothing
    assert plan["params"] == pytest.approx(real["params"], rel=0.05)
    assert plan["optimizer"] == pytest.approx(real["optimizer"], rel=0.05)
