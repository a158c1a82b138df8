"""Device mesh layouts, FSDP2 sharding, activation checkpointing and global-norm clipping."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_kedro.config.layout import Layout
from titan_kedro.models.parallel import apply_ac, apply_fsdp, parallelize_dense
from titan_kedro.train.grad_clip import clip_grad_norm_
from titan_kedro.train.parallel_dims import ParallelDims
from train.conftest import make_config


def _tiny(spec: Any, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return spec.build_model(spec.flavors["debugmodel"])


def _dims(replicate: int, ep: int, world: int) -> ParallelDims:
    return ParallelDims(Layout.build(world_size=world, dp_replicate=replicate, ep=ep))


def test_dims_read_the_config_layout_and_refuse_another_world() -> None:
    cfg = make_config(
        launch={"nproc_per_node": 4},
        parallelism={"data_parallel_replicate_degree": 2, "expert_parallel_degree": 2},
    )
    dims = ParallelDims.from_config(cfg, 4, torch.device("cpu"))
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.dp_shard_mod_ep) == (2, 2, 2, 1)
    with pytest.raises(ValueError, match=r"2 ranks were started.*world size is 4"):
        ParallelDims.from_config(cfg, 2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = dims.dp_mesh


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_keeps_names_and_gradients(tiny_spec: Any, mode: str) -> None:
    plain = _tiny(tiny_spec)
    wrapped = apply_ac(copy.deepcopy(plain), mode)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    n_wrapped = sum("CheckpointWrapper" in type(b).__name__ for b in wrapped.layers.values())
    assert n_wrapped == (2 if mode == "full" else 1)
    tokens = torch.randint(0, 512, (2, 16))
    for model in (plain, wrapped):
        model(tokens).logsumexp(-1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_auto_checkpointing_wraps_the_named_blocks_and_refuses_no_choice(tiny_spec: Any) -> None:
    model = apply_ac(_tiny(tiny_spec), "auto", ["1"])
    kinds = {name: type(b).__name__ for name, b in model.layers.items()}
    assert kinds["1"] == "CheckpointWrapper" and kinds["0"] != "CheckpointWrapper"
    with pytest.raises(ValueError, match="activation_checkpoint_blocks; run through the"):
        apply_ac(_tiny(tiny_spec), "auto")
    with pytest.raises(ValueError, match=r"names \['7'\], which are not blocks"):
        apply_ac(_tiny(tiny_spec), "auto", ["7"])


def _checks(rank: int, world: int, spec_path: str) -> None:
    from titan_kedro.models.registry import get_train_spec, import_custom_model

    import_custom_model(path=spec_path)
    spec = get_train_spec("tiny_dense")

    with_ep = _dims(1, 2, world)
    with_ep.build_mesh()
    assert with_ep.ep_mesh.size() == 2 and with_ep.expert_fsdp_mesh.size() == 1
    assert dist.get_world_size(with_ep.ep_group) == 2 and with_ep.ep_rank == rank
    dims = _dims(1, 1, world)
    dims.build_mesh()
    assert dims.fsdp_mesh.size() == 2 and dims.ep_mesh.size() == 1
    assert dims.dp_rank == rank and dims.dp_degree == 2

    reference = _tiny(spec)
    model = parallelize_dense(
        copy.deepcopy(reference), dims, make_config(training={"activation_checkpoint": "full"})
    )
    assert all(isinstance(p, DTensor) for p in model.parameters())
    torch.manual_seed(1)
    tokens = torch.randint(0, 512, (2, 16))  # same batch on both ranks
    for m in (reference, model):
        (m(tokens).logsumexp(-1).mean() * 50).backward()
    unclipped = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_(list(model.parameters()), 0.05)
    assert not isinstance(norm, DTensor)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    assert ref_norm > 0.05  # clipping really happened
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad.full_tensor(), a.grad, msg=name, rtol=1e-5, atol=1e-7)
    # HSDP: two replicas of one shard each give the same gradients as one process.
    hsdp_dims = _dims(2, 1, world)
    hsdp_dims.build_mesh()
    assert hsdp_dims.fsdp_mesh.ndim == 2
    hsdp = parallelize_dense(copy.deepcopy(_tiny(spec)), hsdp_dims, make_config())
    (hsdp(tokens).logsumexp(-1).mean() * 50).backward()
    for (name, grad), b in zip(unclipped.items(), hsdp.parameters()):
        torch.testing.assert_close(b.grad.full_tensor(), grad, msg=name, rtol=1e-5, atol=1e-7)
    # A rank-local non-finite gradient makes the global norm non-finite everywhere.
    first = next(model.parameters())
    if rank == 1:
        first.grad.to_local().fill_(float("nan"))
    assert not torch.isfinite(clip_grad_norm_(list(model.parameters()), 1.0))


@pytest.mark.slow
def test_fsdp_mesh_and_global_norm_clipping(tmp_path: Path, tiny_spec: Any) -> None:
    del tiny_spec
    from train.helpers import TINY_MODEL, run_ranks

    run_ranks(_checks, str(TINY_MODEL), store=tmp_path / "store")


def test_apply_fsdp_needs_layers() -> None:
    with pytest.raises(TypeError, match=r"'layers' nn\.ModuleDict"):
        apply_fsdp(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]
