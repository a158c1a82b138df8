"""OptimizersContainer: parameter selection, weight-decay groups, state round trip."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from train.conftest import make_config

from titan_kedro.components.lr_schedulers import build_lr_schedulers
from titan_kedro.components.optimizers import OptimizersContainer, build_optimizers


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.proj(self.norm(self.tok_embeddings(x)))).sum()


def _ids(params: list[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


def test_skips_frozen_and_splits_decay_groups() -> None:
    torch.manual_seed(0)
    model = Small()
    cfg = make_config(optimizer={"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.2})
    opt = build_optimizers([model], cfg)
    assert isinstance(opt, torch.optim.Optimizer)
    decay, no_decay = opt.param_groups
    assert _ids(decay["params"]) == {id(model.proj.weight)}
    assert _ids(no_decay["params"]) == _ids(
        [model.tok_embeddings.weight, model.norm.weight, model.norm.bias, model.proj.bias]
    )
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    inner = opt.optimizers[0]
    assert isinstance(inner, torch.optim.AdamW)
    assert inner.defaults["betas"] == (0.8, 0.9) and inner.defaults["eps"] == 1e-6
    assert all(g["lr"] == 0.01 for g in opt.param_groups)


def test_decay_everywhere_when_disabled() -> None:
    model = Small()
    cfg = make_config(optimizer={"no_decay_norm_bias_embed": False, "weight_decay": 0.3})
    (group,) = build_optimizers([model], cfg).param_groups
    assert len(group["params"]) == 5 and group["weight_decay"] == 0.3


def test_step_matches_plain_adamw_and_lr_writes_through() -> None:
    torch.manual_seed(0)
    a, b = Small(), Small()
    b.load_state_dict(a.state_dict())
    cfg = make_config(
        optimizer={"no_decay_norm_bias_embed": False, "weight_decay": 0.1, "lr": 0.05}
    )
    container = build_optimizers([a], cfg)
    plain = torch.optim.AdamW(
        [p for p in b.parameters() if p.requires_grad], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1
    )
    x = torch.tensor([[1, 2, 3]])
    for _ in range(3):
        for model, opt in ((a, container), (b, plain)):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)
    container.param_groups[0]["lr"] = 0.5
    assert container.optimizers[0].param_groups[0]["lr"] == 0.5


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    cfg = make_config()
    x = torch.tensor([[1, 2, 3, 4]])

    def train(model: Small, opt: OptimizersContainer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(x).backward()
            opt.step()

    a = Small()
    b = Small()
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizers([a], cfg)
    train(a, opt_a, 2)
    saved_model = {k: v.clone() for k, v in a.state_dict().items()}
    saved_opt = copy.deepcopy(opt_a.state_dict())
    assert "state.proj.weight.exp_avg" in saved_opt
    train(a, opt_a, 2)

    b.load_state_dict(saved_model)
    opt_b = build_optimizers([b], cfg)
    opt_b.load_state_dict(saved_opt)
    train(b, opt_b, 2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_after_loading_a_state_the_groups_read_here_are_the_ones_the_schedule_moves() -> None:
    """The step logs ``param_groups[0]["lr"]``: after a resume it must follow the schedule
    (it once stayed at the checkpoint's lr while training used the scheduled one)."""
    cfg = make_config(training={"steps": 8}, lr_scheduler={"warmup_steps": 1})
    x = torch.tensor([[1, 2, 3, 4]])
    model = Small()
    opt = build_optimizers([model], cfg)
    schedule = build_lr_schedulers(opt, cfg)
    seen = []
    for _ in range(6):
        opt.zero_grad()
        model(x).backward()
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
        if len(seen) == 3:
            saved_opt, saved_schedule = copy.deepcopy(opt.state_dict()), schedule.state_dict()
    resumed = build_optimizers([model], cfg)
    resumed_schedule = build_lr_schedulers(resumed, cfg)
    resumed.load_state_dict(saved_opt)
    resumed_schedule.load_state_dict(saved_schedule)
    after = []
    for _ in range(3):
        after.append(resumed.param_groups[0]["lr"])
        assert after[-1] == resumed.optimizers[0].param_groups[0]["lr"]
        resumed_schedule.step()
    assert len(set(seen[3:])) == 3  # decaying: a stuck lr would fail below
    assert after == pytest.approx(seen[3:], rel=1e-12)


def test_nothing_to_train_fails_clearly() -> None:
    model = Small().requires_grad_(False)
    try:
        build_optimizers([model], make_config())
    except ValueError as err:
        assert "requires_grad" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_a_model_with_dtensor_and_plain_parameters_steps_like_plain_adamw(tmp_path) -> None:
    """Tensor parallelism without FSDP leaves some parameters plain: a fused AdamW group
    holding both kinds fails ("mixed torch.Tensor and DTensor"), so each kind gets its own
    group, and the step is the one plain AdamW takes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        model = Small()
        reference = copy.deepcopy(model)
        model.proj.weight = nn.Parameter(
            distribute_tensor(model.proj.weight.detach(), mesh, [Replicate()])
        )
        optimizer = {"lr": 0.01, "weight_decay": 0.1, "no_decay_norm_bias_embed": False}
        opt = build_optimizers([model], make_config(optimizer=optimizer))
        kinds = [{isinstance(p, DTensor) for p in g["params"]} for g in opt.param_groups]
        assert sorted(map(sorted, kinds)) == [[False], [True]]  # one kind per group
        plain = torch.optim.AdamW(
            [p for p in reference.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1
        )
        torch.manual_seed(1)
        grads = [torch.randn_like(p) for p in reference.parameters() if p.requires_grad]
        for _ in range(2):  # the same gradients into both (a forward would need DTensor inputs)
            for param, grad in zip([p for p in model.parameters() if p.requires_grad], grads):
                param.grad = (
                    distribute_tensor(grad, mesh, [Replicate()])
                    if isinstance(param, DTensor)
                    else grad.clone()
                )
            for param, grad in zip(plain.param_groups[0]["params"], grads):
                param.grad = grad.clone()
            opt.step()
            plain.step()
        for (name, param), theirs in zip(model.named_parameters(), reference.parameters()):
            ours = param.full_tensor() if isinstance(param, DTensor) else param
            assert torch.allclose(ours, theirs, atol=1e-6), name
    finally:
        dist.destroy_process_group()
