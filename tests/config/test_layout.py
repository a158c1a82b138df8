"""The layout: degrees, batch split and accumulation, derived and validated in one place."""

from __future__ import annotations

import pytest

from titan_kedro.config import ConfigError, build_job_config
from titan_kedro.config.layout import Layout


def test_shard_minus_one_takes_what_replication_leaves_and_ep_borrows_from_it() -> None:
    layout = Layout.build(world_size=8, dp_replicate=2, ep=2)
    assert (layout.dp_shard, layout.dp_degree, layout.dp_shard_mod_ep) == (4, 8, 2)


@pytest.mark.parametrize(
    ("degrees", "fragment"),
    [
        ({"world_size": 4, "ep": 3}, r"expert_parallel_degree=3 must divide .* shard degree 4"),
        ({"world_size": 4, "dp_replicate": 2, "dp_shard": 3}, r"2 × shard 3 = 6.* world size is 4"),
        ({"world_size": 4, "dp_replicate": 3}, r"replicate_degree=3 does not divide .* 4"),
        ({"world_size": 2, "local_batch_size": 4, "global_batch_size": 12}, "multiple of"),
    ],
)
def test_each_impossible_layout_names_its_key(degrees: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Layout.build(**degrees)


def test_one_groups_dp_degree_and_every_groups_data_ranks_are_different_numbers() -> None:
    cfg = build_job_config(
        {
            "launch": {"nproc_per_node": 2},
            "fault_tolerance": {"enable": True, "replica_groups": 3},
            "training": {"local_batch_size": 2, "global_batch_size": 24},
        }
    )
    layout = cfg.layout
    # 2 ranks per group reduce gradients together; 3 groups × 2 ranks read different data.
    assert (layout.dp_degree, layout.data_ranks, layout.replica_groups) == (2, 6, 3)
    # 24 samples = 2 per micro-batch × 6 data ranks × 2 micro-batches; each group trains 8.
    assert (layout.grad_accum_steps, layout.group_batch_size, layout.global_batch_size) == (
        2,
        8,
        24,
    )


def test_the_job_config_refuses_an_expert_degree_that_does_not_divide_the_shards() -> None:
    with pytest.raises(ConfigError, match=r"parallelism\.expert_parallel_degree=2 must divide"):
        build_job_config({"parallelism": {"expert_parallel_degree": 2}})  # one rank


def test_tensor_parallelism_is_innermost_and_expert_parallelism_may_borrow_its_ranks() -> None:
    # 8 ranks: 2 tensor-parallel ranks per data rank leave 4 data ranks; EP 4 spans
    # 2 shard ranks × the 2 tensor ranks, leaving 2 ranks to shard each expert.
    layout = Layout.build(world_size=8, tp=2, ep=4, local_batch_size=1, global_batch_size=8)
    assert (layout.dp_shard, layout.dp_degree, layout.dp_shard_mod_ep) == (4, 4, 2)
    # The 2 ranks of a tensor-parallel group read one batch: 8 = 1 × 4 data ranks × 2 steps.
    assert (layout.data_ranks, layout.grad_accum_steps) == (4, 2)


@pytest.mark.parametrize(
    ("degrees", "fragment"),
    [
        ({"world_size": 4, "tp": 3}, r"tensor_parallel_degree=3 does not divide .* 4"),
        ({"world_size": 4, "tp": 2, "dp_shard": 4}, r"× tensor 2 = 8.* world size is 4"),
        ({"world_size": 8, "tp": 2, "dp_replicate": 3}, r"replicate_degree=3 .* divisor of 4"),
        ({"world_size": 4, "tp": 2, "ep": 8}, r"expert_parallel_degree=8 .* 2 × .* 2 = 4"),
    ],
)
def test_each_impossible_tensor_parallel_layout_names_its_key(degrees: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Layout.build(**degrees)
