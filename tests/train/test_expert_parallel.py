"""Expert parallelism for DeepSeek-V2: all-to-all dispatch, gradients, norms, and training.

Two 2-process launches check the pieces against single-process references (token
routing, per-parameter gradients with and without EP, the clipped global norm, expert
loads and the bias update); three trainer runs check that EP=2, EP=1 and one process
with gradient accumulation train to the same losses and gradient norms, and validate
to the loss one process computes from the saved weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.evaluate import load_checkpoint_model
from titan_kedro.train.validation import mean_loss
from train.conftest import make_config
from train.helpers import (
    TINY_DEEPSEEK,
    read_metrics,
    run_ranks,
    tiny_job,
    train_each,
    train_here,
    validation_loader,
    write_token_dir,
)


def _build(spec: Any, args: Any, seed: int) -> torch.nn.Module:
    # The trainer's recipe: the same seed gives the same weights on every rank.
    with torch.device("meta"):
        model = spec.build_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def _check_dispatch_and_combine(rank: int) -> None:
    from titan_kedro.models.deepseek_v2.expert_parallel import combine_tokens, dispatch_tokens

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    counts = {0: [2, 0, 3, 1], 1: [1, 2, 0, 4]}  # tokens per global expert; rank 1 owns 2, 3
    mine = torch.tensor(counts[rank])
    expert_of_row = torch.repeat_interleave(torch.arange(4), mine)
    # Row value = 100·source rank + 10·expert + index within its expert block.
    index_in_block = torch.cat([torch.arange(int(c)) for c in mine])
    rows = (100 * rank + 10 * expert_of_row + index_in_block).float()
    routed = torch.stack([rows, -rows], dim=1).requires_grad_()

    local, local_counts, plan = dispatch_tokens(routed, mine, mesh)
    owned = [2 * rank, 2 * rank + 1]
    expected = [
        100 * src + 10 * e + i for e in owned for src in (0, 1) for i in range(counts[src][e])
    ]
    assert local[:, 0].tolist() == expected
    assert local_counts.tolist() == [counts[0][e] + counts[1][e] for e in owned]

    # A different "expert" per local block, then back to the sender in its own order.
    scale = torch.repeat_interleave(torch.tensor(owned, dtype=torch.float) + 1, local_counts)
    back = combine_tokens(local * scale[:, None], plan, mesh)
    torch.testing.assert_close(back, routed * (expert_of_row.float() + 1)[:, None])
    weights = torch.randn(back.shape, generator=torch.Generator().manual_seed(rank))
    (back * weights).sum().backward()
    torch.testing.assert_close(routed.grad, weights * (expert_of_row.float() + 1)[:, None])


def _check_training_step(rank: int, world: int, ep: int, replicate: int = 1) -> None:
    """One EP (or plain FSDP) step on this rank's batch against the 2-batch reference."""
    from titan_kedro.config.layout import Layout
    from titan_kedro.models.registry import get_train_spec
    from titan_kedro.train.grad_clip import clip_grad_norm_
    from titan_kedro.train.parallel_dims import ParallelDims

    spec = get_train_spec("deepseek_v2")
    args = spec.resolve_args("debugmodel", TINY_DEEPSEEK)
    reference = _build(spec, args, seed=3)
    dims = ParallelDims(Layout.build(world_size=world, dp_replicate=replicate, ep=ep))
    dims.build_mesh()
    config = make_config(training={"activation_checkpoint": "full"})
    model = spec.parallelize_fn(copy.deepcopy(reference), dims, config)

    tokens = torch.randint(0, 512, (world, 2, 17), generator=torch.Generator().manual_seed(5))
    loads, losses = [], []
    for r in range(world):
        reference.reset_expert_load()
        logits = reference(tokens[r, :, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[r, :, 1:].flatten())
        loss = loss + reference.moe_aux_loss()
        (loss / world).backward()
        losses.append(loss.detach())
        loads.append(reference.expert_load().clone())

    model.reset_expert_load()
    logits = model(tokens[rank, :, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[rank, :, 1:].flatten())
    loss = loss + model.moe_aux_loss()
    loss.backward()
    torch.testing.assert_close(loss.detach(), losses[rank], rtol=1e-5, atol=0)
    # The load is this rank's tokens routed to all experts, counted before dispatch.
    torch.testing.assert_close(model.expert_load(), loads[rank])

    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert len(experts) == 3 * args.n_moe_layers
    for name, param in experts.items():
        assert isinstance(param, DTensor) and param.shape[0] == args.n_routed_experts, name
        assert param.to_local().shape[0] == args.n_routed_experts // dims.dp_shard, name

    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.05)
    assert ref_norm > 0.05  # clipping really happened
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref_name = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(
            param.grad.full_tensor(), ref_params[ref_name].grad, rtol=1e-4, atol=1e-8, msg=name
        )

    # The trainer sums the loads over data-parallel ranks; the bias update then agrees.
    global_load = model.expert_load().clone()
    dist.all_reduce(global_load)
    model.update_expert_bias(global_load)
    reference.update_expert_bias(sum(loads))
    for ours, theirs in zip(model.moe_layers(), reference.moe_layers()):
        torch.testing.assert_close(ours.expert_bias, theirs.expert_bias)
        assert ours.expert_bias.abs().sum() > 0


def _checks(rank: int, world: int) -> None:
    _check_dispatch_and_combine(rank)
    _check_training_step(rank, world, ep=2)
    _check_training_step(rank, world, ep=1)


@pytest.mark.slow
def test_ep_dispatch_gradients_norm_and_load_match_single_process(tmp_path: Path) -> None:
    run_ranks(_checks, store=tmp_path / "store")


def _job(tmp_path: Path, token_dir: Path, name: str, *, nproc: int, ep: int) -> dict[str, Any]:
    return tiny_job(
        tmp_path / name,
        token_dir,
        model={"name": "deepseek_v2", "custom_model_path": None, "overrides": TINY_DEEPSEEK},
        training={"steps": 5, "global_batch_size": 4, "max_norm": 0.5},
        parallelism={"expert_parallel_degree": ep},
        # Validation at the last step over the same 8 held-out windows on 1 or 2 ranks.
        validation={"freq": 5, "steps": 4 // nproc},
        checkpoint={"enable": name == "ep2", "interval": 5},
    )


@pytest.mark.slow
def test_ep2_ep1_and_grad_accumulation_train_alike(tmp_path: Path) -> None:
    token_dir = write_token_dir(tmp_path / "tokens", n_train=4_000)
    jobs = {
        name: _job(tmp_path, token_dir, name, nproc=2, ep=ep)
        for name, ep in (("ep2", 2), ("ep1", 1))
    }
    for raw in jobs.values():
        raw["launch"] = {**raw["launch"], "nproc_per_node": 2}
    # Both 2-rank runs in one spawn of 2 gloo ranks; the reference in this process.
    run_ranks(train_each, list(jobs.values()), store=tmp_path / "store")
    runs = {name: read_metrics(raw["job"]["dump_folder"]) for name, raw in jobs.items()}
    runs["accum"] = train_here(_job(tmp_path, token_dir, "accum", nproc=1, ep=1))
    reference = runs["accum"]
    assert [row["step"] for row in reference] == [1, 2, 3, 4, 5]
    for name, rows in runs.items():
        for ours, theirs in zip(rows, reference, strict=True):
            for key in ("loss", "grad_norm", "moe_aux_loss"):
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (name, ours["step"], key)
            load, reference_load = (
                [x for layer in row["expert_load"] for x in layer] for row in (ours, theirs)
            )
            assert load == pytest.approx(reference_load, abs=1e-6), (name, ours["step"])
    assert any(row["grad_norm"] > 0.5 for row in reference)  # clipping took part
    # It learns: a later batch scores below the first (single batches are noisy, and the
    # learning rate decays to 0 by step 5).
    assert min(row["loss"] for row in reference[1:]) < reference[0]["loss"]

    # Each EP rank validates its own share; the logged mean is the one-process mean_loss
    # of the saved weights over all of those batches.
    raw = _job(tmp_path, token_dir, "accum", nproc=1, ep=1)  # the model, in one process
    resolved = resolve_job_config(raw)
    model = load_checkpoint_model(resolved, tmp_path / "ep2" / "ckpt" / "step-5").model
    loader = validation_loader(token_dir, seq_len=32, local_batch_size=2, seed=raw["job"]["seed"])
    expected, _ = mean_loss(
        model, loader, resolved.spec.build_loss_fn(resolved.config), n_batches=4
    )
    for name, rows in runs.items():
        assert rows[-1]["val_loss"] == pytest.approx(expected, rel=1e-4), name
