"""Pipeline-parallel settings: refused before any worker starts, and the default stage split."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from train.helpers import TINY_DEEPSEEK

from titan_kedro.config import ConfigError
from titan_kedro.config.layout import Layout
from titan_kedro.models.deepseek_v2 import flops_per_token
from titan_kedro.models.pipeline_split import balanced_layout, stage_costs
from titan_kedro.models.registry import get_train_spec
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.models.sharded_init import init_on_shards
from titan_kedro.pipelines.training import nodes as training_nodes
from titan_kedro.plan.fake_step import measured_micro_batches
from titan_kedro.train.pipeline import stage_config
from titan_kedro.train.pipeline.stages import make_stage
from titan_kedro.train.trainer import build_model


@pytest.mark.parametrize(
    ("degrees", "fragment"),
    [
        ({"world_size": 4, "pp": 3}, r"pipeline_parallel_degree=3 does not divide .* 4"),
        (
            {"world_size": 4, "pp": 2, "pp_schedule": "ZBVZeroBubble"},
            r"pipeline_schedule='ZBVZeroBubble' is not supported; use one of 1F1B, Interleaved1F1B",
        ),
        # PP 3 with one microbatch (the local batch) per step: the pipeline never fills.
        (
            {"world_size": 3, "pp": 3, "local_batch_size": 2},
            r"1 pipeline microbatch\(es\) per step do not fill a 3-rank pipeline .*"
            "pipeline_microbatch_size",
        ),
        (
            {"world_size": 2, "pp": 2, "local_batch_size": 4, "pp_microbatch_size": 3},
            r"pipeline_microbatch_size=3 does not divide the 4 samples",
        ),
        # 5 microbatches on 2 ranks: Interleaved1F1B runs rounds of 5 // 2 = 2.
        (
            {
                "world_size": 2,
                "pp": 2,
                "local_batch_size": 5,
                "pp_microbatch_size": 1,
                "pp_schedule": "Interleaved1F1B",
            },
            r"multiple of its 2 rounds",
        ),
        (
            {"world_size": 2, "pp": 2, "local_batch_size": 2, "pp_stages_per_rank": 2},
            r"pipeline_stages_per_rank=2: 1F1B runs one stage per rank",
        ),
    ],
)
def test_each_impossible_pipeline_names_its_key(degrees: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Layout.build(**degrees)


def test_pipeline_ranks_are_outside_data_parallelism_and_set_the_microbatches() -> None:
    layout = Layout.build(world_size=8, pp=2, local_batch_size=2, global_batch_size=16)
    # 8 ranks = 2 stages × 4 data-parallel ranks; 16 samples over 4 data ranks: accumulate 2.
    assert (layout.dp_shard, layout.data_ranks, layout.grad_accum_steps) == (4, 4, 2)
    assert (layout.n_microbatches, layout.pp_stages) == (2, 2)
    interleaved = Layout.build(
        world_size=2, pp=2, local_batch_size=4, pp_microbatch_size=1, pp_schedule="Interleaved1F1B"
    )
    assert (interleaved.pp_stages_per_rank, interleaved.pp_stages, interleaved.n_microbatches) == (
        2,
        4,
        4,
    )


def _raw(**parallelism: Any) -> dict[str, Any]:
    return {
        "model": {"name": "deepseek_v2", "overrides": TINY_DEEPSEEK},  # 3 blocks
        "training": {"seq_len": 32, "local_batch_size": 4},
        "launch": {"nproc_per_node": 2},
        "validation": {"freq": 0},
        "parallelism": {
            "pipeline_parallel_degree": 2,
            "pipeline_microbatch_size": 2,
            **parallelism,
        },
    }


@pytest.mark.parametrize(
    ("parallelism", "fragment"),
    [
        ({"pipeline_schedule": "Interleaved1F1B"}, r"4 pipeline stages .* the model has 3 blocks"),
        ({"pipeline_layout": [1, 1]}, r"pipeline_layout=\[1, 1\] must .* sum to the model's 3"),
        ({"pipeline_parallel_degree": 1, "pipeline_layout": [3]}, r"pipeline_parallel_degree is 1"),
    ],
)
def test_model_aware_pipeline_mistakes_fail_at_config_resolution(
    parallelism: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_job_config(_raw(**parallelism), source="test")


@pytest.mark.parametrize(
    ("sections", "key", "fix"),
    [
        # DeepSeek-V2 with 4 blocks on PP 3: 2 samples a step are 1 microbatch of 2, and a
        # 3-rank pipeline needs 3 in flight.
        (
            {
                "model": {"name": "deepseek_v2", "overrides": {**TINY_DEEPSEEK, "n_layers": 4}},
                "launch": {"nproc_per_node": 3},
                "training": {"seq_len": 32, "local_batch_size": 2, "global_batch_size": 2},
                "parallelism": {"pipeline_parallel_degree": 3},
            },
            "1 pipeline microbatch(es) per step do not fill a 3-rank pipeline",
            "lower parallelism.pipeline_microbatch_size or raise training.global_batch_size",
        ),
        # Llama 3's debugmodel has 16 heads: 3 ranks cannot split them.
        (
            {
                "model": {"name": "llama3"},
                "launch": {"nproc_per_node": 6},
                "parallelism": {"tensor_parallel_degree": 3},
            },
            "parallelism.tensor_parallel_degree=3 must divide model n_heads=16",
            "pick one of [1, 2, 4, 8, 16]",
        ),
    ],
    ids=["pp3-4-blocks-1-microbatch", "tp3-16-heads"],
)
def test_the_training_node_refuses_a_bad_layout_before_torchrun_starts(
    sections: dict[str, Any], key: str, fix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def launched(*args: Any) -> None:
        raise AssertionError("torchrun was started for an impossible layout")

    for name in ("build_plan", "launch_job"):  # what runs after resolving, planning first
        monkeypatch.setattr(training_nodes, name, launched)
    with pytest.raises(ConfigError) as refused:
        training_nodes.train_model({"vocab_size": 512}, {}, **sections)
    assert key in str(refused.value) and fix in str(refused.value)


def test_pipelined_validation_needs_whole_steps_of_batches() -> None:
    raw = _raw()
    raw["training"]["global_batch_size"] = 16  # 1 data rank × 4 samples × 4 accumulation steps
    raw["validation"] = {"freq": 2, "steps": 3}
    with pytest.raises(ConfigError, match=r"multiple of 4; set validation.steps to 4"):
        resolve_job_config(raw, source="test")
    raw["validation"]["steps"] = 8
    assert resolve_job_config(raw, source="test").config.validation.steps == 8


def test_the_balanced_split_weighs_costs_and_the_last_stages_head() -> None:
    # Equal counts ([2, 2]) put 1+5 against 5+5; [3, 1] puts 11 against 5: [2, 2] is best.
    assert balanced_layout([1.0, 5.0, 5.0, 5.0], 2) == [2, 2]
    # A last-stage head worth 6 makes [2, 2] cost 16 on the last stage; [3, 1]: 11 and 11.
    assert balanced_layout([1.0, 5.0, 5.0, 5.0], 2, last_extra=6.0) == [3, 1]
    assert balanced_layout([1.0] * 5, 5) == [1] * 5


def test_block_costs_add_up_to_the_models_flops_and_weigh_moe_blocks_apart() -> None:
    spec = get_train_spec("deepseek_v2")
    args = spec.resolve_args("debugmodel", TINY_DEEPSEEK)
    with torch.device("meta"):
        model = spec.build_model(args)
    costs, head = stage_costs(model, args, seq_len=32)
    assert costs[0] != costs[1] == costs[2]  # block 0 is dense, 1 and 2 are MoE
    # The MFU numerator (flops.py, counted from the args) less the final norm's 6 · dim.
    assert sum(costs) + head + 6 * args.dim == pytest.approx(flops_per_token(args, 32), rel=1e-12)


def test_stages_hold_whole_blocks_and_chain_to_the_models_output_and_mtp() -> None:
    spec = get_train_spec("deepseek_v3")
    args = spec.resolve_args("debugmodel", {**TINY_DEEPSEEK, "n_layers": 4, "mtp_depth": 1})
    model = build_model(spec, args, 0, torch.device("cpu"))

    def stage(index: int) -> torch.nn.Module:  # as the trainer: cut on meta, then initialised
        with torch.device("meta"):
            whole = spec.build_model(args)
        return init_on_shards(make_stage(whole, index, [2, 2]), 0, "cpu")

    # Each stage draws the whole model's values (by name), so the chain equals it exactly.
    first, last = stage(0), stage(1)
    assert set(first.layers) == {"0", "1"} and first.norm is None and first.output is None
    assert set(last.layers) == {"2", "3", "4"} and last.tok_embeddings is None  # 4: MTP
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict())  # same names: checkpoints see one model
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    # Document masking reaches every stage: two documents per row, positions restarting.
    docs = {
        "positions": torch.cat([torch.arange(6), torch.arange(10)]).repeat(2, 1),
        "document_ids": torch.cat([torch.zeros(6), torch.ones(10)]).long().repeat(2, 1),
    }
    for kwargs in ({}, docs):
        with torch.no_grad():
            expected = model(tokens, **kwargs)
            expected_mtp = model.mtp_outputs()[0]
            got = last(*first(tokens, **kwargs), **kwargs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(last.mtp_outputs()[0], expected_mtp, rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.equal(model(tokens, **docs), model(tokens))  # the masking matters


@pytest.mark.parametrize(
    ("mode", "blocks", "expected"),
    [("selective", None, ["2", "4"]), ("auto", ["0", "3"], ["3"]), ("full", None, None)],
)
def test_a_stage_recomputes_the_blocks_it_would_without_pipelining(
    mode: str, blocks: list[str] | None, expected: list[str] | None
) -> None:
    raw = _raw()
    raw["training"] |= {"activation_checkpoint": mode, "activation_checkpoint_blocks": blocks}
    cfg = resolve_job_config(raw, source="test").config
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({name: torch.nn.Identity() for name in ("2", "3", "4")})
    stage_cfg = stage_config(cfg, stage)
    # Selective means the model's even blocks (2 and 4 here), not the stage's first and third.
    assert stage_cfg.training.activation_checkpoint_blocks == expected
    assert cfg.training.activation_checkpoint == mode  # the job's own config is untouched


def test_the_plan_measures_enough_micro_batches_to_fill_the_pipeline() -> None:
    raw = _raw(pipeline_parallel_degree=4, pipeline_microbatch_size=None)
    raw["model"]["overrides"] = {**TINY_DEEPSEEK, "n_layers": 4}
    raw["launch"]["nproc_per_node"] = 4
    raw["training"] |= {"local_batch_size": 2, "global_batch_size": 8}  # 4 micro-batches
    cfg = resolve_job_config(raw, source="test").config
    # 2 (the plan's usual) or 3 micro-batches of one sample group leave ranks of a 4-stage
    # pipeline idle, so the plan measures all 4.
    assert measured_micro_batches(cfg) == 4
    raw["parallelism"]["pipeline_parallel_degree"] = 1
    raw["launch"]["nproc_per_node"] = 1  # one rank accumulating the same 4 micro-batches
    assert measured_micro_batches(resolve_job_config(raw, source="test").config) == 2
