"""Every tensor a replica-group collective sees lives on the group's device.

On CUDA the groups reduce through NCCL, which rejects a CPU tensor; TorchFT's ``Manager``
catches the error and votes the step down, so a CPU tensor in any collective means no
step is ever committed. These tests run the real ``Manager`` (a lighthouse and its server
on 127.0.0.1, one group alone in its quorum) over:

- ``meta`` (everywhere): a one-group stand-in for NCCL that refuses, like NCCL, any tensor
  off its device, the ``meta`` device. A tensor made without ``device=`` (on the CPU, the
  default) is refused exactly as NCCL refuses it on a GPU.
- ``cuda`` (a GPU machine: ``benchmarks/gpu_run.sh`` sets ``TITAN_TEST_FT_DEVICES=cuda``):
  TorchFT's real ``ProcessGroupNCCL``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupDummy
from train.helpers import tiny_job

from titan_kedro.ft import replica as replica_module
from titan_kedro.ft.identity import ReplicaIdentity
from titan_kedro.ft.replica import ReplicaGroupFT
from titan_kedro.models.resolve import resolve_job_config

DEVICES = os.environ.get("TITAN_TEST_FT_DEVICES", "meta").split(",")
"""Which cases run: ``meta`` here; ``benchmarks/gpu_run.sh`` asks for ``cuda`` (never a skip:
a case that is asked for runs, and fails without its device)."""


class DeviceCheckingPG(ProcessGroupDummy):
    """A one-group process group that, like NCCL, refuses tensors off its device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(0, 1)
        self.device = device
        self.seen: list[tuple[str, torch.device]] = []
        self.quorum_id = -1

    def _check(self, op: str, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self.seen.append((op, tensor.device))
            if tensor.device != self.device:
                raise ValueError(
                    f"{op}: tensor on {tensor.device}, but this process group's device is "
                    f"{self.device} (NCCL: 'Tensors must be CUDA and dense')"
                )

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
        self._check("allreduce", tensors)
        return super().allreduce(tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Any:
        self._check("send", tensors)
        return super().send(tensors, dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Any:
        self._check("recv", tensors)
        return super().recv(tensors, src_rank, tag)


@pytest.fixture(params=DEVICES)
def group_ft(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """A ``ReplicaGroupFT`` with a real Manager, alone in its quorum, and its device."""
    device = torch.device(request.param, 0) if request.param == "cuda" else torch.device("meta")
    raw = tiny_job(
        tmp_path,
        tmp_path / "tokens",
        fault_tolerance={"enable": True, "replica_groups": 2, "min_replicas": 1},
    )
    cfg = resolve_job_config(raw, source="test").config
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    pg = None
    if device.type == "meta":
        pg = DeviceCheckingPG(device)
        monkeypatch.setattr(replica_module, "_cross_group_pg", lambda device, timeout: pg)
    address = "http://" + lighthouse.address().removeprefix("http://")
    ft = ReplicaGroupFT(
        cfg,
        device,
        group_rank=0,
        state_dict=dict,
        load_state_dict=lambda state: None,
        identity=ReplicaIdentity(0, 0, address, None),
    )
    try:
        yield ft, pg, device
    finally:
        ft.shutdown()
        lighthouse.shutdown()


def test_every_replica_collective_runs_on_the_groups_device(group_ft: Any) -> None:
    ft, checking_pg, device = group_ft
    ft.begin_step()
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    param.grad = torch.ones(3, device=device)
    ft.average_gradients([param])
    ft.replica_mean(torch.zeros((), device=device))
    ft.replica_sum(torch.zeros(2, 4, device=device))
    committed = ft.should_commit()  # its own reduction (the heal report) included
    if checking_pg is not None:
        seen = checking_pg.seen
        off_device = [(op, where) for op, where in seen if where != device]
        assert off_device == [], f"collectives saw tensors off the group's device: {off_device}"
        assert [op for op, _ in seen] == ["allreduce"] * 4
    else:  # real NCCL: the reductions' values, and the heal report read back
        torch.testing.assert_close(param.grad, torch.ones(3, device=device))
        assert ft.step_metrics()["ft/participants"] == 1.0
    assert ft.manager.errored() is None, ft.manager.errored()
    assert committed  # the symptom on CUDA: a refused tensor votes every step down
